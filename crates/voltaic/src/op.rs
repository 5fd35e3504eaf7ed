//! The op table: every primitive elementwise and reduction op, defined once.
//!
//! Each op is a zero-sized type implementing [`UnaryKernel`] or
//! [`BinaryKernel`]: its name, the dtypes it accepts, its scalar kernel for
//! every compute type (the CPU executor turns these into vectorised loops)
//! and its WGSL fragment (the GPU code generator splices it into a fused
//! kernel). Composite ops (softmax, gelu, layer_norm, ...) are built from these
//! primitives in `ops/`.

use crate::cpu::fastmath;

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
    /// WGSL expression, `{x}` standing for the operand.
    const WGSL: &'static str;
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
}

/// A binary primitive over two operands of one dtype.
pub trait BinaryKernel {
    /// Name used in errors and kernel names.
    const NAME: &'static str;
    /// WGSL expression, `{a}` and `{b}` standing for the operands.
    const WGSL: &'static str;
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
}

macro_rules! unary {
    ($(#[$m:meta])* $T:ident, $name:literal, $wgsl:literal, $dom:ident,
     |$x:ident| $f32:expr, |$y:ident| $f64:expr $(, int |$i:ident| $int:expr)? $(, bool |$b:ident| $bool:expr)?) => {
        $(#[$m])*
        pub struct $T;
        impl UnaryKernel for $T {
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
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
    Neg, "neg", "(-{x})", Numeric, |x| -x, |x| -x, int |x| x.neg_());
unary!(/// `|x|`
    Abs, "abs", "abs({x})", Numeric, |x| x.abs(), |x| x.abs(), int |x| x.abs_());
unary!(/// `e^x`
    Exp, "exp", "exp({x})", Float, |x| fastmath::exp_f32(x), |x| x.exp());
unary!(/// natural logarithm
    Log, "log", "log({x})", Float, |x| x.ln(), |x| x.ln());
unary!(/// `ln(1 + x)`, accurate near 0
    Log1p, "log1p", "log1p_({x})", Float, |x| x.ln_1p(), |x| x.ln_1p());
unary!(/// `e^x - 1`, accurate near 0
    Expm1, "expm1", "expm1_({x})", Float, |x| x.exp_m1(), |x| x.exp_m1());
unary!(/// square root
    Sqrt, "sqrt", "sqrt({x})", Float, |x| x.sqrt(), |x| x.sqrt());
unary!(/// `1 / sqrt(x)`
    Rsqrt, "rsqrt", "inverseSqrt({x})", Float, |x| 1.0 / x.sqrt(), |x| 1.0 / x.sqrt());
unary!(/// `1 / x`
    Recip, "reciprocal", "(1.0 / {x})", Float, |x| 1.0 / x, |x| 1.0 / x);
unary!(/// sine
    Sin, "sin", "sin({x})", Float, |x| x.sin(), |x| x.sin());
unary!(/// cosine
    Cos, "cos", "cos({x})", Float, |x| x.cos(), |x| x.cos());
unary!(/// hyperbolic tangent
    Tanh, "tanh", "tanh({x})", Float, |x| x.tanh(), |x| x.tanh());
unary!(/// logistic sigmoid `1 / (1 + e^-x)`
    Sigmoid, "sigmoid", "(1.0 / (1.0 + exp(-{x})))", Float,
    |x| 1.0 / (1.0 + fastmath::exp_f32(-x)), |x| 1.0 / (1.0 + (-x).exp()));
unary!(/// `max(x, 0)`; NaN stays NaN as in PyTorch
    Relu, "relu", "select({x}, {x} * 0.0, {x} < 0.0)", Numeric,
    |x| if x < 0.0 { 0.0 } else { x }, |x| if x < 0.0 { 0.0 } else { x },
    int |x| if x < Default::default() { Default::default() } else { x });
unary!(/// the error function
    Erf, "erf", "erf_({x})", Float, |x| libm::erff(x), |x| libm::erf(x));
unary!(/// round down
    Floor, "floor", "floor({x})", Numeric, |x| x.floor(), |x| x.floor(), int |x| x);
unary!(/// round up
    Ceil, "ceil", "ceil({x})", Numeric, |x| x.ceil(), |x| x.ceil(), int |x| x);
unary!(/// round half to even, as PyTorch
    Round, "round", "round({x})", Numeric, |x| x.round_ties_even(), |x| x.round_ties_even(), int |x| x);
unary!(/// -1, 0 or 1 (NaN stays NaN)
    Sign, "sign", "sign({x})", Numeric,
    |x| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { x },
    |x| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { x },
    int |x| x.sign_());
unary!(/// logical not
    Not, "logical_not", "!({x})", Bool, |x| x, |x| x, bool |x| !x);

macro_rules! binary {
    ($(#[$m:meta])* $T:ident, $name:literal, $wgsl:literal, $dom:ident,
     |$a:ident, $b:ident| $float:expr $(, int |$ia:ident, $ib:ident| $int:expr)? $(, bool |$ba:ident, $bb:ident| $bool:expr)?) => {
        $(#[$m])*
        pub struct $T;
        impl BinaryKernel for $T {
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
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
    Add, "add", "({a} + {b})", Numeric, |a, b| a + b, int |a, b| a.wrapping_add(b));
binary!(/// `a - b` (integers wrap)
    Sub, "sub", "({a} - {b})", Numeric, |a, b| a - b, int |a, b| a.wrapping_sub(b));
binary!(/// `a * b` (integers wrap)
    Mul, "mul", "({a} * {b})", Numeric, |a, b| a * b, int |a, b| a.wrapping_mul(b));
binary!(/// true division (integers are promoted to f32 first, as PyTorch)
    Div, "div", "({a} / {b})", Float, |a, b| a / b);
binary!(/// `a ^ b`
    Pow, "pow", "pow_({a}, {b})", Float, |a, b| a.powf(b));
binary!(/// remainder with the sign of the divisor (PyTorch `remainder`, Python `%`);
    /// integer division by zero gives 0 instead of raising
    Rem, "remainder", "rem_({a}, {b})", Numeric,
    |a, b| { let r = a % b; if r != 0.0 && ((r < 0.0) != (b < 0.0)) { r + b } else { r } },
    int |a, b| int_rem(a, b));
binary!(/// elementwise maximum; NaN wins, as in PyTorch
    Maximum, "maximum", "max_({a}, {b})", Numeric,
    |a, b| if a > b || a != a { a } else { b }, int |a, b| if a > b { a } else { b });
binary!(/// elementwise minimum; NaN wins, as in PyTorch
    Minimum, "minimum", "min_({a}, {b})", Numeric,
    |a, b| if a < b || a != a { a } else { b }, int |a, b| if a < b { a } else { b });
binary!(/// logical and
    And, "logical_and", "({a} && {b})", Bool, |a, _b| a, bool |a, b| a & b);
binary!(/// logical or
    Or, "logical_or", "({a} || {b})", Bool, |a, _b| a, bool |a, b| a | b);

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
            /// WGSL expression template.
            pub fn wgsl(self) -> &'static str {
                match self { $($Enum::$V => <$V as $Trait>::WGSL),* }
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
