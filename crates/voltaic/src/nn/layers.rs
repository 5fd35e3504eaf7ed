//! Layers with PyTorch's parameter names, shapes and default initialisation.

use super::{init, Forward, Module, Parameter, Training};
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::ops::nn::Conv2dOpts;
use crate::tensor::Tensor;
use crate::Device;

/// `y = x @ weight^T + bias`, weight `[out, in]` (PyTorch `nn.Linear`).
#[derive(Module)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Parameter,
    /// `[out_features]`.
    pub bias: Option<Parameter>,
}

impl Linear {
    /// PyTorch's default initialisation: weight and bias uniform in `±1/sqrt(in)`.
    pub fn new(in_features: usize, out_features: usize, bias: bool, device: Device) -> Result<Linear> {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        Ok(Linear {
            weight: Parameter::new(init::kaiming_uniform(&[out_features, in_features], 5f64.sqrt(), device)?)?,
            bias: if bias { Some(Parameter::new(init::uniform(&[out_features], -bound, bound, device)?)?) } else { None },
        })
    }
}

impl Forward for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.weight.value(), self.bias.as_ref().map(|b| b.value()).as_ref())
    }
}

/// `x @ weight^T + bias` for tensors rather than a module's parameters
/// (PyTorch `F.linear`): what [`Linear`] runs, and what a model that
/// stacks several layers' weights into one product runs on the stack.
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if x.rank() == 0 || x.dims()[x.rank() - 1] != weight.dims()[1] {
        bail!(Shape, "Linear", "expected input [..., {}], got {:?}", weight.dims()[1], x.dims());
    }
    // Under autocast the weight is cast before it is transposed, so its
    // gradient comes back in its own (row-major) order; see `matmul`.
    let y = x.matmul(&crate::ops::autocast::low(weight)?.t()?)?;
    match bias {
        // Under autocast the bias joins the product in its low type (as torch's addmm).
        Some(b) => y.add(crate::ops::autocast::low(b)?),
        None => Ok(y),
    }
}

/// 2-D convolution over `[N, C, H, W]` (PyTorch `nn.Conv2d`).
#[derive(Module)]
pub struct Conv2d {
    /// `[out, in / groups, kh, kw]`.
    pub weight: Parameter,
    /// `[out]`.
    pub bias: Option<Parameter>,
    /// Stride, padding, dilation and groups.
    pub opts: Conv2dOpts,
}

impl Conv2d {
    /// PyTorch's default initialisation (uniform in `±1/sqrt(fan_in)`).
    pub fn new(in_channels: usize, out_channels: usize, kernel: [usize; 2], opts: Conv2dOpts, bias: bool, device: Device) -> Result<Conv2d> {
        if opts.groups == 0 || !in_channels.is_multiple_of(opts.groups) || !out_channels.is_multiple_of(opts.groups) {
            bail!(Value, "Conv2d", "channels {in_channels} -> {out_channels} must be divisible by groups {}", opts.groups);
        }
        let fan_in = in_channels / opts.groups * kernel[0] * kernel[1];
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        Ok(Conv2d {
            weight: Parameter::new(init::kaiming_uniform(&[out_channels, in_channels / opts.groups, kernel[0], kernel[1]], 5f64.sqrt(), device)?)?,
            bias: if bias { Some(Parameter::new(init::uniform(&[out_channels], -bound, bound, device)?)?) } else { None },
            opts,
        })
    }
}

impl Forward for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let b = self.bias.as_ref().map(|b| b.value());
        x.conv2d(&self.weight.value(), b.as_ref(), self.opts)
    }
}

/// Max pooling (PyTorch `nn.MaxPool2d`).
#[derive(Clone, Copy, Debug, Module)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel: [usize; 2],
    /// Step (defaults to the window).
    pub stride: Option<[usize; 2]>,
    /// Padding with -inf.
    pub padding: [usize; 2],
}

impl MaxPool2d {
    /// Non-overlapping windows of `k` x `k`.
    pub fn new(k: usize) -> MaxPool2d {
        MaxPool2d { kernel: [k, k], stride: None, padding: [0, 0] }
    }
}

impl Forward for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d(self.kernel, self.stride, self.padding)
    }
}

/// Average pooling (PyTorch `nn.AvgPool2d`).
#[derive(Clone, Copy, Debug, Module)]
pub struct AvgPool2d {
    /// Window size.
    pub kernel: [usize; 2],
    /// Step (defaults to the window).
    pub stride: Option<[usize; 2]>,
    /// Zero padding (counted in the average).
    pub padding: [usize; 2],
}

impl AvgPool2d {
    /// Non-overlapping windows of `k` x `k`.
    pub fn new(k: usize) -> AvgPool2d {
        AvgPool2d { kernel: [k, k], stride: None, padding: [0, 0] }
    }
}

impl Forward for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.avg_pool2d(self.kernel, self.stride, self.padding)
    }
}

/// Flatten dims `1..` into one (PyTorch `nn.Flatten()`).
#[derive(Clone, Copy, Debug, Default, Module)]
pub struct Flatten;

impl Forward for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() < 2 {
            return Ok(x.clone());
        }
        x.flatten(1, -1)
    }
}

/// Batch normalisation over the channel dim 1 of `[N, C]` or `[N, C, ...]`
/// (PyTorch `nn.BatchNorm1d`/`nn.BatchNorm2d`): batch statistics in
/// training, running statistics (momentum 0.1, unbiased variance) in eval.
#[derive(Module)]
pub struct BatchNorm {
    /// Scale `[C]`, initialised to ones.
    pub weight: Parameter,
    /// Shift `[C]`, initialised to zeros.
    pub bias: Parameter,
    running_mean: Parameter,
    running_var: Parameter,
    num_batches_tracked: Parameter,
    eps: f64,
    momentum: f64,
    training: Training,
}

impl BatchNorm {
    /// For `channels` features (BatchNorm1d) or channels (BatchNorm2d).
    pub fn new(channels: usize, device: Device) -> Result<BatchNorm> {
        Ok(BatchNorm {
            weight: Parameter::new(Tensor::ones(&[channels], DType::F32, device)?.contiguous()?)?,
            bias: Parameter::new(Tensor::zeros(&[channels], DType::F32, device)?.contiguous()?)?,
            running_mean: Parameter::buffer(Tensor::zeros(&[channels], DType::F32, device)?.contiguous()?),
            running_var: Parameter::buffer(Tensor::ones(&[channels], DType::F32, device)?.contiguous()?),
            num_batches_tracked: Parameter::buffer(Tensor::zeros(&[], DType::I32, device)?.contiguous()?),
            eps: 1e-5,
            momentum: 0.1,
            training: Training::new(),
        })
    }
}

impl Forward for BatchNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weight.value().numel();
        if x.rank() < 2 || x.dims()[1] != c {
            bail!(Shape, "BatchNorm", "expected input [N, {c}, ...], got {:?}", x.dims());
        }
        let mut shape = vec![1usize; x.rank()];
        shape[1] = c;
        let axes: Vec<isize> = (0..x.rank() as isize).filter(|&a| a != 1).collect();
        let (mean, var) = if self.training.get() {
            let n = x.numel() / c;
            if n < 2 {
                bail!(Shape, "BatchNorm", "training needs more than one value per channel, got input {:?}", x.dims());
            }
            let mean = x.mean(&axes, true)?;
            let var = x.sub(&mean)?.sqr()?.mean(&axes, true)?;
            let m = self.momentum;
            let batch_mean = mean.detach().reshape_dims(&[c])?;
            let batch_var = var.detach().reshape_dims(&[c])?.mul(n as f64 / (n as f64 - 1.0))?;
            self.running_mean.set(self.running_mean.value().mul(1.0 - m)?.add(&batch_mean.mul(m)?)?)?;
            self.running_var.set(self.running_var.value().mul(1.0 - m)?.add(&batch_var.mul(m)?)?)?;
            self.num_batches_tracked.set(self.num_batches_tracked.value().add(1)?)?;
            (mean, var)
        } else {
            (self.running_mean.value().reshape_dims(&shape)?, self.running_var.value().reshape_dims(&shape)?)
        };
        let y = x.sub(&mean)?.mul(&var.add(self.eps)?.rsqrt()?)?;
        y.mul(&self.weight.value().reshape_dims(&shape)?)?.add(&self.bias.value().reshape_dims(&shape)?)
    }
}

/// PyTorch `nn.BatchNorm1d` (input `[N, C]` or `[N, C, L]`).
pub type BatchNorm1d = BatchNorm;
/// PyTorch `nn.BatchNorm2d` (input `[N, C, H, W]`).
pub type BatchNorm2d = BatchNorm;

/// Layer normalisation over the trailing dims (PyTorch `nn.LayerNorm`).
#[derive(Module)]
pub struct LayerNorm {
    /// Scale, initialised to ones.
    pub weight: Parameter,
    /// Shift, initialised to zeros.
    pub bias: Parameter,
    shape: Vec<usize>,
    eps: f64,
}

impl LayerNorm {
    /// From given scale and shift (of the same shape).
    pub fn from_parameters(weight: Parameter, bias: Parameter, eps: f64) -> Result<LayerNorm> {
        let shape = weight.value().dims().to_vec();
        if bias.value().dims() != shape {
            bail!(Shape, "LayerNorm", "weight {:?} and bias {:?} must have one shape", shape, bias.value().dims());
        }
        Ok(LayerNorm { weight, bias, shape, eps })
    }

    /// Normalise over trailing dims of `shape`.
    pub fn new(shape: &[usize], eps: f64, device: Device) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: Parameter::new(Tensor::ones(shape, DType::F32, device)?.contiguous()?)?,
            bias: Parameter::new(Tensor::zeros(shape, DType::F32, device)?.contiguous()?)?,
            shape: shape.to_vec(),
            eps,
        })
    }
}

impl Forward for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.shape, Some(&self.weight.value()), Some(&self.bias.value()), self.eps)
    }
}

/// A lookup table of `num` vectors of size `dim` (PyTorch `nn.Embedding`,
/// initialised standard normal).
#[derive(Module)]
pub struct Embedding {
    /// `[num, dim]`.
    pub weight: Parameter,
}

impl Embedding {
    /// `num` embeddings of size `dim`.
    pub fn new(num: usize, dim: usize, device: Device) -> Result<Embedding> {
        Ok(Embedding { weight: Parameter::new(init::normal(&[num, dim], 0.0, 1.0, device)?)? })
    }
}

impl Forward for Embedding {
    fn forward(&self, index: &Tensor) -> Result<Tensor> {
        self.weight.value().embedding(index)
    }
}

/// Dropout with probability `p` in training mode, identity in eval mode.
#[derive(Module)]
pub struct Dropout {
    p: f64,
    training: Training,
}

impl Dropout {
    /// Zero each element with probability `p` while training.
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            bail!(Value, "Dropout", "probability must be in [0, 1], got {p}");
        }
        Ok(Dropout { p, training: Training::new() })
    }
}

impl Forward for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.dropout(self.p, self.training.get())
    }
}
