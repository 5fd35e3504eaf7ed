//! Initialisers, as `torch.nn.init` (fan-in mode, leaky-ReLU gain).

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::tensor::Tensor;
use crate::Device;

/// `(fan_in, fan_out)` of a weight shape `[out, in, *kernel]`.
pub fn fans(shape: &[usize]) -> Result<(usize, usize)> {
    if shape.len() < 2 {
        bail!(Shape, "init", "fan in and fan out need a weight with at least 2 dims, got {shape:?}");
    }
    let rf: usize = shape[2..].iter().product();
    Ok((shape[1] * rf, shape[0] * rf))
}

/// Values uniform in `[lo, hi)`, f32.
pub fn uniform(shape: &[usize], lo: f64, hi: f64, device: Device) -> Result<Tensor> {
    Tensor::rand(shape, DType::F32, device)?.mul(hi - lo)?.add(lo)?.contiguous()
}

/// Values normal with mean `mean` and standard deviation `std`, f32.
pub fn normal(shape: &[usize], mean: f64, std: f64, device: Device) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32, device)?.mul(std)?.add(mean)?.contiguous()
}

fn leaky_gain(a: f64) -> f64 {
    (2.0 / (1.0 + a * a)).sqrt()
}

/// He uniform for a leaky ReLU of slope `a` (`a = sqrt(5)` is what PyTorch's
/// Linear and Conv2d use, giving bounds `±1/sqrt(fan_in)`).
pub fn kaiming_uniform(shape: &[usize], a: f64, device: Device) -> Result<Tensor> {
    let (fan_in, _) = fans(shape)?;
    let bound = leaky_gain(a) * (3.0 / fan_in.max(1) as f64).sqrt();
    uniform(shape, -bound, bound, device)
}

/// He normal for a leaky ReLU of slope `a` (0 for ReLU).
pub fn kaiming_normal(shape: &[usize], a: f64, device: Device) -> Result<Tensor> {
    let (fan_in, _) = fans(shape)?;
    normal(shape, 0.0, leaky_gain(a) / (fan_in.max(1) as f64).sqrt(), device)
}

/// Glorot uniform with `gain`.
pub fn xavier_uniform(shape: &[usize], gain: f64, device: Device) -> Result<Tensor> {
    let (fi, fo) = fans(shape)?;
    let bound = gain * (6.0 / (fi + fo).max(1) as f64).sqrt();
    uniform(shape, -bound, bound, device)
}

/// Glorot normal with `gain`.
pub fn xavier_normal(shape: &[usize], gain: f64, device: Device) -> Result<Tensor> {
    let (fi, fo) = fans(shape)?;
    normal(shape, 0.0, gain * (2.0 / (fi + fo).max(1) as f64).sqrt(), device)
}
