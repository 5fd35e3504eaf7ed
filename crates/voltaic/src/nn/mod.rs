//! Building blocks of models: parameters, the [`Module`] trait, layers,
//! initialisers and losses, shaped like `torch.nn`.
//!
//! ```
//! use voltaic::nn::{self, Forward, Module};
//! use voltaic::{DType, Device, Tensor};
//! voltaic::manual_seed(0);
//! let model = nn::Sequential::new()
//!     .add(nn::Linear::new(4, 8, true, Device::Cpu)?)
//!     .add(nn::ReLU)
//!     .add(nn::Linear::new(8, 3, true, Device::Cpu)?);
//! let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]); // PyTorch's state_dict names
//! let y = model.forward(&Tensor::randn(&[2, 4], DType::F32, Device::Cpu)?)?;
//! assert_eq!(y.dims(), &[2, 3]);
//! # Ok::<(), voltaic::Error>(())
//! ```

pub mod init;
mod layers;
mod loss;

pub(crate) use layers::linear;
pub use layers::{AvgPool2d, BatchNorm, BatchNorm1d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten, LayerNorm, Linear, MaxPool2d};
pub use loss::{binary_cross_entropy_with_logits, nll_loss};

use crate::error::{bail, Result};
use crate::ops::nn::{Conv2dOpts, Reduction};
use crate::tensor::Tensor;
use crate::{DType, Device};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// `#[derive(Module)]`: implements [`Module`] by visiting every field under
/// its name (the `voltaic-derive` crate).
pub use voltaic_derive::Module;

/// A tensor a module owns and updates: a trainable parameter (a leaf that
/// records gradients) or a buffer such as BatchNorm's running mean.
/// Clones share the same value.
#[derive(Clone, Debug)]
pub struct Parameter {
    value: Arc<Mutex<Tensor>>,
    trainable: bool,
}

impl Parameter {
    /// A trainable parameter holding `value` (made a leaf that requires gradients).
    pub fn new(value: Tensor) -> Result<Parameter> {
        Ok(Parameter { value: Arc::new(Mutex::new(value.detach().requires_grad()?)), trainable: true })
    }

    /// A buffer: module state that is saved but not trained.
    pub fn buffer(value: Tensor) -> Parameter {
        Parameter { value: Arc::new(Mutex::new(value.detach())), trainable: false }
    }

    /// The current value (for a trainable parameter, the leaf that gradients flow into).
    pub fn value(&self) -> Tensor {
        self.value.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether optimizers train this tensor.
    pub fn is_trainable(&self) -> bool {
        self.trainable
    }

    /// Replace the value (same shape and dtype); a trainable parameter
    /// becomes a fresh leaf with no gradient.
    pub fn set(&self, value: Tensor) -> Result<()> {
        let mut v = self.value.lock().unwrap_or_else(|e| e.into_inner());
        if value.dims() != v.dims() || value.dtype() != v.dtype() {
            bail!(Shape, "Parameter::set", "expected a {} tensor of shape {:?}, got {} {:?}", v.dtype(), v.dims(), value.dtype(), value.dims());
        }
        *v = if self.trainable { value.detach().requires_grad()? } else { value.detach() };
        Ok(())
    }

    /// The gradient accumulated by backward passes since the last `zero_grad`.
    pub fn grad(&self) -> Option<Tensor> {
        self.value().grad()
    }

    /// Forget the accumulated gradient.
    pub fn zero_grad(&self) {
        self.value().zero_grad();
    }
}

/// The state of a layer or a whole model: its parameters, buffers and
/// sub-modules, visited under PyTorch `state_dict` names, and its
/// training/evaluation switch. Derive it: `#[derive(Module)]` visits every
/// field (see [`voltaic_derive`](macro@Module)); the computation is the
/// separate [`Forward`] trait.
///
/// There are no silent defaults: a type that holds tensors says where they
/// are, so an optimizer or [`save`] never sees an empty model by mistake.
///
/// ```
/// use voltaic::nn::{self, Forward, Module, Parameter};
/// use voltaic::{Device, Result, Tensor};
///
/// #[derive(Module)]
/// struct Mlp {
///     fc1: nn::Linear,
///     fc2: nn::Linear,
///     scale: Parameter,
///     #[module(skip)]
///     note: &'static str,
/// }
///
/// impl Forward for Mlp {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         self.fc2.forward(&self.fc1.forward(x)?.relu()?)?.mul(self.scale.value())
///     }
/// }
///
/// let dev = Device::Cpu;
/// let m = Mlp {
///     fc1: nn::Linear::new(4, 8, true, dev)?,
///     fc2: nn::Linear::new(8, 2, false, dev)?,
///     scale: Parameter::new(Tensor::ones(&[1], voltaic::DType::F32, dev)?)?,
///     note: "a two-layer perceptron",
/// };
/// let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "scale"]);
/// # Ok::<(), voltaic::Error>(())
/// ```
///
/// A bare `Tensor` field does not compile, so no tensor is lost by mistake:
///
/// ```compile_fail
/// use voltaic::nn::Module;
/// #[derive(Module)]
/// struct Scaled {
///     scale: voltaic::Tensor, // wrap it in a Parameter, or #[module(skip)]
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an `nn::Module`",
    label = "this holds no parameters Voltaic can see",
    note = "derive it with `#[derive(Module)]`; every field must be a module: a `Parameter`, a layer, a `Vec`/`Option`/`Box` of them, or a plain value",
    note = "a bare `Tensor` field is not state: wrap it in `Parameter::new` (trained) or `Parameter::buffer` (saved, not trained), or mark it `#[module(skip)]`"
)]
pub trait Module: Send + Sync {
    /// Call `f` with every parameter and buffer, named `prefix.name` (just
    /// `name` when `prefix` is empty), in a fixed order: this is the one
    /// method every other one builds on.
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter));

    /// Switch between training and evaluation behaviour (dropout, batch
    /// norm), here and in every sub-module.
    fn set_training(&self, training: bool);

    /// Trainable parameters and buffers by their PyTorch `state_dict` names,
    /// in visiting order.
    fn named_tensors(&self) -> Vec<(String, Parameter)> {
        let mut out = Vec::new();
        self.visit_tensors("", &mut |name, p| out.push((name, p.clone())));
        out
    }

    /// Trainable parameters by name.
    fn named_parameters(&self) -> Vec<(String, Parameter)> {
        self.named_tensors().into_iter().filter(|(_, p)| p.is_trainable()).collect()
    }

    /// Trainable parameters.
    fn parameters(&self) -> Vec<Parameter> {
        self.named_parameters().into_iter().map(|(_, p)| p).collect()
    }

    /// Training mode.
    fn train(&self) {
        self.set_training(true)
    }

    /// Evaluation mode.
    fn eval(&self) {
        self.set_training(false)
    }

    /// Forget every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }

    /// Compute every parameter and buffer that is still pending (buffers such
    /// as running statistics are updated lazily by `forward`).
    fn realize_state(&self) -> Result<()> {
        let vals: Vec<Tensor> = self.named_tensors().into_iter().map(|(_, p)| p.value()).collect();
        Tensor::realize_all(&vals.iter().collect::<Vec<_>>())
    }

    /// Move every parameter and buffer to `device`.
    fn to_device(&self, device: Device) -> Result<()> {
        for (_, p) in self.named_tensors() {
            p.set(p.value().to_device(device)?)?;
        }
        Ok(())
    }
}

/// A module that maps an input batch to an output: PyTorch's `forward`.
pub trait Forward: Module {
    /// Compute the output for an input batch.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
}

/// `prefix.name`, or `name` when `prefix` is empty: how nested state names
/// are joined (used by `#[derive(Module)]`).
#[doc(hidden)]
pub fn join_name(prefix: &str, name: &str) -> String {
    match (prefix.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (false, true) => prefix.to_string(),
        (false, false) => format!("{prefix}.{name}"),
    }
}

/// Whether a module is in training mode (PyTorch's `self.training`): a field
/// for layers whose behaviour differs (dropout, batch norm). It starts in
/// training mode, as PyTorch modules do, and follows `set_training`.
#[derive(Debug)]
pub struct Training(AtomicBool);

impl Training {
    /// In training mode.
    pub fn new() -> Training {
        Training(AtomicBool::new(true))
    }

    /// Training (true) or evaluation (false)?
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for Training {
    fn default() -> Training {
        Training::new()
    }
}

impl Clone for Training {
    fn clone(&self) -> Training {
        Training(AtomicBool::new(self.get()))
    }
}

impl Module for Training {
    fn visit_tensors(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Parameter)) {}
    fn set_training(&self, training: bool) {
        self.0.store(training, Ordering::Relaxed)
    }
}

impl Module for Parameter {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        f(prefix.to_string(), self)
    }
    fn set_training(&self, _training: bool) {}
}

/// Plain values hold no tensors, so a derived module may keep them as fields.
macro_rules! stateless {
    ($($t:ty),*) => {$(
        impl Module for $t {
            fn visit_tensors(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Parameter)) {}
            fn set_training(&self, _training: bool) {}
        }
    )*};
}
stateless!(bool, u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, f32, f64, char, String, &'static str, (), DType, Device, Conv2dOpts, Reduction);

impl<T: Send + Sync + ?Sized> Module for std::marker::PhantomData<T> {
    fn visit_tensors(&self, _prefix: &str, _f: &mut dyn FnMut(String, &Parameter)) {}
    fn set_training(&self, _training: bool) {}
}

/// A list of modules is named like PyTorch's `nn.ModuleList`: `field.0`, `field.1`, ...
impl<M: Module> Module for Vec<M> {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        self.as_slice().visit_tensors(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.as_slice().set_training(training)
    }
}

impl<M: Module> Module for [M] {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        for (i, m) in self.iter().enumerate() {
            m.visit_tensors(&join_name(prefix, &i.to_string()), f);
        }
    }
    fn set_training(&self, training: bool) {
        self.iter().for_each(|m| m.set_training(training))
    }
}

impl<M: Module, const N: usize> Module for [M; N] {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        self.as_slice().visit_tensors(prefix, f)
    }
    fn set_training(&self, training: bool) {
        self.as_slice().set_training(training)
    }
}

/// An absent optional module (a layer without bias) has no tensors.
impl<M: Module> Module for Option<M> {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        if let Some(m) = self {
            m.visit_tensors(prefix, f)
        }
    }
    fn set_training(&self, training: bool) {
        if let Some(m) = self {
            m.set_training(training)
        }
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        (**self).visit_tensors(prefix, f)
    }
    fn set_training(&self, training: bool) {
        (**self).set_training(training)
    }
}

impl<M: Module + ?Sized> Module for std::sync::Arc<M> {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        (**self).visit_tensors(prefix, f)
    }
    fn set_training(&self, training: bool) {
        (**self).set_training(training)
    }
}

impl<M: Forward + ?Sized> Forward for Box<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
}

impl<M: Forward + ?Sized> Forward for std::sync::Arc<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
}

/// Layers applied in order; their tensors are named `"{index}.{name}"`, as
/// in PyTorch's `nn.Sequential`.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Forward>>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Sequential {
        Sequential { layers: vec![] }
    }

    /// Append a layer.
    #[allow(clippy::should_implement_trait, reason = "a builder step named as in candle's `Sequential::add`; it takes a layer, not a value")]
    pub fn add<M: Forward + 'static>(mut self, layer: M) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// No layers?
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(String, &Parameter)) {
        self.layers.visit_tensors(prefix, f)
    }

    fn set_training(&self, training: bool) {
        self.layers.set_training(training)
    }
}

impl Forward for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for l in &self.layers {
            x = l.forward(&x)?;
        }
        Ok(x)
    }
}

macro_rules! activation {
    ($(#[$m:meta])* $name:ident, |$x:ident| $e:expr) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, Module)]
        pub struct $name;
        impl Forward for $name {
            fn forward(&self, $x: &Tensor) -> Result<Tensor> {
                $e
            }
        }
    };
}

activation!(/// `max(x, 0)`.
    ReLU, |x| x.relu());
activation!(/// GELU, erf form (PyTorch's default).
    GELU, |x| x.gelu());
activation!(/// Hyperbolic tangent.
    Tanh, |x| x.tanh());
activation!(/// Logistic sigmoid.
    Sigmoid, |x| x.sigmoid());
activation!(/// `x * sigmoid(x)`.
    SiLU, |x| x.silu());

/// Save a module's parameters and buffers as safetensors under their
/// PyTorch `state_dict` names (atomically: temporary file, then rename).
pub fn save(module: &dyn Module, path: impl AsRef<std::path::Path>) -> Result<()> {
    let tensors: Vec<(String, Tensor)> = module.named_tensors().into_iter().map(|(n, p)| (n, p.value())).collect();
    crate::io::safetensors::save(path, &tensors)
}

/// Load a module's parameters and buffers from safetensors saved by [`save`]
/// (or by PyTorch for the same architecture), strictly, as PyTorch's
/// `load_state_dict` does by default: every tensor must be present with the
/// right shape and the file must hold nothing else. The error lists every
/// missing, unexpected and mis-shaped name; on error nothing is changed.
pub fn load(module: &dyn Module, path: impl AsRef<std::path::Path>) -> Result<()> {
    load_state_dict(module, path, true).map(|_| ())
}

/// The names a non-strict [`load_state_dict`] passed over (PyTorch's
/// `_IncompatibleKeys`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IncompatibleKeys {
    /// Tensors of the module that the file does not hold (left unchanged).
    pub missing: Vec<String>,
    /// Tensors in the file that the module does not have (ignored).
    pub unexpected: Vec<String>,
}

impl IncompatibleKeys {
    /// Nothing missing, nothing unexpected.
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty()
    }
}

/// Load what a safetensors file holds into `module`. With `strict`, as
/// [`load`]; without, missing and unexpected names are returned rather than
/// refused (PyTorch's `load_state_dict(strict=False)`). A tensor whose shape
/// differs from the module's is an error either way, and on any error the
/// module is left unchanged.
pub fn load_state_dict(module: &dyn Module, path: impl AsRef<std::path::Path>, strict: bool) -> Result<IncompatibleKeys> {
    let path = path.as_ref();
    let file = crate::io::safetensors::SafetensorsFile::open(path)?;
    let names = file.names()?;
    let wanted = module.named_tensors();
    let mut keys = IncompatibleKeys::default();
    let mut misshaped = Vec::new();
    let mut missing_shown = Vec::new();
    let mut loaded = Vec::with_capacity(wanted.len());
    for (name, p) in &wanted {
        let cur = p.value();
        if !names.contains(name) {
            keys.missing.push(name.clone());
            missing_shown.push(format!("{name:?} {:?}", cur.dims()));
            continue;
        }
        let (dims, _) = file.info(name)?;
        if dims != cur.dims() {
            misshaped.push(format!("{name:?} is {dims:?} in the file, {:?} in the model", cur.dims()));
            continue;
        }
        loaded.push((p.clone(), name));
    }
    keys.unexpected = names.iter().filter(|n| !wanted.iter().any(|(w, _)| w == *n)).cloned().collect();
    let mut problems = Vec::new();
    if !misshaped.is_empty() {
        problems.push(format!("mis-shaped: {}", misshaped.join(", ")));
    }
    if strict && !keys.missing.is_empty() {
        problems.push(format!("missing: {}", missing_shown.join(", ")));
    }
    if strict && !keys.unexpected.is_empty() {
        problems.push(format!("unexpected: {}", keys.unexpected.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")));
    }
    if !problems.is_empty() {
        bail!(Value, "load", "{}: the file does not match the model ({})", path.display(), problems.join("; "));
    }
    let mut values = Vec::with_capacity(loaded.len());
    for (p, name) in &loaded {
        let cur = p.value();
        values.push(file.tensor(name, cur.device())?.to_dtype(cur.dtype())?);
    }
    for ((p, _), t) in loaded.into_iter().zip(values) {
        p.set(t)?;
    }
    Ok(keys)
}
