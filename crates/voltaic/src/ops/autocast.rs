//! Automatic mixed precision, as `torch.autocast`: inside a scope, the ops
//! that gain from a 16-bit type run in it, and the ops that lose accuracy
//! in it run in f32, whatever the types of their inputs.
//!
//! - **Low precision** (f16 or bf16): `matmul` (and through it `Linear`,
//!   attention's products and everything built on them) and `conv2d`. Their
//!   float inputs are cast to the scope's type; products accumulate in f32
//!   and are rounded once when stored. On adapters with tensor cores
//!   (cooperative matrices, f16 only through Vulkan today) f16 products run
//!   on them.
//! - **f32**: `softmax`, `log_softmax`, `layer_norm`, `mean`, `var`, and the
//!   losses built on them (`cross_entropy`, `mse_loss`): 16-bit inputs are
//!   cast up first.
//! - **Everything else** runs in the type its inputs promote to, as in
//!   PyTorch (an f16 activation plus an f32 residual is f32).
//!
//! The parameters stay f32 (the "master weights"): an optimizer updates
//! them in f32, and the cast to the low type is part of each step's graph,
//! so its gradient flows back to the f32 weight. `backward` runs with
//! autocast off: the gradient of each op is computed in the types its
//! forward pass used (the input gradient of an f16 matmul is an f16
//! product; a weight gradient whose cast back to the f32 master weight is
//! fused into it runs as an f32-output product, off the tensor cores).
//! With f16, scale the loss with
//! `optim::GradScaler` (a layer above this one) so that small gradients do not
//! flush to zero.
//!
//! ```
//! use voltaic::{autocast, DType, Device, Tensor};
//! let x = Tensor::randn(&[4, 8], DType::F32, Device::Cpu)?;
//! let w = Tensor::randn(&[8, 3], DType::F32, Device::Cpu)?;
//! let (y, p) = autocast(DType::BF16, || -> voltaic::Result<_> {
//!     let y = x.matmul(&w)?;
//!     let p = y.softmax(-1)?;
//!     Ok((y, p))
//! })?;
//! assert_eq!(y.dtype(), DType::BF16);
//! assert_eq!(p.dtype(), DType::F32);
//! # Ok::<(), voltaic::Error>(())
//! ```

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::tensor::Tensor;
use std::cell::Cell;

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Run `f` with autocast to `dtype` (F16 or BF16) on this thread; the
/// previous setting is restored afterwards, also when `f` panics. Any other
/// dtype runs `f` with autocast off.
pub fn autocast<T>(dtype: DType, f: impl FnOnce() -> T) -> T {
    let _g = AutocastGuard::new(Some(dtype));
    f()
}

/// The autocast type in force on this thread, if any.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|a| a.get())
}

/// Sets the autocast type of this thread (`None`: off) until dropped.
pub struct AutocastGuard {
    was: Option<DType>,
}

impl AutocastGuard {
    /// Autocast to `dtype` (F16 or BF16; anything else, or `None`, turns it off).
    pub fn new(dtype: Option<DType>) -> AutocastGuard {
        let d = dtype.filter(|d| matches!(d, DType::F16 | DType::BF16));
        AutocastGuard { was: AUTOCAST.with(|a| a.replace(d)) }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.was));
    }
}

/// Check that `dtype` can be an autocast type (for parsers of user input).
pub fn check_autocast_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::F16 | DType::BF16 => Ok(()),
        d => bail!(DType, "autocast", "autocast runs in f16 or bf16, got {d}"),
    }
}

/// `t` in the autocast type when autocast is on and `t` is a float of
/// another type (the inputs of low-precision ops); else `t` itself.
pub(crate) fn low(t: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(d) if t.dtype().is_float() && t.dtype() != d && t.dtype() != DType::F64 => t.to_dtype(d),
        _ => Ok(t.clone()),
    }
}

/// The float type an f32-policy op computes in for an input of `dt`: f32
/// for 16-bit floats under autocast, else [`DType::to_float`].
pub(crate) fn full(dt: DType) -> DType {
    match (autocast_dtype(), dt) {
        (Some(_), DType::F16 | DType::BF16) => DType::F32,
        _ => dt.to_float(),
    }
}
