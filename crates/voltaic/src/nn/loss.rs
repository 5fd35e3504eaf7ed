//! Losses beyond the tensor methods `cross_entropy` and `mse_loss`.

use crate::error::{bail, Result};
use crate::ops::nn::Reduction;
use crate::tensor::Tensor;

/// Negative log likelihood of log-probabilities `[N, C, ...]` at class
/// indices `[N, ...]` (PyTorch `nll_loss`).
pub fn nll_loss(log_probs: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    log_probs.check_class_target("nll_loss", "log-probabilities", target)?;
    log_probs.pick_class(crate::primitive::Caller::NllLoss, target)?.neg()?.reduce_loss(reduction)
}

/// Binary cross entropy of logits against targets in `[0, 1]`, computed
/// stably as `max(x, 0) - x * y + log(1 + exp(-|x|))` (PyTorch
/// `binary_cross_entropy_with_logits`).
pub fn binary_cross_entropy_with_logits(logits: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    if logits.dims() != target.dims() {
        bail!(Shape, "binary_cross_entropy_with_logits", "logits {:?} and target {:?} must have the same shape", logits.dims(), target.dims());
    }
    let x = logits.to_dtype(logits.dtype().to_float())?;
    let loss = x.relu()?.sub(&x.mul(&target.to_dtype(x.dtype())?)?)?.add(&x.abs()?.neg()?.exp()?.log1p()?)?;
    loss.reduce_loss(reduction)
}
