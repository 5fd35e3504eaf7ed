//! Reductions over any set of axes (negative axes allowed, empty = all), and
//! the normalisations built on them.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::OpKind;
use crate::primitive::{reduce_table, BinaryOp, IndexOp, ReduceOp};
use crate::shape::{norm_axes, norm_axis};
use crate::tensor::Tensor;

/// The axes a reduction is asked for, as `norm_axes` takes them. A 0-d
/// tensor accepts axis 0 or -1, as PyTorch (there is nothing to reduce).
fn reduce_axes<'a>(op: &'static str, axes: &'a [isize], rank: usize) -> Result<&'a [isize]> {
    if rank == 0 {
        if let Some(&a) = axes.iter().find(|&&a| a != 0 && a != -1) {
            bail!(Axis, op, "axis {a} is out of range for a 0-d tensor (expected 0 or -1)");
        }
        return Ok(&[]);
    }
    Ok(axes)
}

/// The reductions' gradients, from the op table.
macro_rules! reduce_grads {
    ($( $(#[$m:meta])* $V:ident $name:literal $identity:expr, $combine:ident, $arg:literal, |$x:ident, $y:ident, $g:ident, $axes:ident| $grad:expr; )*) => {
        impl ReduceOp {
            /// The gradient with respect to the input `x`, from the output `y`
            /// and its gradient `g`, both broadcast to `x`'s shape.
            #[allow(unused_variables)]
            fn grad(self, x: &Tensor, y: &Tensor, g: &Tensor, axes: &[isize]) -> Result<Tensor> {
                match self {
                    $( ReduceOp::$V => { let ($x, $y, $g, $axes) = (x, y, g, axes); $grad } )*
                }
            }
        }
    };
}
reduce_table!(reduce_grads);

impl Tensor {
    /// Gradient of a product over `axes`, as PyTorch: `g * y / x` where `x`
    /// is not 0; at a zero that is the only one of its group, `g` times the
    /// product of the others; at other zeros, 0.
    pub(crate) fn prod_grad(&self, y: &Tensor, g: &Tensor, axes: &[isize]) -> Result<Tensor> {
        let dims = self.dims();
        let zero = self.eq(0.0)?;
        let zeros = zero.to_dtype(DType::I32)?.sum(axes, true)?.broadcast_to(dims)?;
        let others = zero.where_cond(1.0, self)?.prod(axes, true)?.broadcast_to(dims)?;
        let at_zero = zeros.eq(1)?.where_cond(&g.mul(&others)?, 0.0)?;
        zero.where_cond(&at_zero, &g.mul(y)?.div(self)?)
    }

    /// Gradient of a maximum or minimum over `axes`: ties share it evenly.
    pub(crate) fn extreme_grad(&self, y: &Tensor, g: &Tensor, axes: &[isize]) -> Result<Tensor> {
        let hit = self.eq(y)?.to_dtype(g.dtype())?;
        let count = hit.sum(axes, true)?;
        g.mul(&hit)?.div(&count.broadcast_to(self.dims())?)
    }

    /// Record a reduction. The result keeps the reduced dims (size 1) when
    /// `keepdim`, otherwise drops them.
    pub fn reduce(&self, op: ReduceOp, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        if self.dtype() == DType::Bool && matches!(op, ReduceOp::Max | ReduceOp::Min) {
            // max/min of bools stay bool (any/all), as PyTorch.
            return self.to_dtype(DType::I32)?.reduce(op, axes, keepdim)?.to_dtype(DType::Bool);
        }
        let axes = norm_axes(op.name(), reduce_axes(op.name(), axes, self.rank())?, self.rank())?;
        let reduced: usize = axes.iter().map(|&a| self.dims()[a]).product();
        let kept: usize = (0..self.rank()).filter(|d| !axes.contains(d)).map(|d| self.dims()[d]).product();
        if reduced == 0 && kept != 0 && !matches!(op, ReduceOp::Sum | ReduceOp::Prod) {
            bail!(Shape, op.name(), "cannot reduce an empty dimension of a tensor of shape {:?}: {} has no identity", self.dims(), op.name());
        }
        let x = match op {
            _ if self.dtype() == DType::Bool && !op.is_arg() => self.to_dtype(DType::I32)?,
            _ => self.clone(),
        };
        let dt = if op.is_arg() { DType::I32 } else { x.dtype() };
        let mut out_dims = x.dims().to_vec();
        for &a in &axes {
            out_dims[a] = 1;
        }
        // The value: a reduction kernel, or for a few elements per output an
        // elementwise chain; the gradient is recorded here either way.
        let t = match crate::autograd::no_grad(|| x.detach().reduce_unrolled(op, &axes, reduced))? {
            Some(t) => t,
            None => Tensor::from_op(OpKind::Reduce(op, axes.clone()), &[&x], dt, self.device(), out_dims)?,
        };
        let t = if op.is_arg() || !dt.is_float() {
            t
        } else {
            let (xd, yd) = (x.detach(), t.detach());
            let axes: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
            t.track(&[&x], move |g, _| {
                let full = xd.dims();
                let (g, y) = (g.broadcast_to(full)?, yd.broadcast_to(full)?);
                Ok(vec![Some(op.grad(&xd, &y, &g, &axes)?)])
            })
        };
        if keepdim {
            return Ok(t);
        }
        let dims: Vec<usize> = (0..self.rank()).filter(|d| !axes.contains(d)).map(|d| self.dims()[d]).collect();
        t.reshape_dims(&dims)
    }

    /// A reduction over at most 8 elements per output as a chain of binary ops
    /// on views (the reduced dims kept with size 1): an elementwise kernel
    /// that fuses with its neighbours, where a reduction kernel over tiny
    /// strided segments (pooling windows) would be slow on every device.
    /// Half types keep the reduction kernel, which rounds once at the end.
    fn reduce_unrolled(&self, op: ReduceOp, axes: &[usize], reduced: usize) -> Result<Option<Tensor>> {
        let bin = match op {
            ReduceOp::Sum => BinaryOp::Add,
            ReduceOp::Prod => BinaryOp::Mul,
            ReduceOp::Max => BinaryOp::Maximum,
            ReduceOp::Min => BinaryOp::Minimum,
            _ => return Ok(None),
        };
        if !(2..=8).contains(&reduced) || !matches!(self.dtype(), DType::F32 | DType::F64 | DType::I32 | DType::U32) {
            return Ok(None);
        }
        let sizes: Vec<usize> = axes.iter().map(|&a| self.dims()[a]).collect();
        let mut acc: Option<Tensor> = None;
        for combo in 0..reduced {
            let mut rest = combo;
            let mut v = self.clone();
            for (k, &a) in axes.iter().enumerate().rev() {
                v = v.narrow(a as isize, rest % sizes[k], 1)?;
                rest /= sizes[k];
            }
            acc = Some(match acc {
                None => v,
                Some(prev) => prev.binary(bin, &v)?,
            });
        }
        Ok(acc)
    }

    /// Sum over `axes` (bool sums count as i32; integers wrap).
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, axes, keepdim)
    }
    /// Sum of all elements, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }
    /// Product over `axes`.
    pub fn prod(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Prod, axes, keepdim)
    }
    /// Maximum over `axes` (values only; see [`Tensor::argmax`] for indices). NaN propagates.
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, axes, keepdim)
    }
    /// Minimum over `axes`. NaN propagates.
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Min, axes, keepdim)
    }

    fn arg(&self, op: ReduceOp, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        match dim {
            Some(d) => {
                if self.rank() == 0 && d != 0 && d != -1 {
                    bail!(Axis, op.name(), "dim {d} is out of range for a 0-d tensor (expected 0 or -1)");
                }
                let d = norm_axis(op.name(), d, self.rank().max(1))?;
                if self.rank() == 0 {
                    return self.reshape_dims(&[1])?.reduce(op, &[0], false);
                }
                self.reduce(op, &[d as isize], keepdim)
            }
            None => {
                let r = self.flatten_all()?.reduce(op, &[0], false)?;
                if keepdim {
                    r.reshape_dims(&vec![1; self.rank()])
                } else {
                    Ok(r)
                }
            }
        }
    }

    /// Index of the first maximum along `dim` (or of the flattened tensor when
    /// `None`), as i32 (PyTorch returns int64). NaN counts as the maximum.
    pub fn argmax(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg(ReduceOp::ArgMax, dim, keepdim)
    }
    /// Index of the first minimum, as [`Tensor::argmax`].
    pub fn argmin(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg(ReduceOp::ArgMin, dim, keepdim)
    }

    fn reduced_count(&self, op: &'static str, axes: &[isize]) -> Result<usize> {
        let axes = norm_axes(op, reduce_axes(op, axes, self.rank())?, self.rank())?;
        Ok(axes.iter().map(|&a| self.dims()[a]).product())
    }

    /// Mean over `axes` (integers give f32). The mean of nothing is NaN.
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let x = self.to_dtype(super::autocast::full(self.dtype()))?;
        let n = x.reduced_count("mean", axes)?;
        x.sum(axes, keepdim)?.div(n as f64)
    }

    /// Variance over `axes` with Bessel's `correction` (PyTorch's default is 1).
    pub fn var(&self, axes: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        self.var_as("var", axes, correction, keepdim)
    }

    /// `var`, with errors naming `op`.
    fn var_as(&self, op: &'static str, axes: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        let x = self.to_dtype(super::autocast::full(self.dtype()))?;
        let n = x.reduced_count(op, axes)?;
        let mu = x.mean(axes, true)?;
        let ss = x.sub(&mu)?.sqr()?.sum(axes, keepdim)?;
        ss.div((n as f64 - correction as f64).max(0.0))
    }

    /// Standard deviation over `axes` with Bessel's `correction`.
    pub fn std(&self, axes: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        self.var_as("std", axes, correction, keepdim)?.sqrt()
    }

    /// Mean of all elements, as a 0-d tensor (`torch.mean(x)`).
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }
    /// Product of all elements, as a 0-d tensor.
    pub fn prod_all(&self) -> Result<Tensor> {
        self.prod(&[], false)
    }
    /// Largest element, as a 0-d tensor (`torch.max(x)`). NaN propagates.
    pub fn max_all(&self) -> Result<Tensor> {
        self.max(&[], false)
    }
    /// Smallest element, as a 0-d tensor. NaN propagates.
    pub fn min_all(&self) -> Result<Tensor> {
        self.min(&[], false)
    }
    /// Variance of all elements with Bessel's `correction`, as a 0-d tensor.
    pub fn var_all(&self, correction: usize) -> Result<Tensor> {
        self.var(&[], correction, false)
    }
    /// Standard deviation of all elements with Bessel's `correction`, as a 0-d tensor.
    pub fn std_all(&self, correction: usize) -> Result<Tensor> {
        self.std(&[], correction, false)
    }
    /// `log(sum(exp(x)))` over all elements, as a 0-d tensor.
    pub fn logsumexp_all(&self) -> Result<Tensor> {
        self.logsumexp(&[], false)
    }
    /// Index of the first maximum in the flattened tensor, as a 0-d i32
    /// tensor (`torch.argmax(x)`).
    pub fn argmax_all(&self) -> Result<Tensor> {
        self.argmax(None, false)
    }
    /// Index of the first minimum in the flattened tensor, as a 0-d i32 tensor.
    pub fn argmin_all(&self) -> Result<Tensor> {
        self.argmin(None, false)
    }

    /// `log(sum(exp(x)))` over `axes`, computed stably.
    pub fn logsumexp(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let x = self.to_dtype(super::autocast::full(self.dtype()))?;
        if x.reduced_count("logsumexp", axes)? == 0 {
            // The log of an empty sum: -inf (PyTorch), where max would have no identity.
            return x.sum(axes, keepdim)?.log();
        }
        let m = x.max(axes, true)?.detach();
        // An all -inf slice has max -inf; shift by 0 there so the result is -inf, not NaN.
        let m = m.abs()?.eq(f64::INFINITY)?.where_cond(&m.zeros_like()?, &m)?;
        let s = x.sub(&m)?.exp()?.sum(axes, true)?.log()?.add(&m)?;
        if keepdim {
            Ok(s)
        } else {
            let axes = norm_axes("logsumexp", reduce_axes("logsumexp", axes, self.rank())?, self.rank())?;
            let dims: Vec<usize> = (0..self.rank()).filter(|d| !axes.contains(d)).map(|d| self.dims()[d]).collect();
            s.reshape_dims(&dims)
        }
    }

    /// Softmax along `dim`. Runs as three kernels: max, sum of exp, normalise
    /// (the exponentials are recomputed rather than stored).
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let x = self.to_dtype(super::autocast::full(self.dtype()))?;
        let d = norm_axis("softmax", dim, x.rank().max(1))? as isize;
        if x.rank() == 0 {
            return x.sub(&x)?.exp();
        }
        if x.numel() == 0 {
            return Ok(x);
        }
        // The value from the detached input and the gradient from the output
        // alone, `y * (g - sum(g * y))`: recorded through its primitives, the
        // division would keep the row sums and the exponentials for its
        // gradient, and kept statistics stop the row fusion, so a training
        // step's softmax ran as four kernels instead of one (an encoder's
        // attention, 49,152 rows of 128: 172 us a layer on an H200).
        // The exponentials are written twice, so the row kernel recomputes
        // them rather than store them.
        let xd = x.detach();
        let m = xd.max(&[d], true)?;
        let y = xd.sub(&m)?.exp()?.div(&xd.sub(&m)?.exp()?.sum(&[d], true)?)?;
        let yd = y.clone();
        Ok(y.track(&[&x], move |g, _| Ok(vec![Some(yd.mul(&g.sub(&g.mul(&yd)?.sum(&[d], true)?)?)?)])))
    }

    /// Log of the softmax along `dim`, computed stably.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let x = self.to_dtype(super::autocast::full(self.dtype()))?;
        let d = norm_axis("log_softmax", dim, x.rank().max(1))? as isize;
        if x.rank() == 0 {
            return x.sub(&x);
        }
        if x.numel() == 0 {
            return Ok(x);
        }
        // Unlike softmax, recorded through its primitives: its rows are a
        // classifier's (10 wide, in cross entropy), where a row kernel saves
        // little, and its own gradient `g - exp(y) * sum(g)` rounds otherwise:
        // with it, a 50-step Adam run on one device jumped off its
        // data-parallel twin by 1e-4 at one step, past what
        // `voltaic-cli/tests/distributed.rs` allows (1e-5).
        let m = x.max(&[d], true)?.detach();
        let lse = x.sub(&m)?.exp()?.sum(&[d], true)?.log()?;
        x.sub(&m)?.sub(&lse)
    }

    /// Inclusive cumulative sum along `dim` (bool counts as i32).
    pub fn cumsum(&self, dim: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return Ok(self.clone());
        }
        let d = norm_axis("cumsum", dim, self.rank())?;
        let x = if self.dtype() == DType::Bool { self.to_dtype(DType::I32)? } else { self.clone() };
        let dt = x.dtype();
        let out = Tensor::from_op(OpKind::Index(IndexOp::Cumsum { dim: d }), &[&x], dt, self.device(), self.dims().to_vec())?;
        if !dt.is_float() {
            return Ok(out);
        }
        // d/dx_i of sum_{j>=i}: the reversed cumulative sum, as total - cumsum + g.
        let di = d as isize;
        Ok(out.track(&[&x], move |g, _| Ok(vec![Some(g.sum(&[di], true)?.sub(&g.cumsum(di)?)?.add(g)?)])))
    }
}
