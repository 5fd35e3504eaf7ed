//! Building blocks of models: parameters, the [`Module`] trait, layers,
//! initialisers and losses, shaped like `torch.nn`.
//!
//! ```
//! use voltaic::nn::{self, Module};
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

pub use layers::{AvgPool2d, BatchNorm, BatchNorm1d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten, LayerNorm, Linear, MaxPool2d};
pub use loss::{binary_cross_entropy_with_logits, nll_loss};

use crate::error::{bail, Result};
use crate::tensor::Tensor;
use crate::Device;
use std::sync::{Arc, Mutex};

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

/// A layer or a whole model.
pub trait Module: Send + Sync {
    /// Compute the output for an input batch.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Trainable parameters and buffers by their PyTorch `state_dict` names,
    /// parameters first within each layer.
    fn named_tensors(&self) -> Vec<(String, Parameter)> {
        vec![]
    }

    /// Switch between training and evaluation behaviour (dropout, batch norm).
    fn set_training(&self, _training: bool) {}

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

/// Layers applied in order; their tensors are named `"{index}.{name}"`, as
/// in PyTorch's `nn.Sequential`.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Sequential {
        Sequential { layers: vec![] }
    }

    /// Append a layer.
    #[allow(clippy::should_implement_trait, reason = "a builder step named as in candle's `Sequential::add`; it takes a layer, not a value")]
    pub fn add<M: Module + 'static>(mut self, layer: M) -> Sequential {
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
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for l in &self.layers {
            x = l.forward(&x)?;
        }
        Ok(x)
    }

    fn named_tensors(&self) -> Vec<(String, Parameter)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.named_tensors().into_iter().map(move |(n, p)| (format!("{i}.{n}"), p)))
            .collect()
    }

    fn set_training(&self, training: bool) {
        for l in &self.layers {
            l.set_training(training);
        }
    }
}

macro_rules! activation {
    ($(#[$m:meta])* $name:ident, |$x:ident| $e:expr) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name;
        impl Module for $name {
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
/// (or by PyTorch for the same architecture). Every tensor must be present
/// with the right shape, and the file must hold nothing else.
pub fn load(module: &dyn Module, path: impl AsRef<std::path::Path>) -> Result<()> {
    let path = path.as_ref();
    let file = crate::io::safetensors::SafetensorsFile::open(path)?;
    let names = file.names()?;
    let wanted = module.named_tensors();
    let mut loaded = Vec::with_capacity(wanted.len());
    for (name, p) in &wanted {
        let cur = p.value();
        if !names.contains(name) {
            bail!(Value, "load", "{}: tensor {name:?} is missing (the model expects shape {:?})", path.display(), cur.dims());
        }
        let t = file.tensor(name, cur.device())?;
        if t.dims() != cur.dims() {
            bail!(Shape, "load", "{}: tensor {name:?} has shape {:?}, the model expects {:?}", path.display(), t.dims(), cur.dims());
        }
        loaded.push((p.clone(), t.to_dtype(cur.dtype())?));
    }
    if let Some(extra) = names.iter().find(|n| !wanted.iter().any(|(w, _)| w == *n)) {
        bail!(Value, "load", "{}: tensor {extra:?} does not belong to the model", path.display());
    }
    for (p, t) in loaded {
        p.set(t)?;
    }
    Ok(())
}
