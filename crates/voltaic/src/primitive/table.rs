//! The tables of primitives: one entry per op, everything about it in one place.
//!
//! Each table is a macro that hands its entries to a callback macro, so every
//! layer expands the same entries for what it needs (an "X-macro"):
//! `primitive` generates the kernel types and enums, the CPU executor its
//! dispatch, `ops` the `Tensor` methods and the gradients. Adding an
//! elementwise op means adding one entry here; nothing else names it.
//!
//! An entry reads: doc comment, kernel type, `Tensor` method, name, domain,
//! gradient, then `{ wgsl: F32_TEMPLATE | INT_TEMPLATE, exact: true (when
//! the result is always a value of the operands' float type, so a half
//! type's result needs no rounding), f32/f64 (or float), int, bool kernels
//! }`. A gradient gets detached tensors: the inputs, the output `y` and
//! the output's gradient `g`, all of the output's shape; it is written
//! with tensor ops, so it is lazy and runs on any device. A
//! parameter the gradient does not read is named `_`, and that tensor is
//! then not kept for the backward pass: relu, sigmoid and tanh read their
//! output (as PyTorch's backward does), an add reads nothing, so the
//! pre-activation of `relu(x @ w + b)` need not be stored. Kernels
//! left out (`int`, `bool`) are never called: the domain keeps those dtypes
//! away. Items the expressions name are resolved where each table is
//! expanded, so they are written as methods or with full paths.

/// The unary primitives.
macro_rules! unary_table {
    ($cb:ident) => {
        $cb! {
            /// `-x`
            Neg neg "neg" Numeric |_, _, g| g.neg(); {
                wgsl: "(-{x})" | "({T}(0) - {x})", exact: true,
                f32: |x| -x, f64: |x| -x, int: |x| $crate::primitive::IntOps::neg_(x)
            }
            /// `|x|`
            Abs abs "abs" Numeric |x, _, g| g.mul(&x.sign()?); {
                wgsl: "abs({x})", exact: true,
                f32: |x| x.abs(), f64: |x| x.abs(), int: |x| $crate::primitive::IntOps::abs_(x)
            }
            /// `e^x`
            Exp exp "exp" Float |_, y, g| g.mul(y); {
                wgsl: "exp({x})",
                f32: |x| $crate::primitive::fastmath::exp_f32(x), f64: |x| x.exp()
            }
            /// natural logarithm
            Log log "log" Float |x, _, g| g.div(x); {
                wgsl: "log({x})",
                f32: |x| x.ln(), f64: |x| x.ln()
            }
            /// `ln(1 + x)`, accurate near 0
            Log1p log1p "log1p" Float |x, _, g| g.div(&x.add(1.0)?); {
                wgsl: "log1p_({x})",
                f32: |x| x.ln_1p(), f64: |x| x.ln_1p()
            }
            /// `e^x - 1`, accurate near 0
            Expm1 expm1 "expm1" Float |_, y, g| g.mul(&y.add(1.0)?); {
                wgsl: "expm1_({x})",
                f32: |x| x.exp_m1(), f64: |x| x.exp_m1()
            }
            /// square root
            Sqrt sqrt "sqrt" Float |_, y, g| g.div(&y.mul(2.0)?); {
                wgsl: "sqrt({x})",
                f32: |x| x.sqrt(), f64: |x| x.sqrt()
            }
            /// `1 / sqrt(x)`
            Rsqrt rsqrt "rsqrt" Float |_, y, g| g.mul(&y.mul(y)?.mul(y)?)?.mul(-0.5); {
                wgsl: "(1.0 / sqrt({x}))",
                f32: |x| 1.0 / x.sqrt(), f64: |x| 1.0 / x.sqrt()
            }
            /// `1 / x`
            Recip recip "reciprocal" Float |_, y, g| g.mul(&y.mul(y)?)?.neg(); {
                wgsl: "(1.0 / {x})",
                f32: |x| 1.0 / x, f64: |x| 1.0 / x
            }
            /// sine
            Sin sin "sin" Float |x, _, g| g.mul(&x.cos()?); {
                wgsl: "sin_({x})",
                f32: |x| x.sin(), f64: |x| x.sin()
            }
            /// cosine
            Cos cos "cos" Float |x, _, g| g.mul(&x.sin()?)?.neg(); {
                wgsl: "cos_({x})",
                f32: |x| x.cos(), f64: |x| x.cos()
            }
            /// hyperbolic tangent
            Tanh tanh "tanh" Float |_, y, g| g.mul(&y.mul(y)?.neg()?.add(1.0)?); {
                wgsl: "tanh_({x})",
                f32: |x| x.tanh(), f64: |x| x.tanh()
            }
            /// logistic sigmoid `1 / (1 + e^-x)`
            Sigmoid sigmoid "sigmoid" Float |_, y, g| g.mul(y)?.mul(&y.neg()?.add(1.0)?); {
                wgsl: "(1.0 / (1.0 + exp(-{x})))",
                f32: |x| 1.0 / (1.0 + $crate::primitive::fastmath::exp_f32(-x)), f64: |x| 1.0 / (1.0 + (-x).exp())
            }
            /// `max(x, 0)`; NaN stays NaN as in PyTorch (the WGSL tests NaN on
            /// the bits: some compilers turn the select into a NaN-dropping `max`)
            Relu relu "relu" Numeric |_, y, g| g.mul(&y.gt(0.0)?.to_dtype(g.dtype())?); {
                wgsl: "select(select({x}, 0.0, {x} < 0.0), {x}, isnan_({x}))" | "select({x}, {T}(0), {x} < {T}(0))", exact: true,
                f32: |x| if x < 0.0 { 0.0 } else { x }, f64: |x| if x < 0.0 { 0.0 } else { x },
                int: |x| if x < Default::default() { Default::default() } else { x }
            }
            /// the error function (one algorithm on every device: see `fastmath::erf_f32`)
            Erf erf "erf" Float |x, _, g| g.mul(&x.mul(x)?.neg()?.exp()?.mul(std::f64::consts::FRAC_2_SQRT_PI)?); {
                wgsl: "erf_({x})",
                f32: |x| $crate::primitive::fastmath::erf_f32(x), f64: |x| libm::erf(x)
            }
            /// round down
            Floor floor "floor" Numeric |_, _, g| g.zeros_like(); {
                wgsl: "floor({x})" | "{x}", exact: true,
                f32: |x| x.floor(), f64: |x| x.floor(), int: |x| x
            }
            /// round up
            Ceil ceil "ceil" Numeric |_, _, g| g.zeros_like(); {
                wgsl: "ceil({x})" | "{x}", exact: true,
                f32: |x| x.ceil(), f64: |x| x.ceil(), int: |x| x
            }
            /// round half to even, as PyTorch
            Round round "round" Numeric |_, _, g| g.zeros_like(); {
                wgsl: "round({x})" | "{x}", exact: true,
                f32: |x| x.round_ties_even(), f64: |x| x.round_ties_even(), int: |x| x
            }
            /// -1, 0 or 1 (NaN stays NaN)
            Sign sign "sign" Numeric |_, _, g| g.zeros_like(); {
                wgsl: "select(select(select({x}, -1.0, {x} < 0.0), 1.0, {x} > 0.0), {x}, isnan_({x}))"
                    | "select(select({x}, {T}(0) - {T}(1), {x} < {T}(0)), {T}(1), {x} > {T}(0))", exact: true,
                f32: |x| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { x },
                f64: |x| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { x },
                int: |x| $crate::primitive::IntOps::sign_(x)
            }
            /// 1 where `x` is infinite or NaN, else 0, in `x`'s float type: what
            /// `isfinite` and `isinf` are built on. The WGSL tests the bits, since
            /// GPU compilers may assume values are finite (and fold `x * 0` to 0
            /// or `x != x` to false).
            NonFinite nonfinite "nonfinite" Float |_, _, g| g.zeros_like(); {
                wgsl: "select(0.0, 1.0, isnan_({x}) || isinf_({x}))", exact: true,
                f32: |x| if x.is_finite() { 0.0 } else { 1.0 }, f64: |x| if x.is_finite() { 0.0 } else { 1.0 }
            }
            /// logical not (nonzero is true)
            Not logical_not "logical_not" Bool |_, _, g| g.zeros_like(); {
                wgsl: "!({x})", exact: true,
                f32: |x| x, f64: |x| x, bool: |x| !x
            }
        }
    };
}

/// The binary primitives. Operands arrive broadcast to the output's shape
/// and converted to one dtype.
macro_rules! binary_table {
    ($cb:ident) => {
        $cb! {
            /// `a + b` with broadcasting (integers wrap)
            Add add "add" Numeric |_, _, _, g| Ok((g.clone(), g.clone())); {
                wgsl: "({a} + {b})",
                float: |a, b| a + b, int: |a, b| a.wrapping_add(b)
            }
            /// `a - b` with broadcasting (integers wrap)
            Sub sub "sub" Numeric |_, _, _, g| Ok((g.clone(), g.neg()?)); {
                wgsl: "({a} - {b})",
                float: |a, b| a - b, int: |a, b| a.wrapping_sub(b)
            }
            /// `a * b` with broadcasting (integers wrap)
            Mul mul "mul" Numeric |a, b, _, g| Ok((g.mul(b)?, g.mul(a)?)); {
                wgsl: "({a} * {b})",
                float: |a, b| a * b, int: |a, b| a.wrapping_mul(b)
            }
            /// true division `a / b` (integers are promoted to f32 first, as PyTorch)
            Div div "div" Float |_, b, y, g| Ok((g.div(b)?, g.mul(y)?.div(b)?.neg()?)); {
                wgsl: "({a} / {b})",
                float: |a, b| a / b
            }
            /// `a ^ b`
            /// `a ^ b`; integers stay integers (wrapping; a negative exponent
            /// gives 0 except for bases 1 and -1), as PyTorch
            Pow pow "pow" Numeric |a, b, y, g| Ok((
                // PyTorch's masks: d/da is 0 where b = 0 (even at a = 0), and
                // d/db is 0 where a = 0 and b >= 0.
                b.eq(0.0)?.where_cond(0.0, &g.mul(b)?.mul(&a.pow(&b.sub(1.0)?)?)?)?,
                a.eq(0.0)?.logical_and(&b.ge(0.0)?)?.where_cond(0.0, &g.mul(y)?.mul(&a.log()?)?)?,
            )); {
                wgsl: "pow_({a}, {b})" | "pow_{T}({a}, {b})",
                float: |a, b| a.powf(b), int: |a, b| $crate::primitive::IntOps::pow_(a, b)
            }
            /// remainder with the sign of the divisor (PyTorch `remainder`,
            /// Python `%`); integer division by zero gives 0 instead of raising
            Rem rem "remainder" Numeric |a, b, _, g| Ok((g.clone(), g.mul(&a.div(b)?.floor()?)?.neg()?)); {
                wgsl: "rem_f32({a}, {b})" | "rem_{T}({a}, {b})",
                float: |a, b| { let r = a % b; if r != 0.0 && ((r < 0.0) != (b < 0.0)) { r + b } else { r } },
                int: |a, b| $crate::primitive::IntOps::rem_(a, b)
            }
            /// elementwise maximum; NaN wins, as in PyTorch
            Maximum maximum "maximum" Numeric |a, b, _, g| g.split_ties(&a.gt(b)?, &a.eq(b)?, &b.gt(a)?); {
                // NaN tested on each operand apart: NVIDIA's compiler turned the
                // one-select form into a NaN-dropping max (seen on the H100, bf16).
                wgsl: "select(select(select({b}, {a}, {a} > {b}), {b}, isnan_({b})), {a}, isnan_({a}))" | "max({a}, {b})", exact: true,
                float: |a, b| if a > b || a.is_nan() { a } else { b }, int: |a, b| if a > b { a } else { b }
            }
            /// elementwise minimum; NaN wins, as in PyTorch
            Minimum minimum "minimum" Numeric |a, b, _, g| g.split_ties(&a.lt(b)?, &a.eq(b)?, &b.lt(a)?); {
                wgsl: "select(select(select({b}, {a}, {a} < {b}), {b}, isnan_({b})), {a}, isnan_({a}))" | "min({a}, {b})", exact: true,
                float: |a, b| if a < b || a.is_nan() { a } else { b }, int: |a, b| if a < b { a } else { b }
            }
            /// logical and (nonzero is true)
            And logical_and "logical_and" Bool |_, _, _, g| Ok((g.zeros_like()?, g.zeros_like()?)); {
                wgsl: "({a} && {b})", exact: true,
                float: |a, b| a, bool: |a, b| a & b
            }
            /// logical or (nonzero is true)
            Or logical_or "logical_or" Bool |_, _, _, g| Ok((g.zeros_like()?, g.zeros_like()?)); {
                wgsl: "({a} || {b})", exact: true,
                float: |a, b| a, bool: |a, b| a | b
            }
        }
    };
}

/// The comparisons: variant, `Tensor` method, name, WGSL operator.
macro_rules! cmp_table {
    ($cb:ident) => {
        $cb! {
            /// `a == b`
            Eq eq "eq" "==";
            /// `a != b`
            Ne ne "ne" "!=";
            /// `a < b`
            Lt lt "lt" "<";
            /// `a <= b`
            Le le "le" "<=";
            /// `a > b`
            Gt gt "gt" ">";
            /// `a >= b`
            Ge ge "ge" ">=";
        }
    };
}

/// The reductions: variant, name, identity, the binary primitive that folds
/// two partial results (the one definition both executors use), whether the
/// result is the index of the winner, and the gradient. The gradient gets
/// the input `x`, the output `y` and its gradient `g` broadcast to `x`'s
/// shape, and the reduced axes.
macro_rules! reduce_table {
    ($cb:ident) => {
        $cb! {
            /// Sum (empty sum is 0).
            Sum "sum" 0.0, Add, false, |x, y, g, axes| Ok(g.clone());
            /// Product (empty product is 1).
            Prod "prod" 1.0, Mul, false, |x, y, g, axes| x.prod_grad(y, g, axes);
            /// Maximum; NaN propagates. Empty input is an error. Ties share the gradient.
            Max "max" f64::NEG_INFINITY, Maximum, false, |x, y, g, axes| x.extreme_grad(y, g, axes);
            /// Minimum; NaN propagates. Empty input is an error.
            Min "min" f64::INFINITY, Minimum, false, |x, y, g, axes| x.extreme_grad(y, g, axes);
            /// Index of the first maximum (NaN counts as the maximum), as i32.
            ArgMax "argmax" f64::NEG_INFINITY, Maximum, true, |x, y, g, axes| g.zeros_like();
            /// Index of the first minimum (NaN counts as the minimum), as i32.
            ArgMin "argmin" f64::INFINITY, Minimum, true, |x, y, g, axes| g.zeros_like();
        }
    };
}

pub(crate) use {binary_table, cmp_table, reduce_table, unary_table};
