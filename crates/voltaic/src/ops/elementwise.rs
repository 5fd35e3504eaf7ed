//! Elementwise ops: unary primitives, broadcasting binary ops with dtype
//! promotion, comparisons, `where`, casts, and the activations composed from them.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::OpKind;
use crate::primitive::{binary_table, cmp_table, unary_table, BinaryOp, CmpOp, Domain, MapOp, UnaryOp};
use crate::shape::broadcast_shapes;
use crate::tensor::{cast_scalar, Tensor};

/// Something that can stand on the right of a binary op: a tensor or a scalar.
///
/// Scalars follow PyTorch: a float scalar with an integer or bool tensor gives
/// f32; an integer scalar keeps the tensor's dtype (bool becomes i32).
pub trait IntoOperand {
    /// The operand as a tensor on `like`'s device.
    fn operand(self, like: &Tensor) -> Result<Tensor>;
}

impl IntoOperand for &Tensor {
    fn operand(self, _: &Tensor) -> Result<Tensor> {
        Ok(self.clone())
    }
}
impl IntoOperand for Tensor {
    fn operand(self, _: &Tensor) -> Result<Tensor> {
        Ok(self)
    }
}
impl IntoOperand for &&Tensor {
    fn operand(self, _: &Tensor) -> Result<Tensor> {
        Ok((*self).clone())
    }
}

fn float_scalar(v: f64, like: &Tensor) -> Result<Tensor> {
    let dt = like.dtype().to_float();
    Tensor::constant(v, dt, like)
}
fn int_scalar(v: f64, like: &Tensor) -> Result<Tensor> {
    let dt = if like.dtype() == DType::Bool { DType::I32 } else { like.dtype() };
    // Wrap into an integer dtype as the tensor-tensor ops do (u32 + -1 subtracts
    // one); `cast_scalar` alone would saturate -1 to 0.
    let v = match dt {
        DType::I32 => v as i64 as i32 as f64,
        DType::U32 => v as i64 as u32 as f64,
        _ => v,
    };
    Tensor::constant(v, dt, like)
}
impl IntoOperand for f64 {
    fn operand(self, like: &Tensor) -> Result<Tensor> {
        float_scalar(self, like)
    }
}
impl IntoOperand for f32 {
    fn operand(self, like: &Tensor) -> Result<Tensor> {
        float_scalar(self as f64, like)
    }
}
impl IntoOperand for i32 {
    fn operand(self, like: &Tensor) -> Result<Tensor> {
        int_scalar(self as f64, like)
    }
}
impl IntoOperand for u32 {
    fn operand(self, like: &Tensor) -> Result<Tensor> {
        int_scalar(self as f64, like)
    }
}
impl IntoOperand for bool {
    fn operand(self, like: &Tensor) -> Result<Tensor> {
        Tensor::constant(self as u8 as f64, like.dtype(), like)
    }
}

impl Tensor {
    /// A 0-d constant of `dtype` on `like`'s device (broadcasts anywhere).
    pub(crate) fn constant(v: f64, dtype: DType, like: &Tensor) -> Result<Tensor> {
        Tensor::from_op(OpKind::Const(cast_scalar(v, dtype)), &[], dtype, like.device(), vec![])
    }

    pub(crate) fn check_same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device() != other.device() {
            bail!(
                Device,
                op,
                "expected all tensors on one device, got {} and {}; move one with to_device",
                self.device(),
                other.device()
            );
        }
        Ok(())
    }

    /// Convert to another dtype (`as` semantics: floats to ints truncate and
    /// saturate, NaN becomes 0, nonzero becomes `true`).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let out = Tensor::from_op(OpKind::Map(MapOp::Cast), &[self], dtype, self.device(), self.dims().to_vec())?;
        if !dtype.is_float() {
            return Ok(out);
        }
        let from = self.dtype();
        Ok(out.track(&[self], move |g, _| Ok(vec![Some(g.to_dtype(from)?)])))
    }

    /// Apply a unary primitive, promoting the input as the op's domain asks.
    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        let x = match op.domain() {
            Domain::Float => self.to_dtype(self.dtype().to_float())?,
            Domain::Numeric => {
                if self.dtype() == DType::Bool {
                    bail!(DType, op.name(), "expected a numeric tensor, got bool");
                }
                self.clone()
            }
            Domain::Bool => {
                if self.dtype() != DType::Bool {
                    self.ne(0)?
                } else {
                    self.clone()
                }
            }
        };
        let dt = x.dtype();
        let out = Tensor::from_op(OpKind::Map(MapOp::Unary(op)), &[&x], dt, self.device(), self.dims().to_vec())?;
        if !dt.is_float() {
            return Ok(out);
        }
        // Only what the gradient reads is kept for the backward pass: a
        // bias add and relu then fuse into the kernel that makes their
        // input, which is no longer stored for later. What is not read is
        // given as `g`.
        let [rx, ry] = op.grad_reads();
        let (xd, yd) = (rx.then(|| x.detach()), ry.then(|| out.detach()));
        Ok(out.track(&[&x], move |g, _| Ok(vec![Some(op.grad(xd.as_ref().unwrap_or(g), yd.as_ref().unwrap_or(g), g)?)])))
    }

    /// Apply a binary primitive with broadcasting and dtype promotion.
    pub fn binary<R: IntoOperand>(&self, op: BinaryOp, rhs: R) -> Result<Tensor> {
        let rhs = rhs.operand(self)?;
        self.check_same_device(op.name(), &rhs)?;
        let dims = broadcast_shapes(op.name(), self.dims(), rhs.dims())?;
        let mut dt = DType::promote(self.dtype(), rhs.dtype());
        if dt == DType::Bool && op.domain() == Domain::Numeric {
            // bool op bool stays bool, as PyTorch: + and maximum are "or", * and minimum "and".
            match op {
                BinaryOp::Add | BinaryOp::Maximum => return self.binary(BinaryOp::Or, &rhs),
                BinaryOp::Mul | BinaryOp::Minimum => return self.binary(BinaryOp::And, &rhs),
                BinaryOp::Sub => bail!(DType, "sub", "two bool tensors cannot be subtracted (as in PyTorch); use logical_xor, or cast them first"),
                _ => {}
            }
        }
        dt = match op.domain() {
            Domain::Float => dt.to_float(),
            Domain::Numeric if dt == DType::Bool => DType::I32,
            Domain::Numeric => dt,
            Domain::Bool => DType::Bool,
        };
        let a = self.to_dtype(dt)?.broadcast_to(&dims)?;
        let b = rhs.to_dtype(dt)?.broadcast_to(&dims)?;
        let out = Tensor::from_op(OpKind::Map(MapOp::Binary(op)), &[&a, &b], dt, self.device(), dims)?;
        if !dt.is_float() {
            return Ok(out);
        }
        // As for unary ops, only what the gradient reads is kept.
        let [ra, rb, ry] = op.grad_reads();
        let (ad, bd, yd) = (ra.then(|| a.detach()), rb.then(|| b.detach()), ry.then(|| out.detach()));
        Ok(out.track(&[&a, &b], move |g, _| {
            let (ga, gb) = op.grad(ad.as_ref().unwrap_or(g), bd.as_ref().unwrap_or(g), yd.as_ref().unwrap_or(g), g)?;
            Ok(vec![Some(ga), Some(gb)])
        }))
    }

    /// Compare elementwise with broadcasting, giving bool.
    pub fn compare<R: IntoOperand>(&self, op: CmpOp, rhs: R) -> Result<Tensor> {
        let rhs = rhs.operand(self)?;
        self.check_same_device(op.name(), &rhs)?;
        let dims = broadcast_shapes(op.name(), self.dims(), rhs.dims())?;
        let dt = DType::promote(self.dtype(), rhs.dtype());
        let a = self.to_dtype(dt)?.broadcast_to(&dims)?;
        let b = rhs.to_dtype(dt)?.broadcast_to(&dims)?;
        Tensor::from_op(OpKind::Map(MapOp::Cmp(op)), &[&a, &b], DType::Bool, self.device(), dims)
    }

    /// `self ? on_true : on_false` elementwise (PyTorch `torch.where(cond, a, b)`),
    /// broadcasting all three; `self` is read as bool.
    pub fn where_cond<A: IntoOperand, B: IntoOperand>(&self, on_true: A, on_false: B) -> Result<Tensor> {
        let a = on_true.operand(self)?;
        let b = on_false.operand(&a)?;
        let cond = if self.dtype() == DType::Bool { self.clone() } else { self.ne(0)? };
        cond.check_same_device("where", &a)?;
        cond.check_same_device("where", &b)?;
        let dims = broadcast_shapes("where", &broadcast_shapes("where", cond.dims(), a.dims())?, b.dims())?;
        let dt = DType::promote(a.dtype(), b.dtype());
        let c = cond.broadcast_to(&dims)?;
        let a = a.to_dtype(dt)?.broadcast_to(&dims)?;
        let b = b.to_dtype(dt)?.broadcast_to(&dims)?;
        let out = Tensor::from_op(OpKind::Map(MapOp::Where), &[&c, &a, &b], dt, self.device(), dims)?;
        let c = c.detach();
        Ok(out.track(&[&a, &b], move |g, _| Ok(vec![Some(c.where_cond(g, 0.0)?), Some(c.where_cond(0.0, g)?)])))
    }

    /// Fill positions where `mask` is true with `value` (PyTorch `masked_fill`).
    pub fn masked_fill<V: IntoOperand>(&self, mask: &Tensor, value: V) -> Result<Tensor> {
        if mask.dtype() != DType::Bool {
            bail!(DType, "masked_fill", "expected a bool mask, got {}", mask.dtype());
        }
        let v = value.operand(self)?.to_dtype(self.dtype())?;
        let out = mask.where_cond(&v, self)?;
        if out.dims() != self.dims() {
            bail!(Shape, "masked_fill", "mask of shape {:?} does not broadcast to the tensor's shape {:?}", mask.dims(), self.dims());
        }
        Ok(out)
    }
}

/// Whether a gradient reads one of its tensor parameters: `_` is not read.
macro_rules! reads {
    (_) => {
        false
    };
    ($x:ident) => {
        true
    };
}

/// The unary primitives' methods and gradients, from the op table.
macro_rules! unary_ops {
    ($( $(#[$m:meta])* $T:ident $method:ident $name:literal $dom:ident |$gx:tt, $gy:tt, $gg:ident| $grad:expr; { $($kernel:tt)* } )*) => {
        impl Tensor {
            $(
                $(#[$m])*
                pub fn $method(&self) -> Result<Tensor> {
                    self.unary(UnaryOp::$T)
                }
            )*
        }
        impl UnaryOp {
            /// The gradient with respect to the input, from the detached input
            /// `x`, output `y` and output gradient `g`.
            #[allow(unused_variables)]
            pub(crate) fn grad(self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
                match self {
                    $( UnaryOp::$T => { let ($gx, $gy, $gg) = (x, y, g); $grad } )*
                }
            }

            /// Whether the gradient reads the input and the output (an
            /// entry names a parameter it does not read `_`).
            pub(crate) fn grad_reads(self) -> [bool; 2] {
                match self {
                    $( UnaryOp::$T => [reads!($gx), reads!($gy)], )*
                }
            }
        }
    };
}
unary_table!(unary_ops);

/// The binary primitives' methods and gradients, from the op table.
macro_rules! binary_ops {
    ($( $(#[$m:meta])* $T:ident $method:ident $name:literal $dom:ident |$ga:tt, $gb:tt, $gy:tt, $gg:ident| $grad:expr; { $($kernel:tt)* } )*) => {
        impl Tensor {
            $(
                $(#[$m])*
                pub fn $method<R: IntoOperand>(&self, rhs: R) -> Result<Tensor> {
                    self.binary(BinaryOp::$T, rhs)
                }
            )*
        }
        impl BinaryOp {
            /// The gradients with respect to both operands (of the output's
            /// shape), from the detached operands, output `y` and output gradient `g`.
            #[allow(unused_variables)]
            pub(crate) fn grad(self, a: &Tensor, b: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
                match self {
                    $( BinaryOp::$T => { let ($ga, $gb, $gy, $gg) = (a, b, y, g); $grad } )*
                }
            }

            /// Whether the gradients read each operand and the output (an
            /// entry names a parameter it does not read `_`).
            pub(crate) fn grad_reads(self) -> [bool; 3] {
                match self {
                    $( BinaryOp::$T => [reads!($ga), reads!($gb), reads!($gy)], )*
                }
            }
        }
    };
}
binary_table!(binary_ops);

/// The comparisons' methods, from the op table.
macro_rules! cmp_ops {
    ($( $(#[$m:meta])* $V:ident $method:ident $name:literal $wgsl:literal; )*) => {
        impl Tensor {
            $(
                $(#[$m])*
                pub fn $method<R: IntoOperand>(&self, rhs: R) -> Result<Tensor> {
                    self.compare(CmpOp::$V, rhs)
                }
            )*
        }
    };
}
cmp_table!(cmp_ops);

impl Tensor {
    /// Maximum/minimum gradients: the winner takes the gradient `self`,
    /// ties split it evenly (as PyTorch).
    pub(crate) fn split_ties(&self, a_wins: &Tensor, tie: &Tensor, b_wins: &Tensor) -> Result<(Tensor, Tensor)> {
        let dt = self.dtype();
        let half = tie.to_dtype(dt)?.mul(0.5)?;
        Ok((self.mul(&a_wins.to_dtype(dt)?.add(&half)?)?, self.mul(&b_wins.to_dtype(dt)?.add(&half)?)?))
    }
}

impl Tensor {
    /// Where `x` is NaN (bool; never for integer and bool tensors), as `torch.isnan`.
    pub fn isnan(&self) -> Result<Tensor> {
        // `ne` is NaN-aware on every executor (the WGSL tests the bits).
        self.ne(self)
    }

    /// Where `x` is +inf or -inf (bool), as `torch.isinf`.
    pub fn isinf(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.ne(self);
        }
        // Non-finite and not NaN: 1 - 0 for an infinity, 1 - 1 for NaN.
        self.nonfinite()?.sub(&self.isnan()?.to_dtype(self.dtype())?)?.gt(0.5)
    }

    /// Where `x` is neither infinite nor NaN (bool), as `torch.isfinite`.
    pub fn isfinite(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.eq(self);
        }
        self.nonfinite()?.eq(0.0)
    }

    /// `x * x`.
    pub fn sqr(&self) -> Result<Tensor> {
        self.mul(self)
    }

    /// `x` where `x > 0`, else `slope * x`.
    pub fn leaky_relu(&self, slope: f64) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        x.gt(0.0)?.where_cond(&x, &x.mul(slope)?)
    }

    /// Compute composite `f` on `self` as a float: in f32 where `self` is a
    /// half type, the result rounded back to it once. PyTorch's kernels
    /// compute half inputs in f32 the same way ("opmath"); composed in half
    /// precision, each step of the composite (and of its gradient) would
    /// round to half, and a fused GPU kernel would run a software rounding
    /// after every one of them (GELU's gradient: twelve, 3.4x the kernel's
    /// f32 time on an H200).
    fn in_opmath(&self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let dt = self.dtype().to_float();
        let x = self.to_dtype(dt)?;
        if dt.compute() == dt {
            return f(&x);
        }
        f(&x.to_dtype(dt.compute())?)?.to_dtype(dt)
    }

    /// GELU, erf form: `x/2 * (1 + erf(x/sqrt 2))` (PyTorch's default);
    /// half inputs compute in f32 and round once.
    pub fn gelu(&self) -> Result<Tensor> {
        self.in_opmath(|x| x.mul(std::f64::consts::FRAC_1_SQRT_2)?.erf()?.add(1.0)?.mul(x)?.mul(0.5))
    }

    /// GELU, tanh approximation (PyTorch `approximate="tanh"`); half inputs
    /// compute in f32 and round once.
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        self.in_opmath(|x| {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let inner = x.mul(x)?.mul(x)?.mul(0.044715)?.add(x)?.mul(c)?;
            inner.tanh()?.add(1.0)?.mul(x)?.mul(0.5)
        })
    }

    /// SiLU (swish): `x * sigmoid(x)`; half inputs compute in f32 and round once.
    pub fn silu(&self) -> Result<Tensor> {
        self.in_opmath(|x| x.mul(&x.sigmoid()?))
    }

    /// Softplus `ln(1 + e^x)`, computed stably as `max(x, 0) + ln(1 + e^-|x|)`;
    /// its gradient is `sigmoid(x)` (0.5 at 0, where the parts' kinks meet).
    pub fn softplus(&self) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        let xd = x.detach();
        let y = xd.relu()?.add(&xd.abs()?.neg()?.exp()?.log1p()?)?;
        Ok(y.track(&[&x], move |g, _| Ok(vec![Some(g.mul(&xd.sigmoid()?)?)])))
    }

    /// Limit to `[min, max]`; either bound may be absent. NaN stays NaN, and
    /// with `min > max` every element becomes `max` (as PyTorch). The
    /// gradient passes where `min <= x <= max`, bounds included.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        let scalar = |v: f64, x: &Tensor| -> Result<Tensor> {
            if x.dtype().is_float() || v.fract() == 0.0 {
                Tensor::constant(v, x.dtype(), x)
            } else {
                Tensor::constant(v, DType::F32, x)
            }
        };
        let xd = self.detach();
        let mut y = xd.clone();
        if let Some(lo) = min {
            y = y.maximum(scalar(lo, &y)?)?;
        }
        if let Some(hi) = max {
            y = y.minimum(scalar(hi, &y)?)?;
        }
        if !y.dtype().is_float() {
            return Ok(y);
        }
        let x = self.clone();
        Ok(y.track(&[&x], move |g, _| {
            let mut pass = xd.eq(&xd)?;
            if let Some(lo) = min {
                pass = pass.logical_and(&xd.ge(lo)?)?;
            }
            if let Some(hi) = max {
                pass = pass.logical_and(&xd.le(hi)?)?;
            }
            Ok(vec![Some(pass.where_cond(g, 0.0)?)])
        }))
    }
}
