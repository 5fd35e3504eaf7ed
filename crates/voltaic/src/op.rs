//! The op table: every primitive elementwise and reduction op, defined once.
//!
//! Each op is a zero-sized type implementing [`UnaryKernel`] or
//! [`BinaryKernel`]: its name, the dtypes it accepts, its scalar kernel for
//! every compute type (the CPU executor turns these into vectorised loops)
//! and its WGSL fragment (the GPU code generator splices it into a fused
//! kernel). Composite ops (softmax, gelu, layer_norm, ...) are built from these
//! primitives in `ops/`.

use crate::cpu::fastmath;
use crate::error::Result;
use crate::tensor::Tensor;

/// Which dtypes an elementwise op accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// Floats only; integer and bool inputs are promoted to f32 first (as PyTorch does).
    Float,
    /// Floats and integers, not bool.
    Numeric,
    /// Bool only.
    Bool,
}

/// A unary primitive: scalar kernels for each compute type plus its WGSL form.
pub trait UnaryKernel {
    /// Name used in errors and kernel names.
    const NAME: &'static str;
    /// WGSL expression over f32, `{x}` standing for the operand; helper
    /// functions it calls come from [`WGSL_HELPERS`].
    const WGSL: &'static str;
    /// WGSL expression over integers (`{T}` is `i32` or `u32`).
    const WGSL_INT: &'static str = Self::WGSL;
    /// Accepted dtypes.
    const DOMAIN: Domain;
    /// f32 kernel.
    fn f32(x: f32) -> f32;
    /// f64 kernel.
    fn f64(x: f64) -> f64;
    /// i32 kernel (numeric ops only).
    fn i32(x: i32) -> i32 {
        x
    }
    /// u32 kernel (numeric ops only).
    fn u32(x: u32) -> u32 {
        x
    }
    /// bool kernel (bool ops only).
    fn bool(x: bool) -> bool {
        x
    }
    /// Gradient with respect to the input, from the input `x`, the output
    /// `y` and the output's gradient `g` (tensor ops, so it runs anywhere).
    fn grad(x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor>;
}

/// A binary primitive over two operands of one dtype.
pub trait BinaryKernel {
    /// Name used in errors and kernel names.
    const NAME: &'static str;
    /// WGSL expression over f32, `{a}` and `{b}` standing for the operands.
    const WGSL: &'static str;
    /// WGSL expression over integers (`{T}` is `i32` or `u32`).
    const WGSL_INT: &'static str = Self::WGSL;
    /// Accepted dtypes.
    const DOMAIN: Domain;
    /// f32 kernel.
    fn f32(a: f32, b: f32) -> f32;
    /// f64 kernel.
    fn f64(a: f64, b: f64) -> f64;
    /// i32 kernel.
    fn i32(a: i32, _b: i32) -> i32 {
        a
    }
    /// u32 kernel.
    fn u32(a: u32, _b: u32) -> u32 {
        a
    }
    /// bool kernel.
    fn bool(a: bool, _b: bool) -> bool {
        a
    }
    /// Gradients with respect to both operands (same shape as the output),
    /// from the operands, the output `y` and the output's gradient `g`.
    fn grad(a: &Tensor, b: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)>;
}

macro_rules! unary {
    ($(#[$m:meta])* $T:ident, $name:literal, $wgsl:literal $(| $wgsl_int:literal)?, $dom:ident,
     |$x:ident| $f32:expr, |$y:ident| $f64:expr $(, int |$i:ident| $int:expr)? $(, bool |$b:ident| $bool:expr)?;
     grad |$gx:ident, $gy:ident, $gg:ident| $grad:expr) => {
        $(#[$m])*
        pub struct $T;
        impl UnaryKernel for $T {
            #[allow(unused_variables)]
            fn grad($gx: &Tensor, $gy: &Tensor, $gg: &Tensor) -> Result<Tensor> { $grad }
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
            $(const WGSL_INT: &'static str = $wgsl_int;)?
            const DOMAIN: Domain = Domain::$dom;
            #[inline(always)]
            fn f32($x: f32) -> f32 { $f32 }
            #[inline(always)]
            fn f64($y: f64) -> f64 { $f64 }
            $(
            #[inline(always)]
            fn i32($i: i32) -> i32 { $int }
            #[inline(always)]
            fn u32($i: u32) -> u32 { $int }
            )?
            $(
            #[inline(always)]
            fn bool($b: bool) -> bool { $bool }
            )?
        }
    };
}

/// Integer helpers shared by the i32 and u32 kernels.
trait IntOps: Copy + PartialOrd + Default {
    fn neg_(self) -> Self;
    fn abs_(self) -> Self;
    fn sign_(self) -> Self;
}
impl IntOps for i32 {
    fn neg_(self) -> i32 {
        self.wrapping_neg()
    }
    fn abs_(self) -> i32 {
        self.wrapping_abs()
    }
    fn sign_(self) -> i32 {
        self.signum()
    }
}
impl IntOps for u32 {
    fn neg_(self) -> u32 {
        self.wrapping_neg()
    }
    fn abs_(self) -> u32 {
        self
    }
    fn sign_(self) -> u32 {
        (self != 0) as u32
    }
}

unary!(/// `-x`
    Neg, "neg", "(-{x})" | "({T}(0) - {x})", Numeric, |x| -x, |x| -x, int |x| x.neg_();
    grad |x, y, g| g.neg());
unary!(/// `|x|`
    Abs, "abs", "abs({x})", Numeric, |x| x.abs(), |x| x.abs(), int |x| x.abs_();
    grad |x, y, g| g.mul(&x.sign()?));
unary!(/// `e^x`
    Exp, "exp", "exp({x})", Float, |x| fastmath::exp_f32(x), |x| x.exp();
    grad |x, y, g| g.mul(y));
unary!(/// natural logarithm
    Log, "log", "log({x})", Float, |x| x.ln(), |x| x.ln();
    grad |x, y, g| g.div(x));
unary!(/// `ln(1 + x)`, accurate near 0
    Log1p, "log1p", "log1p_({x})", Float, |x| x.ln_1p(), |x| x.ln_1p();
    grad |x, y, g| g.div(&x.add(1.0)?));
unary!(/// `e^x - 1`, accurate near 0
    Expm1, "expm1", "expm1_({x})", Float, |x| x.exp_m1(), |x| x.exp_m1();
    grad |x, y, g| g.mul(&y.add(1.0)?));
unary!(/// square root
    Sqrt, "sqrt", "sqrt({x})", Float, |x| x.sqrt(), |x| x.sqrt();
    grad |x, y, g| g.div(&y.mul(2.0)?));
unary!(/// `1 / sqrt(x)`
    Rsqrt, "rsqrt", "(1.0 / sqrt({x}))", Float, |x| 1.0 / x.sqrt(), |x| 1.0 / x.sqrt();
    grad |x, y, g| g.mul(&y.mul(y)?.mul(y)?)?.mul(-0.5));
unary!(/// `1 / x`
    Recip, "reciprocal", "(1.0 / {x})", Float, |x| 1.0 / x, |x| 1.0 / x;
    grad |x, y, g| g.mul(&y.mul(y)?)?.neg());
unary!(/// sine
    Sin, "sin", "sin_({x})", Float, |x| x.sin(), |x| x.sin();
    grad |x, y, g| g.mul(&x.cos()?));
unary!(/// cosine
    Cos, "cos", "cos_({x})", Float, |x| x.cos(), |x| x.cos();
    grad |x, y, g| g.mul(&x.sin()?)?.neg());
unary!(/// hyperbolic tangent
    Tanh, "tanh", "tanh_({x})", Float, |x| x.tanh(), |x| x.tanh();
    grad |x, y, g| g.mul(&y.mul(y)?.neg()?.add(1.0)?));
unary!(/// logistic sigmoid `1 / (1 + e^-x)`
    Sigmoid, "sigmoid", "(1.0 / (1.0 + exp(-{x})))", Float,
    |x| 1.0 / (1.0 + fastmath::exp_f32(-x)), |x| 1.0 / (1.0 + (-x).exp());
    grad |x, y, g| g.mul(y)?.mul(&y.neg()?.add(1.0)?));
unary!(/// `max(x, 0)`; NaN stays NaN as in PyTorch (the WGSL tests NaN on the bits:
    /// some compilers turn the select into a NaN-dropping `max`)
    Relu, "relu", "select(select({x}, 0.0, {x} < 0.0), {x}, isnan_({x}))" | "select({x}, {T}(0), {x} < {T}(0))", Numeric,
    |x| if x < 0.0 { 0.0 } else { x }, |x| if x < 0.0 { 0.0 } else { x },
    int |x| if x < Default::default() { Default::default() } else { x };
    grad |x, y, g| g.mul(&x.gt(0.0)?.to_dtype(g.dtype())?));
unary!(/// the error function
    Erf, "erf", "erf_({x})", Float, |x| libm::erff(x), |x| libm::erf(x);
    grad |x, y, g| g.mul(&x.mul(x)?.neg()?.exp()?.mul(std::f64::consts::FRAC_2_SQRT_PI)?));
unary!(/// round down
    Floor, "floor", "floor({x})" | "{x}", Numeric, |x| x.floor(), |x| x.floor(), int |x| x;
    grad |x, y, g| g.zeros_like());
unary!(/// round up
    Ceil, "ceil", "ceil({x})" | "{x}", Numeric, |x| x.ceil(), |x| x.ceil(), int |x| x;
    grad |x, y, g| g.zeros_like());
unary!(/// round half to even, as PyTorch
    Round, "round", "round({x})" | "{x}", Numeric, |x| x.round_ties_even(), |x| x.round_ties_even(), int |x| x;
    grad |x, y, g| g.zeros_like());
unary!(/// -1, 0 or 1 (NaN stays NaN)
    Sign, "sign", "select(select(select({x}, -1.0, {x} < 0.0), 1.0, {x} > 0.0), {x}, isnan_({x}))" | "select(select({x}, {T}(0) - {T}(1), {x} < {T}(0)), {T}(1), {x} > {T}(0))", Numeric,
    |x| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { x },
    |x| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { x },
    int |x| x.sign_();
    grad |x, y, g| g.zeros_like());
unary!(/// logical not
    Not, "logical_not", "!({x})", Bool, |x| x, |x| x, bool |x| !x;
    grad |x, y, g| g.zeros_like());

macro_rules! binary {
    ($(#[$m:meta])* $T:ident, $name:literal, $wgsl:literal $(| $wgsl_int:literal)?, $dom:ident,
     |$a:ident, $b:ident| $float:expr $(, int |$ia:ident, $ib:ident| $int:expr)? $(, bool |$ba:ident, $bb:ident| $bool:expr)?;
     grad |$ga:ident, $gb:ident, $gy:ident, $gg:ident| $grad:expr) => {
        $(#[$m])*
        pub struct $T;
        impl BinaryKernel for $T {
            #[allow(unused_variables)]
            fn grad($ga: &Tensor, $gb: &Tensor, $gy: &Tensor, $gg: &Tensor) -> Result<(Tensor, Tensor)> { $grad }
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
            $(const WGSL_INT: &'static str = $wgsl_int;)?
            const DOMAIN: Domain = Domain::$dom;
            #[inline(always)]
            fn f32($a: f32, $b: f32) -> f32 { $float }
            #[inline(always)]
            fn f64($a: f64, $b: f64) -> f64 { $float }
            $(
            #[inline(always)]
            fn i32($ia: i32, $ib: i32) -> i32 { $int }
            #[inline(always)]
            fn u32($ia: u32, $ib: u32) -> u32 { $int }
            )?
            $(
            #[inline(always)]
            fn bool($ba: bool, $bb: bool) -> bool { $bool }
            )?
        }
    };
}

binary!(/// `a + b` (integers wrap)
    Add, "add", "({a} + {b})", Numeric, |a, b| a + b, int |a, b| a.wrapping_add(b);
    grad |a, b, y, g| Ok((g.clone(), g.clone())));
binary!(/// `a - b` (integers wrap)
    Sub, "sub", "({a} - {b})", Numeric, |a, b| a - b, int |a, b| a.wrapping_sub(b);
    grad |a, b, y, g| Ok((g.clone(), g.neg()?)));
binary!(/// `a * b` (integers wrap)
    Mul, "mul", "({a} * {b})", Numeric, |a, b| a * b, int |a, b| a.wrapping_mul(b);
    grad |a, b, y, g| Ok((g.mul(b)?, g.mul(a)?)));
binary!(/// true division (integers are promoted to f32 first, as PyTorch)
    Div, "div", "({a} / {b})", Float, |a, b| a / b;
    grad |a, b, y, g| Ok((g.div(b)?, g.mul(y)?.div(b)?.neg()?)));
binary!(/// `a ^ b`
    Pow, "pow", "pow_({a}, {b})", Float, |a, b| a.powf(b);
    grad |a, b, y, g| Ok((g.mul(b)?.mul(&a.pow(&b.sub(1.0)?)?)?, a.gt(0.0)?.where_cond(&g.mul(y)?.mul(&a.log()?)?, 0.0)?)));
binary!(/// remainder with the sign of the divisor (PyTorch `remainder`, Python `%`);
    /// integer division by zero gives 0 instead of raising
    Rem, "remainder", "rem_f32({a}, {b})" | "rem_{T}({a}, {b})", Numeric,
    |a, b| { let r = a % b; if r != 0.0 && ((r < 0.0) != (b < 0.0)) { r + b } else { r } },
    int |a, b| int_rem(a, b);
    grad |a, b, y, g| Ok((g.clone(), g.mul(&a.div(b)?.floor()?)?.neg()?)));
binary!(/// elementwise maximum; NaN wins, as in PyTorch
    Maximum, "maximum", "select({b}, {a}, {a} > {b} || isnan_({a}))" | "max({a}, {b})", Numeric,
    |a, b| if a > b || a.is_nan() { a } else { b }, int |a, b| if a > b { a } else { b };
    grad |a, b, y, g| split_ties(g, &a.gt(b)?, &a.eq(b)?, &b.gt(a)?));
binary!(/// elementwise minimum; NaN wins, as in PyTorch
    Minimum, "minimum", "select({b}, {a}, {a} < {b} || isnan_({a}))" | "min({a}, {b})", Numeric,
    |a, b| if a < b || a.is_nan() { a } else { b }, int |a, b| if a < b { a } else { b };
    grad |a, b, y, g| split_ties(g, &a.lt(b)?, &a.eq(b)?, &b.lt(a)?));
binary!(/// logical and
    And, "logical_and", "({a} && {b})", Bool, |a, _b| a, bool |a, b| a & b;
    grad |a, b, y, g| Ok((g.zeros_like()?, g.zeros_like()?)));
binary!(/// logical or
    Or, "logical_or", "({a} || {b})", Bool, |a, _b| a, bool |a, b| a | b;
    grad |a, b, y, g| Ok((g.zeros_like()?, g.zeros_like()?)));

/// Maximum/minimum gradients: the winner takes the gradient, ties split it evenly (as PyTorch).
fn split_ties(g: &Tensor, a_wins: &Tensor, tie: &Tensor, b_wins: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = g.dtype();
    let half = tie.to_dtype(dt)?.mul(0.5)?;
    Ok((g.mul(&a_wins.to_dtype(dt)?.add(&half)?)?, g.mul(&b_wins.to_dtype(dt)?.add(&half)?)?))
}

/// Python-style integer remainder for i32 and u32 with no panics.
trait IntRem: Copy {
    fn rem_(self, b: Self) -> Self;
}
impl IntRem for i32 {
    fn rem_(self, b: i32) -> i32 {
        if b == 0 {
            return 0;
        }
        let r = self.wrapping_rem(b);
        if r != 0 && ((r < 0) != (b < 0)) {
            r + b
        } else {
            r
        }
    }
}
impl IntRem for u32 {
    fn rem_(self, b: u32) -> u32 {
        if b == 0 {
            0
        } else {
            self % b
        }
    }
}
#[inline(always)]
fn int_rem<T: IntRem>(a: T, b: T) -> T {
    a.rem_(b)
}

/// WGSL helper functions that the templates above call, by name. A kernel
/// includes the ones its body mentions. They exist where WGSL's built-in is
/// missing (erf, log1p, expm1), not precise enough on every driver (sin, cos
/// need range reduction; tanh overflows to NaN on some), or not defined where
/// PyTorch is (pow of a negative base, remainder's sign).
///
/// NaN is tested on the bits (`isnan_`), never as `x != x`: some drivers
/// (Mesa's NIR among them) fold `x != x` to false and `x - x` to 0.
pub const WGSL_HELPERS: &[(&str, &str)] = &[
    ("isnan_", "fn isnan_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }"),
    ("isinf_", "fn isinf_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u; }"),
    ("log1p_", "fn log1p_(x: f32) -> f32 {
    if (abs(x) < 0.5) {
        let s = x / (2.0 + x);
        let s2 = s * s;
        return 2.0 * s * (1.0 + s2 * (1.0 / 3.0 + s2 * (0.2 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0 + s2 * (1.0 / 11.0))))));
    }
    return log(1.0 + x);
}"),
    ("expm1_", "fn expm1_(x: f32) -> f32 {
    if (abs(x) < 1.0) {
        return x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (1.0 / 720.0
            + x * (1.0 / 5040.0 + x * (1.0 / 40320.0 + x * (1.0 / 362880.0 + x * (1.0 / 3628800.0))))))))));
    }
    return exp(x) - 1.0;
}"),
    ("tanh_", "fn tanh_(x: f32) -> f32 {
    let a = abs(x);
    var t: f32;
    if (a < 0.5) {
        let e = expm1_(2.0 * a);
        t = e / (e + 2.0);
    } else {
        t = 1.0 - 2.0 / (exp(2.0 * min(a, 20.0)) + 1.0);
    }
    return select(select(t, -t, x < 0.0), x, isnan_(x));
}"),
    ("sincos_", "fn sincos_(x: f32, want_cos: bool) -> f32 {
    // Cody-Waite reduction to [-pi/4, pi/4], then the cephes polynomials.
    let k = round(x * 0.63661977236758134);
    let r = ((x - k * 1.5703125) - k * 4.837512969970703125e-4) - k * 7.54978995489188216e-8;
    let z = r * r;
    let s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    var q = i32(k - 4.0 * floor(k * 0.25));
    if (want_cos) { q = q + 1; }
    var v: f32;
    switch (q & 3) {
        case 0: { v = s; }
        case 1: { v = c; }
        case 2: { v = -s; }
        default: { v = -c; }
    }
    // NaN and infinities give NaN.
    return select(v, bitcast<f32>(0x7fc00000u), isnan_(x) || isinf_(x));
}"),
    ("sin_", "fn sin_(x: f32) -> f32 { return sincos_(x, false); }"),
    ("cos_", "fn cos_(x: f32) -> f32 { return sincos_(x, true); }"),
    ("erf_", "fn erf_(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.5) {
        let z = x * x;
        return x * 1.1283791670955126 * (1.0 + z * (-1.0 / 3.0 + z * (0.1 + z * (-1.0 / 42.0 + z * (1.0 / 216.0 + z * (-1.0 / 1320.0))))));
    }
    // erfc by the Chebyshev fit of Numerical Recipes (relative error < 1.2e-7).
    let t = 1.0 / (1.0 + 0.5 * a);
    let e = t * exp(-a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))));
    return select(1.0 - e, e - 1.0, x < 0.0);
}"),
    ("pow_", "fn pow_(a: f32, b: f32) -> f32 {
    if (b == 0.0 || a == 1.0) { return 1.0; }
    if (isnan_(a) || isnan_(b)) { return bitcast<f32>(0x7fc00000u); }
    if (b == 1.0) { return a; }
    if (b == 2.0) { return a * a; }
    let m = abs(a);
    var r: f32;
    if (m == 0.0) {
        r = select(0.0, bitcast<f32>(0x7f800000u), b < 0.0);
    } else if (m == bitcast<f32>(0x7f800000u)) {
        r = select(m, 0.0, b < 0.0);
    } else {
        r = exp2(b * log2(m));
    }
    if (a < 0.0 || (a == 0.0 && bitcast<u32>(a) != 0u)) {
        if (floor(b) != b) {
            if (a == 0.0) { return r; }
            return bitcast<f32>(0x7fc00000u);
        }
        if (abs(b % 2.0) == 1.0) { r = -r; }
    }
    return r;
}"),
    ("rem_f32", "fn rem_f32(a: f32, b: f32) -> f32 {
    let r = a % b;
    if (r != 0.0 && ((r < 0.0) != (b < 0.0))) { return r + b; }
    return r;
}"),
    ("rem_i32", "fn rem_i32(a: i32, b: i32) -> i32 {
    if (b == 0) { return 0; }
    let r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) { return r + b; }
    return r;
}"),
    ("rem_u32", "fn rem_u32(a: u32, b: u32) -> u32 {
    if (b == 0u) { return 0u; }
    return a % b;
}"),
    ("bf16r_", "fn bf16r_(x: f32) -> f32 {
    // Round to bfloat16, nearest even, as `half` does; NaN stays a quiet NaN.
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) { return bitcast<f32>(b | 0x00400000u); }
    return bitcast<f32>((b + 0x7fffu + ((b >> 16u) & 1u)) & 0xffff0000u);
}"),
    ("f16r_", "fn f16r_(x: f32) -> f32 {
    // Round to IEEE half, nearest even, on the bits: some drivers drop an
    // f32 -> f16 -> f32 round trip as a no-op, which changes fused results.
    let b = bitcast<u32>(x);
    let a = b & 0x7fffffffu;
    let sign = b & 0x80000000u;
    if (a >= 0x7f800000u) { return x; }
    let e = a >> 23u;
    if (e >= 113u) {
        let r = (a + 0xfffu + ((a >> 13u) & 1u)) & 0xffffe000u;
        if (r > 0x477fe000u) { return bitcast<f32>(sign | 0x7f800000u); }
        return bitcast<f32>(sign | r);
    }
    // Below 2^-14 the half spacing is 2^-24: round m * 2^(e - 126) to an integer.
    if (e < 101u) { return bitcast<f32>(sign); }
    let m = (a & 0x7fffffu) | 0x800000u;
    let s = 126u - e;
    var q = m >> s;
    let rest = m & ((1u << s) - 1u);
    let half = 1u << (s - 1u);
    if (rest > half || (rest == half && (q & 1u) == 1u)) { q = q + 1u; }
    return bitcast<f32>(sign | bitcast<u32>(f32(q) * 5.9604644775390625e-8));
}"),
    ("f2i_", "fn f2i_(x: f32) -> i32 {
    // Rust `as`: saturate, NaN to 0.
    if (isnan_(x)) { return 0; }
    if (x >= 2147483648.0) { return 2147483647; }
    if (x <= -2147483648.0) { return -2147483647 - 1; }
    return i32(x);
}"),
    ("f2u_", "fn f2u_(x: f32) -> u32 {
    if (isnan_(x) || x <= 0.0) { return 0u; }
    if (x >= 4294967296.0) { return 4294967295u; }
    return u32(x);
}"),
];

macro_rules! op_enum {
    ($(#[$m:meta])* $Enum:ident : $Trait:ident { $($V:ident),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $Enum { $(
            #[doc = concat!("See [`", stringify!($V), "`].")]
            $V
        ),* }
        impl $Enum {
            /// Every op of this kind.
            pub const ALL: &'static [$Enum] = &[$($Enum::$V),*];
            /// Name used in errors and kernel names.
            pub fn name(self) -> &'static str {
                match self { $($Enum::$V => <$V as $Trait>::NAME),* }
            }
            /// WGSL expression template over f32.
            pub fn wgsl(self) -> &'static str {
                match self { $($Enum::$V => <$V as $Trait>::WGSL),* }
            }
            /// WGSL expression template over integers (`{T}`: `i32` or `u32`).
            pub fn wgsl_int(self) -> &'static str {
                match self { $($Enum::$V => <$V as $Trait>::WGSL_INT),* }
            }
            /// Accepted dtypes.
            pub fn domain(self) -> Domain {
                match self { $($Enum::$V => <$V as $Trait>::DOMAIN),* }
            }
        }
    };
}

op_enum!(
    /// The unary primitives.
    UnaryOp: UnaryKernel {
        Neg, Abs, Exp, Log, Log1p, Expm1, Sqrt, Rsqrt, Recip, Sin, Cos, Tanh, Sigmoid, Relu, Erf,
        Floor, Ceil, Round, Sign, Not,
    }
);
op_enum!(
    /// The binary primitives.
    BinaryOp: BinaryKernel { Add, Sub, Mul, Div, Pow, Rem, Maximum, Minimum, And, Or }
);

/// Dispatch a unary op to a generic function over its kernel type:
/// `with_unary!(op, K => expr using K)`.
macro_rules! with_unary {
    ($op:expr, $K:ident => $e:expr) => {{
        use $crate::op::*;
        match $op {
            UnaryOp::Neg => { type $K = Neg; $e }
            UnaryOp::Abs => { type $K = Abs; $e }
            UnaryOp::Exp => { type $K = Exp; $e }
            UnaryOp::Log => { type $K = Log; $e }
            UnaryOp::Log1p => { type $K = Log1p; $e }
            UnaryOp::Expm1 => { type $K = Expm1; $e }
            UnaryOp::Sqrt => { type $K = Sqrt; $e }
            UnaryOp::Rsqrt => { type $K = Rsqrt; $e }
            UnaryOp::Recip => { type $K = Recip; $e }
            UnaryOp::Sin => { type $K = Sin; $e }
            UnaryOp::Cos => { type $K = Cos; $e }
            UnaryOp::Tanh => { type $K = Tanh; $e }
            UnaryOp::Sigmoid => { type $K = Sigmoid; $e }
            UnaryOp::Relu => { type $K = Relu; $e }
            UnaryOp::Erf => { type $K = Erf; $e }
            UnaryOp::Floor => { type $K = Floor; $e }
            UnaryOp::Ceil => { type $K = Ceil; $e }
            UnaryOp::Round => { type $K = Round; $e }
            UnaryOp::Sign => { type $K = Sign; $e }
            UnaryOp::Not => { type $K = Not; $e }
        }
    }};
}
/// Dispatch a binary op to a generic function over its kernel type.
macro_rules! with_binary {
    ($op:expr, $K:ident => $e:expr) => {{
        use $crate::op::*;
        match $op {
            BinaryOp::Add => { type $K = Add; $e }
            BinaryOp::Sub => { type $K = Sub; $e }
            BinaryOp::Mul => { type $K = Mul; $e }
            BinaryOp::Div => { type $K = Div; $e }
            BinaryOp::Pow => { type $K = Pow; $e }
            BinaryOp::Rem => { type $K = Rem; $e }
            BinaryOp::Maximum => { type $K = Maximum; $e }
            BinaryOp::Minimum => { type $K = Minimum; $e }
            BinaryOp::And => { type $K = And; $e }
            BinaryOp::Or => { type $K = Or; $e }
        }
    }};
}
pub(crate) use with_binary;
pub(crate) use with_unary;

impl UnaryOp {
    /// The op's gradient (see [`UnaryKernel::grad`]).
    pub(crate) fn grad(self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
        with_unary!(self, K => K::grad(x, y, g))
    }
}

impl BinaryOp {
    /// The op's gradients (see [`BinaryKernel::grad`]).
    pub(crate) fn grad(self, a: &Tensor, b: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        with_binary!(self, K => K::grad(a, b, y, g))
    }
}

/// Comparisons; each gives a bool tensor. NaN compares as IEEE says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpOp {
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
}

impl CmpOp {
    /// Name used in errors and kernel names.
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }
    /// WGSL operator.
    pub fn wgsl(self) -> &'static str {
        match self {
            CmpOp::Eq => "==",
            CmpOp::Ne => "!=",
            CmpOp::Lt => "<",
            CmpOp::Le => "<=",
            CmpOp::Gt => ">",
            CmpOp::Ge => ">=",
        }
    }
    /// Apply to two values.
    #[inline(always)]
    pub fn apply<T: PartialOrd>(self, a: T, b: T) -> bool {
        match self {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        }
    }
}

/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (empty sum is 0).
    Sum,
    /// Product (empty product is 1).
    Prod,
    /// Maximum; NaN propagates. Empty input is an error.
    Max,
    /// Minimum; NaN propagates. Empty input is an error.
    Min,
    /// Index of the first maximum (NaN counts as the maximum), as i32.
    ArgMax,
    /// Index of the first minimum (NaN counts as the minimum), as i32.
    ArgMin,
}

impl ReduceOp {
    /// Name used in errors and kernel names.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }
    /// Whether the result is an index.
    pub fn is_arg(self) -> bool {
        matches!(self, ReduceOp::ArgMax | ReduceOp::ArgMin)
    }
}
