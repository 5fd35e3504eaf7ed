//! Losses beyond the tensor methods `cross_entropy` and `mse_loss`.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::ops::nn::Reduction;
use crate::tensor::Tensor;

fn reduce(loss: Tensor, reduction: Reduction) -> Result<Tensor> {
    match reduction {
        Reduction::Mean => loss.mean(&[], false),
        Reduction::Sum => loss.sum(&[], false),
        Reduction::None => Ok(loss),
    }
}

/// Negative log likelihood of log-probabilities `[N, C, ...]` at class
/// indices `[N, ...]` (PyTorch `nll_loss`).
pub fn nll_loss(log_probs: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    if log_probs.rank() < 2 {
        bail!(Shape, "nll_loss", "expected log-probabilities [N, C, ...], got {:?}", log_probs.dims());
    }
    if !matches!(target.dtype(), DType::I32 | DType::U32) {
        bail!(DType, "nll_loss", "expected i32 or u32 class indices, got {}", target.dtype());
    }
    let mut want = log_probs.dims().to_vec();
    want.remove(1);
    if target.dims() != want.as_slice() {
        bail!(Shape, "nll_loss", "input {:?} needs a target of shape {want:?}, got {:?}", log_probs.dims(), target.dims());
    }
    reduce(log_probs.gather(1, &target.unsqueeze(1)?)?.squeeze(1)?.neg()?, reduction)
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
    reduce(loss, reduction)
}
