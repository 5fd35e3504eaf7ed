//! Optimizers, learning-rate schedules and gradient clipping, as `torch.optim`.
//!
//! A step is a few tensor ops per parameter (lazy, fused by the scheduler);
//! the new parameters and the optimizer state are realized together, so on
//! a GPU a whole step is one submission and nothing returns to the host.
//!
//! ```
//! use voltaic::nn::{Forward, Linear, Module};
//! use voltaic::optim::{Adam, Optimizer};
//! use voltaic::{DType, Device, Tensor};
//! voltaic::manual_seed(1);
//! let layer = Linear::new(3, 1, true, Device::Cpu)?;
//! let mut opt = Adam::new(layer.parameters(), 0.1);
//! let x = Tensor::randn(&[8, 3], DType::F32, Device::Cpu)?;
//! let first = layer.forward(&x)?.sqr()?.mean(&[], false)?.item::<f32>()?;
//! for _ in 0..20 {
//!     opt.zero_grad();
//!     layer.forward(&x)?.sqr()?.mean(&[], false)?.backward()?;
//!     opt.step()?;
//! }
//! assert!(layer.forward(&x)?.sqr()?.mean(&[], false)?.item::<f32>()? < first);
//! # Ok::<(), voltaic::Error>(())
//! ```

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::nn::Parameter;
use crate::tensor::Tensor;

/// What every optimizer offers.
pub trait Optimizer {
    /// Update every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;
    /// [`Optimizer::step`], with `also` realized in the same realization
    /// as the update: a training loop's metrics (the loss, the correct
    /// count) then cost no realization of their own, and the loss is not
    /// computed a second time from the logits the update's realization
    /// kept. This default steps, then realizes `also`.
    ///
    /// ```
    /// # use voltaic::nn::{Forward, Linear, Module};
    /// # use voltaic::optim::{Optimizer, Sgd};
    /// # use voltaic::{DType, Device, Tensor};
    /// let layer = Linear::new(3, 1, true, Device::Cpu)?;
    /// let mut opt = Sgd::new(layer.parameters(), 0.1);
    /// let x = Tensor::randn(&[8, 3], DType::F32, Device::Cpu)?;
    /// let loss = layer.forward(&x)?.sqr()?.mean(&[], false)?;
    /// loss.backward()?;
    /// let seen = loss.detach();
    /// opt.step_with(&[&seen])?;
    /// assert!(seen.item::<f32>()? >= 0.0);
    /// # Ok::<(), voltaic::Error>(())
    /// ```
    fn step_with(&mut self, also: &[&Tensor]) -> Result<()> {
        self.step()?;
        Tensor::realize_all(also)
    }
    /// The parameters it updates.
    fn params(&self) -> &[Parameter];
    /// Current learning rate.
    fn lr(&self) -> f64;
    /// Set the learning rate (schedules call this).
    fn set_lr(&mut self, lr: f64);
    /// The state tensors by name (`"{i}.{name}"` for parameter `i`), to checkpoint.
    fn state(&self) -> Vec<(String, Tensor)>;
    /// Restore state saved by [`Optimizer::state`].
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()>;
    /// Step as [`Optimizer::step`] where `skip` (a 0-d tensor; nonzero means
    /// skip) is zero, and leave the parameters and the state as they were
    /// where it is not: [`GradScaler`] skips the steps whose gradients
    /// overflowed this way. [`Sgd`] and [`Adam`] decide on the device, so
    /// nothing waits for `skip`; this default reads it, which waits for the
    /// device to compute it.
    fn step_unless(&mut self, skip: &Tensor) -> Result<()> {
        if skip.ne(0.0)?.item::<bool>()? {
            return Ok(());
        }
        self.step()
    }
    /// Forget every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.params() {
            p.zero_grad();
        }
    }
}

/// Realize a step: the new parameters, the optimizer's `state` and what
/// the caller asked to have realized with them.
fn realize(params: &[Parameter], state: &[&Tensor], also: &[&Tensor]) -> Result<()> {
    let vals: Vec<Tensor> = params.iter().map(|p| p.value()).collect();
    let mut all: Vec<&Tensor> = vals.iter().collect();
    all.extend_from_slice(state);
    all.extend_from_slice(also);
    Tensor::realize_all(&all)
}

/// `old` where `skip` is true, else `new`: a step taken or not, on the device.
fn unless(skip: Option<&Tensor>, old: &Tensor, new: Tensor) -> Result<Tensor> {
    match skip {
        Some(s) => s.where_cond(old, &new),
        None => Ok(new),
    }
}

/// `skip` as a bool on `device` (`None` for a plain step).
fn skip_mask(skip: Option<&Tensor>, device: crate::Device) -> Result<Option<Tensor>> {
    skip.map(|s| s.to_device(device)?.ne(0.0)).transpose()
}

/// Tensors of at most this many elements are joined into one vector by
/// [`sum_each`]: copying a few hundred kilobytes costs less than the
/// dispatch of a reduction of their own.
const JOIN_BELOW: usize = 1 << 18;

/// The sum of `each(t)` over every element of every tensor (`each` is
/// elementwise and gives f32), as a 0-d tensor; `None` for no tensors.
///
/// A model's gradients are many small tensors (biases, norms) and a few
/// large ones (weights): the small ones on the first tensor's device are
/// flattened and joined (a copy kernel per as many as a kernel may bind),
/// so one reduction covers each group, and each large one is reduced on
/// its own. A reduction per tensor would be a dispatch per parameter (about
/// a hundred for a 6-layer encoder).
fn sum_each(tensors: &[Tensor], each: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Option<Tensor>> {
    let Some(device) = tensors.first().map(|t| t.device()) else { return Ok(None) };
    let (small, large): (Vec<&Tensor>, Vec<&Tensor>) = tensors.iter().partition(|t| t.device() == device && t.numel() <= JOIN_BELOW);
    let mut parts = vec![];
    let flat: Vec<Tensor> = small.iter().filter(|t| t.numel() > 0).map(|t| t.flatten_all()).collect::<Result<_>>()?;
    // As many as one kernel reads (`cat` would join more in groups and
    // then join the groups, copying everything twice).
    for group in flat.chunks(Tensor::cat_parts_per_kernel(device)?) {
        let joined = Tensor::cat(&group.iter().collect::<Vec<_>>(), 0)?;
        parts.push(each(&joined)?.sum_all()?);
    }
    for t in large {
        parts.push(each(t)?.sum_all()?);
    }
    let mut total = match parts.pop() {
        Some(p) => p,
        None => Tensor::zeros(&[], DType::F32, device)?,
    };
    for p in parts {
        total = total.add(&p)?;
    }
    Ok(Some(total))
}

fn lookup(state: &[(String, Tensor)], name: &str, like: &Tensor) -> Result<Option<Tensor>> {
    match state.iter().find(|(n, _)| n == name) {
        None => Ok(None),
        Some((_, t)) if t.dims() == like.dims() => Ok(Some(t.to_device(like.device())?.to_dtype(like.dtype())?)),
        Some((_, t)) => bail!(Shape, "load_state", "optimizer state {name} has shape {:?}, the parameter has {:?}", t.dims(), like.dims()),
    }
}

/// Stochastic gradient descent with momentum, dampening, Nesterov momentum
/// and weight decay (PyTorch's formulation).
pub struct Sgd {
    params: Vec<Parameter>,
    lr: f64,
    /// Momentum factor (0 disables).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    bufs: Vec<Option<Tensor>>,
}

impl Sgd {
    /// Plain SGD at learning rate `lr`; set the public fields for more.
    pub fn new(params: Vec<Parameter>, lr: f64) -> Sgd {
        let n = params.len();
        Sgd { params, lr, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0, bufs: vec![None; n] }
    }

    /// With momentum (and optionally Nesterov).
    pub fn with_momentum(mut self, momentum: f64, nesterov: bool) -> Sgd {
        self.momentum = momentum;
        self.nesterov = nesterov;
        self
    }

    /// With L2 weight decay.
    pub fn with_weight_decay(mut self, wd: f64) -> Sgd {
        self.weight_decay = wd;
        self
    }

    /// One step, or (where `skip` is true, on the device) none.
    fn update(&mut self, skip: Option<&Tensor>, also: &[&Tensor]) -> Result<()> {
        let _g = crate::NoGradGuard::new();
        for (p, buf) in self.params.iter().zip(self.bufs.iter_mut()) {
            let Some(mut g) = p.grad() else { continue };
            let w = p.value().detach();
            let skip = skip_mask(skip, w.device())?;
            if self.weight_decay != 0.0 {
                g = g.add(&w.mul(self.weight_decay)?)?;
            }
            if self.momentum != 0.0 {
                let b = match buf.take() {
                    Some(b) => {
                        let next = b.mul(self.momentum)?.add(&g.mul(1.0 - self.dampening)?)?;
                        unless(skip.as_ref(), &b, next)?
                    }
                    // The first buffer is the gradient itself; skipped, zeros
                    // (then the next step's buffer is (1 - dampening) g).
                    None => match &skip {
                        Some(s) => s.where_cond(&g.zeros_like()?, &g)?,
                        None => g.clone(),
                    },
                };
                g = if self.nesterov { g.add(&b.mul(self.momentum)?)? } else { b.clone() };
                *buf = Some(b);
            }
            p.set(unless(skip.as_ref(), &w, w.sub(&g.mul(self.lr)?)?)?)?;
        }
        let state: Vec<&Tensor> = self.bufs.iter().flatten().collect();
        realize(&self.params, &state, also)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        self.update(None, &[])
    }
    fn step_with(&mut self, also: &[&Tensor]) -> Result<()> {
        self.update(None, also)
    }
    fn step_unless(&mut self, skip: &Tensor) -> Result<()> {
        self.update(Some(skip), &[])
    }
    fn params(&self) -> &[Parameter] {
        &self.params
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        self.bufs.iter().enumerate().filter_map(|(i, b)| Some((format!("{i}.momentum_buffer"), b.clone()?))).collect()
    }
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        for (i, p) in self.params.iter().enumerate() {
            self.bufs[i] = lookup(state, &format!("{i}.momentum_buffer"), &p.value())?;
        }
        Ok(())
    }
}

/// Adam, and AdamW when the weight decay is decoupled (PyTorch's formulas,
/// bias-corrected).
pub struct Adam {
    params: Vec<Parameter>,
    lr: f64,
    /// Decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: L2 in the gradient (Adam) or decoupled (AdamW).
    pub weight_decay: f64,
    /// AdamW: apply weight decay to the weights directly.
    pub decoupled: bool,
    t: u64,
    /// The step count on the device, once a step was taken or skipped there
    /// ([`Optimizer::step_unless`]): the bias corrections then come from it.
    t_dev: Option<Tensor>,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    /// The parameters and moments as one vector each, once a step ran on
    /// them that way (see [`Flat`]); `m` and `v` are then `None`.
    flat: Option<Flat>,
}

/// Every parameter of an [`Adam`] in one vector, and the moments likewise:
/// the update is a dozen ops over the vector instead of a dozen per
/// parameter (a 6-layer encoder has about a hundred parameters, so its
/// step recorded some 2,000 graph nodes for the update alone), and each
/// parameter is set to its view of the new vector. Each starts on a
/// multiple of [`FLAT_ALIGN`] elements, so the views keep the alignment
/// vector loads want; the gaps hold zeros, which the update keeps zero.
struct Flat {
    /// Each parameter's first element in the vectors.
    offsets: Vec<usize>,
    /// The parameters as this set them: while each still holds its view,
    /// `weights` is their vector and the next step need not join them.
    views: Vec<Tensor>,
    weights: Tensor,
    m: Tensor,
    v: Tensor,
}

/// Alignment in elements of each parameter in a [`Flat`] vector (256
/// bytes of f32, a storage binding's offset alignment on most adapters).
const FLAT_ALIGN: usize = 64;

impl Flat {
    /// Parameter `i`'s part of the flat vector `t`, shaped like `like`.
    fn part(&self, t: &Tensor, i: usize, like: &Tensor) -> Result<Tensor> {
        t.narrow(0, self.offsets[i], like.numel())?.reshape_dims(like.dims())
    }
}

impl Adam {
    /// Adam with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, no weight decay).
    pub fn new(params: Vec<Parameter>, lr: f64) -> Adam {
        let n = params.len();
        Adam { params, lr, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, decoupled: false, t: 0, t_dev: None, m: vec![None; n], v: vec![None; n], flat: None }
    }

    /// AdamW with PyTorch's defaults (weight decay 0.01).
    pub fn adamw(params: Vec<Parameter>, lr: f64) -> Adam {
        Adam { weight_decay: 0.01, decoupled: true, ..Adam::new(params, lr) }
    }
}

/// A realized tensor of zeros shaped like `t` (uploaded: no kernel runs).
fn zeros_like(t: &Tensor) -> Result<Tensor> {
    Tensor::from_storage(crate::storage::CpuStorage::zeros(t.dtype(), t.numel()), t.dims(), t.device())
}

/// Adam's `lr / (1 - beta1^t)` and `1 - beta2^t`.
// One short-lived value per step: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Corrections {
    /// Numbers, from the host's step count (weights of 16-bit types).
    Host(f64, f64),
    /// 0-d f32 tensors: from the device's step count, or the host's
    /// numbers uploaded.
    Device(Tensor, Tensor),
}

impl Adam {
    /// One step, or (where `skip` is true, on the device) none. Once a step
    /// has been decided on the device, the step count lives there and the
    /// bias corrections `1 - beta^t` are computed there (as `-expm1(t ln
    /// beta)`, in f32); until then they come from the host's count.
    fn update(&mut self, skip: Option<&Tensor>, also: &[&Tensor]) -> Result<()> {
        let _g = crate::NoGradGuard::new();
        let Some(device) = self.params.first().map(|p| p.value().device()) else { return Ok(()) };
        let skip = skip_mask(skip, device)?;
        self.t += 1;
        let (b1, b2) = self.betas;
        // (lr / bc1, bc2): host numbers, or 0-d tensors from the device's count.
        let corr = if skip.is_some() || self.t_dev.is_some() {
            let t = match self.t_dev.take() {
                Some(t) => t,
                None => Tensor::from_vec(vec![(self.t - 1) as f32], &[], device)?,
            };
            let t = match &skip {
                Some(s) => t.add(&s.logical_not()?.to_dtype(DType::F32)?)?,
                None => t.add(1.0)?,
            };
            let correction = |beta: f64| t.mul(beta.ln())?.expm1()?.neg();
            let c = Corrections::Device(correction(b1)?.recip()?.mul(self.lr)?, correction(b2)?);
            self.t_dev = Some(t);
            c
        } else {
            let (lr_bc1, bc2) = (self.lr / (1.0 - b1.powi(self.t as i32)), 1.0 - b2.powi(self.t as i32));
            if self.params.iter().all(|p| p.value().dtype() == DType::F32) {
                // f32 weights compute in f32, so the numbers are the same
                // uploaded as f32. As constants they changed every step, and
                // a realization that holds the whole training step (forward,
                // backward and this update) copied its cached plan to write
                // them in.
                // One upload, two 0-d views of it.
                let both = Tensor::from_vec(vec![lr_bc1 as f32, bc2 as f32], &[2], device)?;
                Corrections::Device(both.narrow(0, 0, 1)?.squeeze(0)?, both.narrow(0, 1, 1)?.squeeze(0)?)
            } else {
                Corrections::Host(lr_bc1, bc2)
            }
        };
        if self.flat_update(&corr, skip.as_ref())? {
            let f = self.flat.as_ref().expect("just set");
            let mut state = vec![&f.m, &f.v];
            state.extend(&self.t_dev);
            return realize(&self.params, &state, also);
        }
        for i in 0..self.params.len() {
            let p = &self.params[i];
            let Some(g) = p.grad() else { continue };
            let w0 = p.value().detach();
            // The first step starts from uploaded zeros rather than a graph
            // without the moments: then every step has the same structure,
            // is scheduled once and compiles no kernels of its own (0 * b + x
            // is x exactly).
            let m0 = match self.m[i].take() {
                Some(m) => m,
                None => zeros_like(&w0)?,
            };
            let v0 = match self.v[i].take() {
                Some(v) => v,
                None => zeros_like(&w0)?,
            };
            let (w, m, v) = self.moved(&w0, g, &m0, &v0, &corr)?;
            p.set(unless(skip.as_ref(), &w0, w)?)?;
            self.m[i] = Some(unless(skip.as_ref(), &m0, m)?);
            self.v[i] = Some(unless(skip.as_ref(), &v0, v)?);
        }
        let mut state: Vec<&Tensor> = self.m.iter().chain(&self.v).flatten().collect();
        state.extend(&self.t_dev);
        realize(&self.params, &state, also)
    }
}

impl Adam {
    /// Weights, first and second moments after one step from `w`, `m`, `v`
    /// with gradient `g` (PyTorch's formulas).
    fn moved(&self, w0: &Tensor, mut g: Tensor, m0: &Tensor, v0: &Tensor, corr: &Corrections) -> Result<(Tensor, Tensor, Tensor)> {
        let (b1, b2) = self.betas;
        let mut w = w0.clone();
        if self.weight_decay != 0.0 {
            if self.decoupled {
                w = w.mul(1.0 - self.lr * self.weight_decay)?;
            } else {
                g = g.add(&w.mul(self.weight_decay)?)?;
            }
        }
        let m = m0.mul(b1)?.add(&g.mul(1.0 - b1)?)?;
        let v = v0.mul(b2)?.add(&g.sqr()?.mul(1.0 - b2)?)?;
        let denom = match corr {
            Corrections::Host(_, bc2) => v.div(*bc2)?,
            Corrections::Device(_, bc2) => v.div(&bc2.to_dtype(v.dtype())?)?,
        };
        let denom = denom.sqrt()?.add(self.eps)?;
        let w = w.sub(&match corr {
            Corrections::Host(lr_bc1, _) => m.div(&denom)?.mul(*lr_bc1)?,
            Corrections::Device(lr_bc1, _) => m.div(&denom)?.mul(&lr_bc1.to_dtype(m.dtype())?)?,
        })?;
        Ok((w, m, v))
    }

    /// Each parameter's moments (`None` before its first step), as views
    /// of the flat vectors where those hold them.
    fn moments(&self) -> (Vec<Option<Tensor>>, Vec<Option<Tensor>>) {
        let Some(f) = &self.flat else { return (self.m.clone(), self.v.clone()) };
        let part = |t: &Tensor, i: usize| f.part(t, i, &self.params[i].value()).ok();
        ((0..self.params.len()).map(|i| part(&f.m, i)).collect(), (0..self.params.len()).map(|i| part(&f.v, i)).collect())
    }

    /// The step over one vector of all parameters (see [`Flat`]) where
    /// every parameter has a gradient and all share a device and a dtype;
    /// `false` (nothing done) otherwise.
    fn flat_update(&mut self, corr: &Corrections, skip: Option<&Tensor>) -> Result<bool> {
        let Some(grads) = self.params.iter().map(|p| p.grad()).collect::<Option<Vec<Tensor>>>() else { return Ok(false) };
        let values: Vec<Tensor> = self.params.iter().map(|p| p.value().detach()).collect();
        let Some(first) = values.first() else { return Ok(false) };
        let (dt, device) = (first.dtype(), first.device());
        if values.len() < 2 || values.iter().any(|v| v.device() != device || v.dtype() != dt) || grads.iter().any(|g| g.device() != device) {
            return Ok(false);
        }
        let padded = |n: usize| n.div_ceil(FLAT_ALIGN) * FLAT_ALIGN;
        let mut offsets = Vec::with_capacity(values.len());
        let mut len = 0;
        for v in &values {
            offsets.push(len);
            len += padded(v.numel());
        }
        let pad = Tensor::zeros(&[FLAT_ALIGN], dt, device)?;
        let join = |parts: &[Tensor]| -> Result<Tensor> {
            let mut row = Vec::with_capacity(2 * parts.len());
            for t in parts {
                row.push(t.to_dtype(dt)?.flatten_all()?);
                if padded(t.numel()) > t.numel() {
                    row.push(pad.narrow(0, 0, padded(t.numel()) - t.numel())?);
                }
            }
            Tensor::cat(&row.iter().collect::<Vec<_>>(), 0)
        };
        let kept = self.flat.as_ref().is_some_and(|f| {
            f.offsets == offsets && f.views.iter().zip(&values).all(|(a, b)| a.same_storage(b) && a.value.layout == b.value.layout)
        });
        let (w0, m0, v0) = match self.flat.take_if(|_| kept) {
            Some(f) => (f.weights, f.m, f.v),
            None => {
                // Moments so far: per parameter, from a flat vector whose
                // parameters were replaced since, or zeros before any step.
                let (m, v) = self.moments();
                let or_zeros = |t: &Option<Tensor>, like: &Tensor| t.clone().map_or_else(|| zeros_like(like), Ok);
                let ms = m.iter().zip(&values).map(|(t, w)| or_zeros(t, w)).collect::<Result<Vec<_>>>()?;
                let vs = v.iter().zip(&values).map(|(t, w)| or_zeros(t, w)).collect::<Result<Vec<_>>>()?;
                (join(&values)?, join(&ms)?, join(&vs)?)
            }
        };
        let (w, m, v) = self.moved(&w0, join(&grads)?, &m0, &v0, corr)?;
        let (w, m, v) = (unless(skip, &w0, w)?, unless(skip, &m0, m)?, unless(skip, &v0, v)?);
        let mut flat = Flat { offsets, views: vec![], weights: w, m, v };
        for (i, p) in self.params.iter().enumerate() {
            p.set(flat.part(&flat.weights, i, &values[i])?)?;
        }
        flat.views = self.params.iter().map(|p| p.value()).collect();
        self.m.iter_mut().chain(self.v.iter_mut()).for_each(|t| *t = None);
        self.flat = Some(flat);
        Ok(true)
    }
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        self.update(None, &[])
    }
    fn step_with(&mut self, also: &[&Tensor]) -> Result<()> {
        self.update(None, also)
    }
    fn step_unless(&mut self, skip: &Tensor) -> Result<()> {
        self.update(Some(skip), &[])
    }
    fn params(&self) -> &[Parameter] {
        &self.params
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        let mut s = vec![];
        let (m, v) = self.moments();
        for i in 0..self.params.len() {
            if let (Some(m), Some(v)) = (&m[i], &v[i]) {
                s.push((format!("{i}.exp_avg"), m.clone()));
                s.push((format!("{i}.exp_avg_sq"), v.clone()));
            }
        }
        match &self.t_dev {
            Some(t) => s.push(("step".into(), t.clone())),
            None => {
                if let Some(p) = self.params.first() {
                    if let Ok(t) = Tensor::full(&[], self.t as f64, crate::DType::F32, p.value().device()) {
                        s.push(("step".into(), t));
                    }
                }
            }
        }
        s
    }
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        self.flat = None;
        for (i, p) in self.params.iter().enumerate() {
            self.m[i] = lookup(state, &format!("{i}.exp_avg"), &p.value())?;
            self.v[i] = lookup(state, &format!("{i}.exp_avg_sq"), &p.value())?;
        }
        if let Some((_, t)) = state.iter().find(|(n, _)| n == "step") {
            // Read on the host: a GPU holds no f64.
            self.t = t.to_device(crate::Device::Cpu)?.to_dtype(crate::DType::F64)?.item::<f64>()? as u64;
            self.t_dev = None;
        }
        Ok(())
    }
}

/// Scale the gradients so that their global L2 norm is at most `max_norm`
/// (PyTorch `clip_grad_norm_`); returns the norm before clipping, as a lazy
/// 0-d tensor (the scaling happens on the device, without reading it).
pub fn clip_grad_norm(params: &[Parameter], max_norm: f64) -> Result<Option<Tensor>> {
    let _g = crate::NoGradGuard::new();
    let grads: Vec<(usize, Tensor)> = params.iter().enumerate().filter_map(|(i, p)| Some((i, p.grad()?))).collect();
    let tensors: Vec<Tensor> = grads.iter().map(|(_, g)| g.clone()).collect();
    let Some(total) = sum_each(&tensors, |g| g.to_dtype(crate::DType::F32)?.sqr())? else { return Ok(None) };
    let norm = total.sqrt()?;
    let scale = norm.add(1e-6)?.recip()?.mul(max_norm)?.clamp(None, Some(1.0))?;
    for (i, g) in grads {
        params[i].value().set_grad(Some(g.mul(&scale.to_dtype(g.dtype())?)?))?;
    }
    Ok(Some(norm))
}

/// A learning rate as a function of the step (or epoch) count.
pub trait LrSchedule {
    /// The learning rate at `step`, given the base rate.
    fn lr(&self, base: f64, step: usize) -> f64;
}

/// Multiply by `gamma` every `step_size` steps (PyTorch `StepLR`).
pub struct StepLr {
    /// Steps between decays.
    pub step_size: usize,
    /// Decay factor.
    pub gamma: f64,
}

impl LrSchedule for StepLr {
    fn lr(&self, base: f64, step: usize) -> f64 {
        base * self.gamma.powi((step / self.step_size.max(1)) as i32)
    }
}

/// Cosine annealing from the base rate to `min_lr` over `t_max` steps
/// (PyTorch `CosineAnnealingLR`, without restarts).
pub struct CosineLr {
    /// Steps of one half cosine.
    pub t_max: usize,
    /// Final learning rate.
    pub min_lr: f64,
}

impl LrSchedule for CosineLr {
    fn lr(&self, base: f64, step: usize) -> f64 {
        let t = (step.min(self.t_max)) as f64 / self.t_max.max(1) as f64;
        self.min_lr + (base - self.min_lr) * (1.0 + (std::f64::consts::PI * t).cos()) / 2.0
    }
}

/// Linear warm-up over `warmup` steps, then `after` (counted from the end of warm-up).
pub struct WarmupLr<S: LrSchedule> {
    /// Warm-up steps.
    pub warmup: usize,
    /// The schedule after warm-up.
    pub after: S,
}

impl<S: LrSchedule> LrSchedule for WarmupLr<S> {
    fn lr(&self, base: f64, step: usize) -> f64 {
        if step < self.warmup {
            base * (step + 1) as f64 / self.warmup as f64
        } else {
            self.after.lr(base, step - self.warmup)
        }
    }
}

/// The same rate at every step.
pub struct ConstantLr;

impl LrSchedule for ConstantLr {
    fn lr(&self, base: f64, _step: usize) -> f64 {
        base
    }
}

/// Dynamic loss scaling for f16 training, as `torch.amp.GradScaler`: the
/// loss is multiplied by a large factor before `backward` so that small
/// gradients survive f16's range; `step` divides the gradients by it again,
/// and skips the optimizer step when any gradient is inf or NaN (the scale
/// was too large), halving the scale; after `growth_interval` clean steps
/// in a row the scale doubles.
///
/// The scale, the check and the decision live on the device: nothing in a
/// step waits for it (PyTorch's scaler reads one value per step), so the host
/// records the next step while the device computes this one. Reading the
/// scale ([`GradScaler::get_scale`], [`GradScaler::state`]) or the count of
/// skipped steps waits for the device. bf16 has f32's range and needs no
/// scaler.
///
/// ```
/// use voltaic::nn::{Forward, Linear, Module};
/// use voltaic::optim::{Adam, GradScaler, Optimizer};
/// use voltaic::{autocast, DType, Device, Tensor};
/// let layer = Linear::new(3, 1, true, Device::Cpu)?;
/// let mut opt = Adam::new(layer.parameters(), 0.1);
/// let mut scaler = GradScaler::new();
/// let x = Tensor::randn(&[8, 3], DType::F32, Device::Cpu)?;
/// let loss = autocast(DType::F16, || layer.forward(&x)?.sqr()?.mean(&[], false))?;
/// opt.zero_grad();
/// scaler.scale(&loss)?.backward()?;
/// scaler.step(&mut opt)?;
/// scaler.update()?;
/// assert_eq!(scaler.skipped_steps()?, 0);
/// # Ok::<(), voltaic::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct GradScaler {
    /// The scale and clean-step count to start from (until the first `scale`).
    scale: f64,
    clean: usize,
    /// Factor the scale grows by after `growth_interval` steps without inf/NaN.
    pub growth_factor: f64,
    /// Factor the scale shrinks by after a step with inf/NaN gradients.
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows.
    pub growth_interval: usize,
    /// The scale, the clean steps in a row and the skipped steps, as 0-d
    /// f32 tensors on the device of the losses (from the first `scale`).
    on_device: Option<[Tensor; 3]>,
    /// The optimizers unscaled since the last `update` (by address, as
    /// PyTorch keys them by `id`) and whether each found inf or NaN (0-d
    /// bool, on the device): with several optimizers, each is unscaled once,
    /// and any one finding inf backs the scale off.
    unscaled: Vec<(usize, Tensor)>,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

impl GradScaler {
    /// PyTorch's defaults: scale 65536, growth 2 every 2000 clean steps, backoff 0.5.
    pub fn new() -> GradScaler {
        GradScaler::with_scale(65536.0)
    }

    /// Start from `scale` (positive and finite; else 65536).
    pub fn with_scale(scale: f64) -> GradScaler {
        let scale = if scale.is_finite() && scale > 0.0 { scale } else { 65536.0 };
        GradScaler { scale, clean: 0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, on_device: None, unscaled: Vec::new() }
    }

    /// The device state, made on `device` from the host's numbers if there is none.
    fn device_state(&mut self, device: crate::Device) -> Result<&[Tensor; 3]> {
        if self.on_device.is_none() {
            let scalar = |v: f64| Tensor::from_vec(vec![v as f32], &[], device);
            self.on_device = Some([scalar(self.scale)?, scalar(self.clean as f64)?, scalar(0.0)?]);
        }
        Ok(self.on_device.as_ref().expect("just made"))
    }

    /// The current scale (waits for the device).
    pub fn get_scale(&self) -> Result<f64> {
        Ok(self.state()?.0)
    }

    /// (scale, clean steps in a row), to checkpoint (waits for the device).
    pub fn state(&self) -> Result<(f64, usize)> {
        match &self.on_device {
            Some([scale, clean, _]) => Ok((scale.item::<f32>()? as f64, clean.item::<f32>()? as usize)),
            None => Ok((self.scale, self.clean)),
        }
    }

    /// How many steps were skipped for inf or NaN gradients since this
    /// scaler was made (waits for the device).
    pub fn skipped_steps(&self) -> Result<u64> {
        match &self.on_device {
            Some([_, _, skipped]) => Ok(skipped.item::<f32>()? as u64),
            None => Ok(0),
        }
    }

    /// Restore what [`GradScaler::state`] returned (a scale that is not
    /// positive and finite is ignored). The count of skipped steps restarts.
    pub fn load_state(&mut self, scale: f64, clean: usize) {
        if scale.is_finite() && scale > 0.0 {
            self.scale = scale;
            self.clean = clean;
            self.on_device = None;
        }
    }

    /// `loss * scale` in f32 (65536 times an f16 loss would overflow f16),
    /// to call `backward` on.
    pub fn scale(&mut self, loss: &Tensor) -> Result<Tensor> {
        let scale = self.device_state(loss.device())?[0].clone();
        loss.to_dtype(DType::F32)?.mul(&scale)
    }

    /// Divide the gradients of `opt`'s parameters by the scale (once per
    /// step and optimizer; `step` does it if it was not done) and check them
    /// for inf and NaN, on the device. Call it before clipping gradients,
    /// as in PyTorch.
    pub fn unscale(&mut self, opt: &dyn Optimizer) -> Result<()> {
        let id = opt as *const dyn Optimizer as *const () as usize;
        if self.unscaled.iter().any(|(o, _)| *o == id) {
            return Ok(());
        }
        let _g = crate::NoGradGuard::new();
        let grads: Vec<(Tensor, Tensor)> = opt.params().iter().filter_map(|p| Some((p.value(), p.grad()?))).collect();
        let Some(device) = grads.first().map(|(_, g)| g.device()) else {
            self.unscaled.push((id, Tensor::from_vec(vec![false], &[], crate::Device::Cpu)?));
            return Ok(());
        };
        let inv = self.device_state(device)?[0].recip()?;
        let unscaled = |g: &Tensor| g.mul(&inv.to_dtype(g.dtype())?);
        // How many gradient elements are inf or NaN, tested on the bits
        // (`nonfinite`): `g * 0` or `g != g` may be folded away by a GPU
        // compiler that assumes finite values.
        let raw: Vec<Tensor> = grads.iter().map(|(_, g)| g.clone()).collect();
        let count = sum_each(&raw, |g| unscaled(g)?.nonfinite()?.to_dtype(DType::F32))?;
        let found = count.expect("at least one gradient").gt(0.0)?;
        // One realization computes the gradients and the check, so the
        // optimizer's step reads them instead of computing the backward pass
        // again; nothing waits for it. The gradients are kept as the
        // backward pass made them; the division by the scale is recorded
        // lazily, so it joins the optimizer's update kernels (which also
        // store the unscaled gradient the parameter holds) instead of
        // taking a kernel per gradient here.
        let mut all = vec![&found];
        all.extend(&raw);
        Tensor::realize_all(&all)?;
        for (w, g) in grads {
            w.set_grad(Some(unscaled(&g)?))?;
        }
        self.unscaled.push((id, found));
        Ok(())
    }

    /// Unscale (unless done) and step `opt` unless a gradient is inf or NaN,
    /// decided on the device ([`Optimizer::step_unless`]). Call
    /// [`GradScaler::update`] after.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        self.unscale(opt)?;
        let id = opt as *const dyn Optimizer as *const () as usize;
        let found = self.unscaled.iter().find(|(o, _)| *o == id).map(|(_, f)| f.clone()).expect("unscaled above");
        opt.step_unless(&found)
    }

    /// Adjust the scale after a step, on the device: shrink it if any
    /// optimizer unscaled since the last update found inf/NaN, grow it after
    /// `growth_interval` clean steps in a row.
    pub fn update(&mut self) -> Result<()> {
        let founds = std::mem::take(&mut self.unscaled);
        let Some([scale, clean, skipped]) = self.on_device.clone() else { return Ok(()) };
        if founds.is_empty() {
            return Ok(());
        }
        let device = scale.device();
        let mut found = founds[0].1.to_device(device)?;
        for (_, f) in &founds[1..] {
            found = found.logical_or(&f.to_device(device)?)?;
        }
        let clean1 = clean.add(1.0)?;
        let grow = clean1.ge(self.growth_interval as f64)?;
        let grown = grow.where_cond(&scale.mul(self.growth_factor)?, &scale)?;
        let scale = found.where_cond(&scale.mul(self.backoff_factor)?, &grown)?;
        let clean = found.logical_or(&grow)?.where_cond(0.0, &clean1)?;
        let skipped = skipped.add(&found.to_dtype(DType::F32)?)?;
        // Realized now (without waiting), so that the next step's graph
        // starts from values, not from this step's.
        Tensor::realize_all(&[&scale, &clean, &skipped])?;
        self.on_device = Some([scale, clean, skipped]);
        Ok(())
    }
}
