//! Elementwise op values against naive f64 references written here: unary
//! primitives and activations, broadcasting binary ops, comparisons, `where`,
//! `masked_fill`, casts, dtype promotion, scalar operands and edge cases.

mod common;

use common::*;
use voltaic::{DType, Device, Tensor};

type Res = voltaic::Result<()>;
type UnaryFn = fn(&Tensor) -> voltaic::Result<Tensor>;
type UnaryCase = (&'static str, UnaryFn, fn(f64) -> f64, Dom);

const CPU: Device = Device::Cpu;

/// Input domains for the unary reference checks.
#[derive(Clone, Copy)]
enum Dom {
    /// `3 * randn`
    Any,
    /// Strictly positive.
    Pos,
    /// Greater than -1 (log1p).
    GtM1,
    /// Away from zero (recip).
    NonZero,
    /// Multiples of 1/4 (exact ties for rounding, exact zeros for sign).
    Quarters,
}

fn apply_dom(d: Dom, x: f64) -> f64 {
    match d {
        Dom::Any => 3.0 * x,
        Dom::Pos => x.abs() * 2.0 + 0.05,
        Dom::GtM1 => x.abs() * 2.0 - 0.95,
        Dom::NonZero => x + 0.25 * x.signum(),
        Dom::Quarters => (x * 12.0).round() / 4.0,
    }
}

fn sigmoid_ref(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}
fn softplus_ref(x: f64) -> f64 {
    // ln(1 + e^x), written so neither branch loses precision.
    if x > 0.0 {
        x + (-x).exp().ln_1p()
    } else {
        x.exp().ln_1p()
    }
}
fn round_half_even_ref(x: f64) -> f64 {
    let f = x.floor();
    let d = x - f;
    if d < 0.5 {
        f
    } else if d > 0.5 {
        f + 1.0
    } else if f % 2.0 == 0.0 {
        f
    } else {
        f + 1.0
    }
}

fn unary_table() -> Vec<UnaryCase> {
    vec![
        ("neg", |t| t.neg(), |x| -x, Dom::Any),
        ("abs", |t| t.abs(), |x| if x < 0.0 { -x } else { x }, Dom::Any),
        ("exp", |t| t.exp(), |x| x.exp(), Dom::Any),
        ("log", |t| t.log(), |x| x.ln(), Dom::Pos),
        ("log1p", |t| t.log1p(), |x| x.ln_1p(), Dom::GtM1),
        ("expm1", |t| t.expm1(), |x| x.exp_m1(), Dom::Any),
        ("sqrt", |t| t.sqrt(), |x| x.sqrt(), Dom::Pos),
        ("rsqrt", |t| t.rsqrt(), |x| 1.0 / x.sqrt(), Dom::Pos),
        ("recip", |t| t.recip(), |x| 1.0 / x, Dom::NonZero),
        ("sin", |t| t.sin(), |x| x.sin(), Dom::Any),
        ("cos", |t| t.cos(), |x| x.cos(), Dom::Any),
        ("tanh", |t| t.tanh(), |x| x.tanh(), Dom::Any),
        ("sigmoid", |t| t.sigmoid(), sigmoid_ref, Dom::Any),
        ("relu", |t| t.relu(), |x| if x > 0.0 { x } else { 0.0 }, Dom::Any),
        ("erf", |t| t.erf(), erf_ref, Dom::Any),
        ("floor", |t| t.floor(), |x| x.floor(), Dom::Quarters),
        ("ceil", |t| t.ceil(), |x| x.ceil(), Dom::Quarters),
        ("round", |t| t.round(), round_half_even_ref, Dom::Quarters),
        (
            "sign",
            |t| t.sign(),
            |x| {
                if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    0.0
                }
            },
            Dom::Quarters,
        ),
        ("leaky_relu(0.01)", |t| t.leaky_relu(0.01), |x| if x > 0.0 { x } else { 0.01 * x }, Dom::Any),
        ("leaky_relu(0.2)", |t| t.leaky_relu(0.2), |x| if x > 0.0 { x } else { 0.2 * x }, Dom::Any),
        ("gelu", |t| t.gelu(), |x| 0.5 * x * (1.0 + erf_ref(x / 2f64.sqrt())), Dom::Any),
        (
            "gelu_tanh",
            |t| t.gelu_tanh(),
            |x| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()),
            Dom::Any,
        ),
        ("silu", |t| t.silu(), |x| x * sigmoid_ref(x), Dom::Any),
        ("softplus", |t| t.softplus(), softplus_ref, Dom::Any),
        ("clamp(-0.5, 0.7)", |t| t.clamp(Some(-0.5), Some(0.7)), |x| x.clamp(-0.5, 0.7), Dom::Any),
        ("clamp(None, 0.3)", |t| t.clamp(None, Some(0.3)), |x| x.min(0.3), Dom::Any),
        ("clamp(-0.2, None)", |t| t.clamp(Some(-0.2), None), |x| x.max(-0.2), Dom::Any),
    ]
}

#[test]
fn unary_float_ops_match_reference() -> Res {
    let mut rng = Rng::new(1);
    let mut shapes: Vec<Vec<usize>> = vec![vec![1031], vec![], vec![0], vec![3, 0, 2], vec![1, 1]];
    for _ in 0..6 {
        shapes.push(rng.shape(4, 1500));
    }
    for dtype in [DType::F32, DType::F64] {
        for dims in &shapes {
            let (_, base) = randn(dims, DType::F64);
            for (name, f, r, dom) in unary_table() {
                let (x, xs) = tensor(&base.iter().map(|&v| apply_dom(dom, v)).collect::<Vec<_>>(), dims, dtype);
                let y = f(&x)?;
                assert_eq!(y.dims(), &dims[..], "{name} shape");
                assert_eq!(y.dtype(), dtype, "{name} dtype");
                let got = y.to_f64_vec()?;
                assert_eq!(got.len(), xs.len());
                for (i, (&g, &xv)) in got.iter().zip(&xs).enumerate() {
                    let w = r(xv);
                    // f32: the output rounding plus a few ulps of the kernel,
                    // with an absolute part growing with |x| for composite ops.
                    let tol = match dtype {
                        DType::F32 => 1e-5 * w.abs() + 1e-6 * (1.0 + xv.abs()),
                        _ => 1e-12 * w.abs() + 1e-13 * (1.0 + xv.abs()),
                    };
                    assert!(
                        (g - w).abs() <= tol || (g.is_nan() && w.is_nan()),
                        "{name} {dtype} {dims:?} element {i}: f({xv}) = {g}, expected {w}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn unary_special_values() -> Res {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let x = [nan, inf, -inf, 0.0, -0.0, 2.5, -2.5, 0.5, -0.5, 1.5];
    let cases: Vec<(&str, UnaryFn, [f64; 10])> = vec![
        ("exp", |t| t.exp(), [nan, inf, 0.0, 1.0, 1.0, 2.5f64.exp(), (-2.5f64).exp(), 0.5f64.exp(), (-0.5f64).exp(), 1.5f64.exp()]),
        ("log", |t| t.log(), [nan, inf, nan, -inf, -inf, 2.5f64.ln(), nan, 0.5f64.ln(), nan, 1.5f64.ln()]),
        ("sqrt", |t| t.sqrt(), [nan, inf, nan, 0.0, 0.0, 2.5f64.sqrt(), nan, 0.5f64.sqrt(), nan, 1.5f64.sqrt()]),
        ("recip", |t| t.recip(), [nan, 0.0, 0.0, inf, -inf, 0.4, -0.4, 2.0, -2.0, 1.0 / 1.5]),
        ("rsqrt", |t| t.rsqrt(), [nan, 0.0, nan, inf, -inf, 1.0 / 2.5f64.sqrt(), nan, 2f64.sqrt(), nan, 1.0 / 1.5f64.sqrt()]),
        ("tanh", |t| t.tanh(), [nan, 1.0, -1.0, 0.0, 0.0, 2.5f64.tanh(), (-2.5f64).tanh(), 0.5f64.tanh(), (-0.5f64).tanh(), 1.5f64.tanh()]),
        (
            "sigmoid",
            |t| t.sigmoid(),
            [nan, 1.0, 0.0, 0.5, 0.5, sigmoid_ref(2.5), sigmoid_ref(-2.5), sigmoid_ref(0.5), sigmoid_ref(-0.5), sigmoid_ref(1.5)],
        ),
        ("erf", |t| t.erf(), [nan, 1.0, -1.0, 0.0, 0.0, erf_ref(2.5), erf_ref(-2.5), erf_ref(0.5), erf_ref(-0.5), erf_ref(1.5)]),
        (
            "expm1",
            |t| t.expm1(),
            [nan, inf, -1.0, 0.0, 0.0, 2.5f64.exp_m1(), (-2.5f64).exp_m1(), 0.5f64.exp_m1(), (-0.5f64).exp_m1(), 1.5f64.exp_m1()],
        ),
        ("log1p", |t| t.log1p(), [nan, inf, nan, 0.0, 0.0, 2.5f64.ln_1p(), nan, 0.5f64.ln_1p(), (-0.5f64).ln_1p(), 1.5f64.ln_1p()]),
        ("relu", |t| t.relu(), [nan, inf, 0.0, 0.0, 0.0, 2.5, 0.0, 0.5, 0.0, 1.5]),
        ("abs", |t| t.abs(), [nan, inf, inf, 0.0, 0.0, 2.5, 2.5, 0.5, 0.5, 1.5]),
        ("neg", |t| t.neg(), [nan, -inf, inf, 0.0, 0.0, -2.5, 2.5, -0.5, 0.5, -1.5]),
        ("sign", |t| t.sign(), [nan, 1.0, -1.0, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0, 1.0]),
        ("floor", |t| t.floor(), [nan, inf, -inf, 0.0, 0.0, 2.0, -3.0, 0.0, -1.0, 1.0]),
        ("ceil", |t| t.ceil(), [nan, inf, -inf, 0.0, 0.0, 3.0, -2.0, 1.0, 0.0, 2.0]),
        ("round", |t| t.round(), [nan, inf, -inf, 0.0, 0.0, 2.0, -2.0, 0.0, 0.0, 2.0]),
        (
            "softplus",
            |t| t.softplus(),
            [
                nan,
                inf,
                0.0,
                2f64.ln(),
                2f64.ln(),
                softplus_ref(2.5),
                softplus_ref(-2.5),
                softplus_ref(0.5),
                softplus_ref(-0.5),
                softplus_ref(1.5),
            ],
        ),
        ("clamp(-1, 1)", |t| t.clamp(Some(-1.0), Some(1.0)), [nan, 1.0, -1.0, 0.0, 0.0, 1.0, -1.0, 0.5, -0.5, 1.0]),
        ("leaky_relu", |t| t.leaky_relu(0.1), [nan, inf, -inf, 0.0, 0.0, 2.5, -0.25, 0.5, -0.05, 1.5]),
        ("nonfinite", |t| t.nonfinite(), [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        ("isfinite", |t| t.isfinite(), [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("isinf", |t| t.isinf(), [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        ("isnan", |t| t.isnan(), [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
    ];
    for dtype in [DType::F32, DType::F64] {
        let (t, _) = tensor(&x, &[10], dtype);
        for (name, f, want) in &cases {
            let got = f(&t)?.to_f64_vec()?;
            let want: Vec<f64> = want.iter().map(|&w| round_to(w, dtype)).collect();
            let (rt, at) = tol(dtype);
            assert_close(&got, &want, rt, at, &format!("{name} {dtype} of {x:?}"));
        }
    }
    // The float tests give bools; integers and bools are always finite.
    let (t, _) = tensor(&x, &[10], DType::F32);
    assert_eq!(t.isfinite()?.dtype(), DType::Bool);
    assert_eq!(t.nonfinite()?.dtype(), DType::F32);
    let ints = Tensor::from_vec(vec![i32::MIN, 0, i32::MAX], &[3], CPU)?;
    assert_eq!(ints.isfinite()?.to_vec::<bool>()?, vec![true; 3]);
    assert_eq!(ints.isinf()?.to_vec::<bool>()?, vec![false; 3]);
    assert_eq!(ints.isnan()?.to_vec::<bool>()?, vec![false; 3]);
    // The sign of zero where it is well defined.
    let (t, _) = tensor(&[0.0, -0.0], &[2], DType::F32);
    let r = t.recip()?.to_vec::<f32>()?;
    assert_eq!(r, vec![f32::INFINITY, f32::NEG_INFINITY]);
    let a = t.abs()?.to_vec::<f32>()?;
    assert!(a.iter().all(|v| *v == 0.0 && v.is_sign_positive()), "abs(-0) = {a:?}");
    Ok(())
}

#[test]
fn unary_integer_ops_keep_dtype_and_wrap() -> Res {
    let iv = [i32::MIN, i32::MIN + 1, -7, -1, 0, 1, 7, i32::MAX];
    let x = Tensor::from_vec(iv.to_vec(), &[8], CPU)?;
    let neg: Vec<i32> = iv.iter().map(|v| v.wrapping_neg()).collect();
    let abs: Vec<i32> = iv.iter().map(|v| if *v < 0 { v.wrapping_neg() } else { *v }).collect();
    let sign: Vec<i32> = iv
        .iter()
        .map(|v| {
            if *v > 0 {
                1
            } else if *v < 0 {
                -1
            } else {
                0
            }
        })
        .collect();
    let relu: Vec<i32> = iv.iter().map(|v| if *v > 0 { *v } else { 0 }).collect();
    assert_eq!(x.neg()?.dtype(), DType::I32);
    assert_eq!(x.neg()?.to_vec::<i32>()?, neg);
    assert_eq!(x.abs()?.to_vec::<i32>()?, abs);
    assert_eq!(x.sign()?.to_vec::<i32>()?, sign);
    assert_eq!(x.relu()?.to_vec::<i32>()?, relu);
    for f in [Tensor::floor, Tensor::ceil, Tensor::round] {
        let y = f(&x)?;
        assert_eq!(y.dtype(), DType::I32);
        assert_eq!(y.to_vec::<i32>()?, iv.to_vec());
    }

    let uv = [0u32, 1, 7, u32::MAX - 1, u32::MAX];
    let u = Tensor::from_vec(uv.to_vec(), &[5], CPU)?;
    assert_eq!(u.neg()?.to_vec::<u32>()?, uv.iter().map(|v| 0u32.wrapping_sub(*v)).collect::<Vec<_>>());
    assert_eq!(u.abs()?.to_vec::<u32>()?, uv.to_vec());
    assert_eq!(u.sign()?.to_vec::<u32>()?, vec![0, 1, 1, 1, 1]);
    assert_eq!(u.relu()?.to_vec::<u32>()?, uv.to_vec());

    // Float-domain ops promote integers (and bool) to f32, as PyTorch.
    let small = Tensor::from_vec(vec![-2i32, 0, 1, 3], &[4], CPU)?;
    let e = small.exp()?;
    assert_eq!(e.dtype(), DType::F32);
    assert_close(&e.to_f64_vec()?, &[-2f64, 0.0, 1.0, 3.0].map(|v: f64| v.exp()), 1e-6, 0.0, "exp of i32");
    let s = small.sqrt()?;
    assert_eq!(s.dtype(), DType::F32);
    assert_close(&s.to_f64_vec()?, &[f64::NAN, 0.0, 1.0, 3f64.sqrt()], 1e-6, 0.0, "sqrt of i32");
    let float_ops: [(&str, UnaryFn); 4] =
        [("gelu", Tensor::gelu), ("silu", Tensor::silu), ("softplus", Tensor::softplus), ("sigmoid", Tensor::sigmoid)];
    for (name, f) in float_ops {
        assert_eq!(f(&small)?.dtype(), DType::F32, "{name} of i32");
    }
    assert_eq!(small.leaky_relu(0.5)?.to_vec::<f32>()?, vec![-1.0, 0.0, 1.0, 3.0]);
    let b = Tensor::from_vec(vec![true, false], &[2], CPU)?;
    let be = b.exp()?;
    assert_eq!(be.dtype(), DType::F32);
    assert_close(&be.to_f64_vec()?, &[std::f64::consts::E, 1.0], 1e-6, 0.0, "exp of bool");

    // Numeric ops refuse bool, as PyTorch's neg does.
    assert!(b.neg().is_err());
    Ok(())
}

#[test]
fn logical_ops_treat_nonzero_as_true() -> Res {
    let fv = [0.0, -0.0, 1.0, -2.5, f64::NAN, 0.0];
    let gv = [0.0, 3.0, 0.0, 1.0, 0.0, f64::NAN];
    let (f, _) = tensor(&fv, &[6], DType::F32);
    let (g, _) = tensor(&gv, &[6], DType::F64);
    let truth = |v: f64| v != 0.0;
    let not = f.logical_not()?;
    assert_eq!(not.dtype(), DType::Bool);
    assert_eq!(not.to_vec::<bool>()?, fv.iter().map(|&v| !truth(v)).collect::<Vec<_>>());
    let and = f.logical_and(&g)?;
    let or = f.logical_or(&g)?;
    assert_eq!(and.dtype(), DType::Bool);
    assert_eq!(and.to_vec::<bool>()?, fv.iter().zip(&gv).map(|(&a, &b)| truth(a) && truth(b)).collect::<Vec<_>>());
    assert_eq!(or.to_vec::<bool>()?, fv.iter().zip(&gv).map(|(&a, &b)| truth(a) || truth(b)).collect::<Vec<_>>());

    // Integers and bools, with broadcasting [3, 1] x [4].
    let a = Tensor::from_vec(vec![0i32, -3, 5], &[3, 1], CPU)?;
    let b = Tensor::from_vec(vec![true, false, true, false], &[4], CPU)?;
    let and = a.logical_and(&b)?;
    let or = a.logical_or(&b)?;
    assert_eq!(and.dims(), &[3, 4]);
    let (av, bv) = ([0, -3, 5], [true, false, true, false]);
    let mut want_and = vec![];
    let mut want_or = vec![];
    for &x in &av {
        for &y in &bv {
            want_and.push(x != 0 && y);
            want_or.push(x != 0 || y);
        }
    }
    assert_eq!(and.to_vec::<bool>()?, want_and);
    assert_eq!(or.to_vec::<bool>()?, want_or);
    let u = Tensor::from_vec(vec![0u32, 2, 0, 4000000000], &[4], CPU)?;
    assert_eq!(u.logical_not()?.to_vec::<bool>()?, vec![true, false, true, false]);
    assert_eq!(b.logical_not()?.to_vec::<bool>()?, vec![false, true, false, true]);
    Ok(())
}

/// Two shapes that broadcast together: each a copy of a common shape with some
/// dims set to 1 and perhaps some leading dims dropped.
fn bcast_pair(rng: &mut Rng) -> (Vec<usize>, Vec<usize>) {
    let out = rng.shape(4, 1200);
    let make = |rng: &mut Rng| {
        let mut s: Vec<usize> = out.iter().map(|&d| if rng.below(3) == 0 { 1 } else { d }).collect();
        let drop = rng.below(s.len() + 1);
        if rng.below(2) == 0 {
            s.drain(..drop);
        }
        s
    };
    let a = make(rng);
    let b = make(rng);
    (a, b)
}

/// `op(a, b)` elementwise over the broadcast shape, naively.
fn bcast_ref(a: &[f64], ad: &[usize], b: &[f64], bd: &[usize], f: impl Fn(f64, f64) -> f64) -> (Vec<usize>, Vec<f64>) {
    let od = bcast_shape(ad, bd).expect("broadcastable");
    let out = (0..numel(&od))
        .map(|i| {
            let idx = unravel(i, &od);
            f(a[bcast_pos(&idx, ad)], b[bcast_pos(&idx, bd)])
        })
        .collect();
    (od, out)
}

type BinFn = fn(&Tensor, &Tensor) -> voltaic::Result<Tensor>;
type BinCase = (&'static str, BinFn, fn(f64, f64) -> f64);

fn python_rem(a: f64, b: f64) -> f64 {
    a - b * (a / b).floor()
}

#[test]
fn binary_float_ops_broadcast_match_reference() -> Res {
    let mut rng = Rng::new(2);
    let ops: Vec<BinCase> = vec![
        ("add", |a, b| a.add(b), |a, b| a + b),
        ("sub", |a, b| a.sub(b), |a, b| a - b),
        ("mul", |a, b| a.mul(b), |a, b| a * b),
        ("div", |a, b| a.div(b), |a, b| a / b),
        ("pow", |a, b| a.pow(b), |a, b| a.powf(b)),
        ("rem", |a, b| a.rem(b), python_rem),
        ("maximum", |a, b| a.maximum(b), |a, b| if a >= b { a } else { b }),
        ("minimum", |a, b| a.minimum(b), |a, b| if a <= b { a } else { b }),
    ];
    let mut pairs = vec![(vec![3, 1, 5], vec![4, 1]), (vec![7], vec![1031, 1]), (vec![], vec![2, 3]), (vec![0, 3], vec![1, 3])];
    for _ in 0..10 {
        pairs.push(bcast_pair(&mut rng));
    }
    for dtype in [DType::F32, DType::F64] {
        for (ad, bd) in &pairs {
            let (_, araw) = randn(ad, DType::F64);
            let (_, braw) = randn(bd, DType::F64);
            for (name, f, r) in &ops {
                // Keep divisors away from zero and bases of pow positive.
                let am: Vec<f64> = araw.iter().map(|&v| if *name == "pow" { v.abs() * 1.5 + 0.1 } else { 3.0 * v }).collect();
                let bm: Vec<f64> = braw.iter().map(|&v| if matches!(*name, "div" | "rem") { v + 0.5 * v.signum() } else { v }).collect();
                let (a, av) = tensor(&am, ad, dtype);
                let (b, bv) = tensor(&bm, bd, dtype);
                let y = f(&a, &b)?;
                let (od, want) = bcast_ref(&av, ad, &bv, bd, r);
                assert_eq!(y.dims(), &od[..], "{name} {ad:?} {bd:?}");
                assert_eq!(y.dtype(), dtype);
                let got = y.to_f64_vec()?;
                let (rt, at) = tol(dtype);
                // rem rounds r + b in the output type: allow that relative to |b|.
                if *name == "rem" {
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let bval = bv[bcast_pos(&unravel(i, &od), bd)];
                        assert!((g - w).abs() <= rt * bval.abs() + at, "rem {dtype} {ad:?} {bd:?} element {i}: {g} vs {w}");
                        assert!(g == 0.0 || (g < 0.0) == (bval < 0.0), "rem result {g} must take the divisor's sign ({bval})");
                    }
                } else {
                    assert_close(&got, &want, rt, at, &format!("{name} {dtype} {ad:?} {bd:?}"));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn broadcasting_shapes() -> Res {
    // [3, 1, 5] with [4, 1] gives [3, 4, 5], in both orders.
    let av: Vec<f64> = (0..15).map(|i| i as f64).collect();
    let bv: Vec<f64> = (0..4).map(|i| 100.0 * i as f64).collect();
    let (a, _) = tensor(&av, &[3, 1, 5], DType::F32);
    let (b, _) = tensor(&bv, &[4, 1], DType::F32);
    let ab = a.add(&b)?;
    let ba = b.sub(&a)?;
    assert_eq!(ab.dims(), &[3, 4, 5]);
    assert_eq!(ba.dims(), &[3, 4, 5]);
    let mut want_ab = vec![];
    let mut want_ba = vec![];
    for i in 0..3 {
        for &bj in &bv {
            for k in 0..5 {
                want_ab.push(av[i * 5 + k] + bj);
                want_ba.push(bj - av[i * 5 + k]);
            }
        }
    }
    assert_same(&ab.to_f64_vec()?, &want_ab, "[3,1,5] + [4,1]");
    assert_same(&ba.to_f64_vec()?, &want_ba, "[4,1] - [3,1,5]");

    // 0-d tensors broadcast anywhere; size-0 dims broadcast with 1.
    let s = Tensor::scalar(2.5f32, CPU)?;
    assert_same(&a.mul(&s)?.to_f64_vec()?, &av.iter().map(|v| v * 2.5).collect::<Vec<_>>(), "[3,1,5] * 0-d");
    assert_eq!(s.mul(&s)?.dims(), &[] as &[usize]);
    assert_eq!(s.mul(&s)?.item::<f32>()?, 6.25);
    let e = Tensor::zeros(&[0, 3], DType::F32, CPU)?;
    let r = Tensor::ones(&[1, 3], DType::F32, CPU)?;
    assert_eq!(e.add(&r)?.dims(), &[0, 3]);
    assert_eq!(r.add(&e)?.to_f64_vec()?, Vec::<f64>::new());
    let e2 = Tensor::zeros(&[2, 0], DType::F32, CPU)?;
    assert_eq!(e2.mul(&Tensor::ones(&[2, 1], DType::F32, CPU)?)?.dims(), &[2, 0]);
    assert_eq!(Tensor::zeros(&[0], DType::F32, CPU)?.add(&s)?.dims(), &[0]);

    // Incompatible shapes are shape errors, naming both shapes.
    let err = a.add(&Tensor::ones(&[2, 4], DType::F32, CPU)?).unwrap_err();
    assert!(err.is_shape(), "{err}");
    assert!(err.to_string().contains("[3, 1, 5]") && err.to_string().contains("[2, 4]"), "{err}");
    assert!(Tensor::ones(&[0], DType::F32, CPU)?.add(&Tensor::ones(&[2], DType::F32, CPU)?).is_err());
    assert!(Tensor::ones(&[3, 2], DType::F32, CPU)?.lt(&Tensor::ones(&[4, 2], DType::F32, CPU)?).is_err());
    Ok(())
}

/// Random i32 values over the whole range, with the edge values mixed in.
fn wide_i32(rng: &mut Rng, n: usize) -> Vec<i32> {
    let edges = [i32::MIN, i32::MIN + 1, -1, 0, 1, i32::MAX - 1, i32::MAX];
    (0..n).map(|i| if i % 5 == 0 { edges[rng.below(edges.len())] } else { rng.next_u64() as u32 as i32 }).collect()
}

#[test]
fn integer_binary_ops_wrap_without_panicking() -> Res {
    let mut rng = Rng::new(3);
    let n = 301;
    let a = wide_i32(&mut rng, n);
    let b = wide_i32(&mut rng, n);
    let ta = Tensor::from_vec(a.clone(), &[n], CPU)?;
    let tb = Tensor::from_vec(b.clone(), &[n], CPU)?;
    let wrap = |v: i64| v as i32; // two's-complement truncation
    let want_add: Vec<i32> = a.iter().zip(&b).map(|(&x, &y)| wrap(x as i64 + y as i64)).collect();
    let want_sub: Vec<i32> = a.iter().zip(&b).map(|(&x, &y)| wrap(x as i64 - y as i64)).collect();
    let want_mul: Vec<i32> = a.iter().zip(&b).map(|(&x, &y)| wrap(x as i64 * y as i64)).collect();
    let want_max: Vec<i32> = a.iter().zip(&b).map(|(&x, &y)| if x > y { x } else { y }).collect();
    let want_min: Vec<i32> = a.iter().zip(&b).map(|(&x, &y)| if x < y { x } else { y }).collect();
    assert_eq!(ta.add(&tb)?.to_vec::<i32>()?, want_add);
    assert_eq!(ta.sub(&tb)?.to_vec::<i32>()?, want_sub);
    assert_eq!(ta.mul(&tb)?.to_vec::<i32>()?, want_mul);
    assert_eq!(ta.maximum(&tb)?.to_vec::<i32>()?, want_max);
    assert_eq!(ta.minimum(&tb)?.to_vec::<i32>()?, want_min);
    // Python remainder: sign of the divisor; division by zero gives 0 (documented).
    let want_rem: Vec<i32> = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| {
            if y == 0 {
                0
            } else {
                // In i64 nothing overflows; ((x % y) + y) % y has the sign of y.
                let (x, y) = (x as i64, y as i64);
                (((x % y) + y) % y) as i32
            }
        })
        .collect();
    assert_eq!(ta.rem(&tb)?.to_vec::<i32>()?, want_rem);

    // The classic overflow cases, one by one.
    let t = |v: Vec<i32>| Tensor::from_vec(v.clone(), &[v.len()], CPU).unwrap();
    assert_eq!(t(vec![i32::MAX]).add(1i32)?.to_vec::<i32>()?, vec![i32::MIN]);
    assert_eq!(t(vec![i32::MIN]).sub(1i32)?.to_vec::<i32>()?, vec![i32::MAX]);
    assert_eq!(t(vec![i32::MIN]).mul(-1i32)?.to_vec::<i32>()?, vec![i32::MIN]);
    assert_eq!(t(vec![i32::MIN]).rem(-1i32)?.to_vec::<i32>()?, vec![0]);
    assert_eq!(t(vec![5, -5, 0]).rem(0i32)?.to_vec::<i32>()?, vec![0, 0, 0]);
    assert_eq!(t(vec![i32::MIN]).neg()?.to_vec::<i32>()?, vec![i32::MIN]);

    let u = |v: Vec<u32>| Tensor::from_vec(v.clone(), &[v.len()], CPU).unwrap();
    let uv: Vec<u32> = (0..n).map(|i| if i % 7 == 0 { u32::MAX } else { rng.next_u64() as u32 }).collect();
    let wv: Vec<u32> = (0..n).map(|i| if i % 11 == 0 { 0 } else { rng.next_u64() as u32 }).collect();
    let (tu, tw) = (u(uv.clone()), u(wv.clone()));
    assert_eq!(tu.add(&tw)?.to_vec::<u32>()?, uv.iter().zip(&wv).map(|(&x, &y)| (x as u64 + y as u64) as u32).collect::<Vec<_>>());
    assert_eq!(tu.sub(&tw)?.to_vec::<u32>()?, uv.iter().zip(&wv).map(|(&x, &y)| (x as i64 - y as i64) as u32).collect::<Vec<_>>());
    assert_eq!(tu.mul(&tw)?.to_vec::<u32>()?, uv.iter().zip(&wv).map(|(&x, &y)| (x as u64 * y as u64) as u32).collect::<Vec<_>>());
    assert_eq!(tu.rem(&tw)?.to_vec::<u32>()?, uv.iter().zip(&wv).map(|(&x, &y)| if y == 0 { 0 } else { x % y }).collect::<Vec<_>>());
    assert_eq!(tu.maximum(&tw)?.to_vec::<u32>()?, uv.iter().zip(&wv).map(|(&x, &y)| x.max(y)).collect::<Vec<_>>());
    assert_eq!(u(vec![0]).sub(1u32)?.to_vec::<u32>()?, vec![u32::MAX]);
    assert_eq!(u(vec![u32::MAX]).mul(2u32)?.to_vec::<u32>()?, vec![u32::MAX - 1]);

    // True division of integers gives f32, as PyTorch's div does; pow of integers stays integer.
    let q = t(vec![7, -7, 1, 0]).div(t(vec![2, 2, 3, 4]))?;
    assert_eq!(q.dtype(), DType::F32);
    assert_eq!(q.to_vec::<f32>()?, vec![3.5, -3.5, 1.0 / 3.0, 0.0]);
    let p = t(vec![2, 3, -2, 2, 1, -1, -1, 5]).pow(t(vec![10, 2, 3, 31, -4, -3, -2, -1]))?;
    assert_eq!(p.dtype(), DType::I32);
    // 2^31 wraps; negative exponents give 0 but for bases 1 and -1 (as PyTorch).
    assert_eq!(p.to_vec::<i32>()?, vec![1024, 9, -8, i32::MIN, 1, -1, 1, 0]);
    assert_eq!(u(vec![3, 2]).pow(u(vec![4, 32]))?.to_vec::<u32>()?, vec![81, 0]);
    Ok(())
}

#[test]
fn rem_takes_the_sign_of_the_divisor() -> Res {
    let a = [-7.0, 7.0, -7.0, 7.0, -7.5, 5.5, 6.0, -6.0, 0.0, 1.0];
    let b = [3.0, -3.0, -3.0, 3.0, 2.0, -2.0, 3.0, 3.0, 5.0, 0.0];
    let want = [2.0, -2.0, -1.0, 1.0, 0.5, -0.5, 0.0, 0.0, 0.0, f64::NAN];
    for dtype in [DType::F32, DType::F64, DType::F16] {
        let (ta, _) = tensor(&a, &[10], dtype);
        let (tb, _) = tensor(&b, &[10], dtype);
        let r = (&ta % &tb)?;
        assert_eq!(r.dtype(), dtype);
        assert_same(&r.to_f64_vec()?.iter().map(|v| if *v == 0.0 { 0.0 } else { *v }).collect::<Vec<_>>(), &want, &format!("rem {dtype}"));
    }
    let ia = Tensor::from_vec(vec![-7i32, 7, -7, 7, -1, 0, 9], &[7], CPU)?;
    let ib = Tensor::from_vec(vec![3i32, -3, -3, 3, 5, -4, 3], &[7], CPU)?;
    assert_eq!(ia.rem(&ib)?.to_vec::<i32>()?, vec![2, -2, -1, 1, 4, 0, 0]);
    // Scalar divisors.
    let (x, _) = tensor(&[-1.0, -0.25, 2.5, 4.0], &[4], DType::F32);
    assert_eq!(x.rem(1.5)?.to_vec::<f32>()?, vec![0.5, 1.25, 1.0, 1.0]);
    assert_eq!(x.rem(-1.5)?.to_vec::<f32>()?, vec![-1.0, -0.25, -0.5, -0.5]);
    Ok(())
}

#[test]
fn maximum_minimum_relu_clamp_propagate_nan() -> Res {
    let nan = f64::NAN;
    let a = [nan, 1.0, 2.0, nan, -0.5, 3.0];
    let b = [1.0, nan, 1.0, nan, -1.0, f64::INFINITY];
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let (ta, _) = tensor(&a, &[6], dtype);
        let (tb, _) = tensor(&b, &[6], dtype);
        assert_same(&ta.maximum(&tb)?.to_f64_vec()?, &[nan, nan, 2.0, nan, -0.5, f64::INFINITY], &format!("maximum {dtype}"));
        assert_same(&ta.minimum(&tb)?.to_f64_vec()?, &[nan, nan, 1.0, nan, -1.0, 3.0], &format!("minimum {dtype}"));
        assert_same(&ta.relu()?.to_f64_vec()?, &[nan, 1.0, 2.0, nan, 0.0, 3.0], &format!("relu {dtype}"));
        assert_same(&ta.clamp(Some(0.0), Some(1.5))?.to_f64_vec()?, &[nan, 1.0, 1.5, nan, 0.0, 1.5], &format!("clamp {dtype}"));
        // A NaN scalar operand wins too.
        assert!(ta.maximum(nan)?.to_f64_vec()?.iter().all(|v| v.is_nan()));
    }
    // min > max fills with max, as PyTorch (NaN stays NaN).
    let (t, _) = tensor(&a, &[6], DType::F32);
    assert_same(&t.clamp(Some(2.0), Some(1.0))?.to_f64_vec()?, &[nan, 1.0, 1.0, nan, 1.0, 1.0], "clamp min > max");
    // clamp keeps integer tensors integer for whole bounds, and promotes for fractional ones.
    let i = Tensor::from_vec(vec![-5i32, 0, 2, 9], &[4], CPU)?;
    let c = i.clamp(Some(-1.0), Some(3.0))?;
    assert_eq!(c.dtype(), DType::I32);
    assert_eq!(c.to_vec::<i32>()?, vec![-1, 0, 2, 3]);
    let c = i.clamp(Some(0.5), None)?;
    assert_eq!(c.dtype(), DType::F32);
    assert_eq!(c.to_vec::<f32>()?, vec![0.5, 0.5, 2.0, 9.0]);
    Ok(())
}

type CmpFn = fn(&Tensor, &Tensor) -> voltaic::Result<Tensor>;
type CmpCase = (&'static str, CmpFn, fn(f64, f64) -> bool);

#[test]
fn comparisons_broadcast_and_follow_ieee() -> Res {
    let mut rng = Rng::new(4);
    let ops: Vec<CmpCase> = vec![
        ("eq", |a, b| a.eq(b), |a, b| a == b),
        ("ne", |a, b| a.ne(b), |a, b| a != b),
        ("lt", |a, b| a.lt(b), |a, b| a < b),
        ("le", |a, b| a.le(b), |a, b| a <= b),
        ("gt", |a, b| a.gt(b), |a, b| a > b),
        ("ge", |a, b| a.ge(b), |a, b| a >= b),
    ];
    let mut pairs = vec![(vec![3, 1, 5], vec![4, 1]), (vec![0, 2], vec![2])];
    for _ in 0..6 {
        pairs.push(bcast_pair(&mut rng));
    }
    for (da, db) in [
        (DType::F32, DType::F32),
        (DType::F64, DType::F32),
        (DType::I32, DType::F32),
        (DType::I32, DType::I32),
        (DType::U32, DType::I32),
        (DType::Bool, DType::Bool),
        (DType::F16, DType::F64),
    ] {
        for (ad, bd) in &pairs {
            // Coarse values so that ties happen; NaN sprinkled into floats.
            let mut gen = |dims: &[usize], dt: DType| {
                let v: Vec<f64> = (0..numel(dims))
                    .map(|_| match dt {
                        DType::Bool => rng.below(2) as f64,
                        DType::U32 => rng.below(4) as f64,
                        _ if dt.is_float() && rng.below(13) == 0 => f64::NAN,
                        _ if dt.is_float() => (rng.below(9) as f64 - 4.0) / 2.0,
                        _ => rng.below(9) as f64 - 4.0,
                    })
                    .collect();
                tensor(&v, dims, dt)
            };
            let (a, av) = gen(ad, da);
            let (b, bv) = gen(bd, db);
            for (name, f, r) in &ops {
                let y = f(&a, &b)?;
                assert_eq!(y.dtype(), DType::Bool);
                let (od, want) = bcast_ref(&av, ad, &bv, bd, |x, z| r(x, z) as u8 as f64);
                assert_eq!(y.dims(), &od[..]);
                assert_same(&y.to_f64_vec()?, &want, &format!("{name} {da}/{db} {ad:?} {bd:?}"));
            }
        }
    }
    // Scalars, and mixed int/float promotion: 3 (i32) < 3.5 compares in f32.
    let i = Tensor::from_vec(vec![2i32, 3, 4], &[3], CPU)?;
    assert_eq!(i.lt(3.5)?.to_vec::<bool>()?, vec![true, true, false]);
    assert_eq!(i.eq(3i32)?.to_vec::<bool>()?, vec![false, true, false]);
    assert_eq!(i.ge(3)?.to_vec::<bool>()?, vec![false, true, true]);
    let (f, _) = tensor(&[f64::NAN, 1.0, f64::INFINITY], &[3], DType::F32);
    assert_eq!(f.eq(&f)?.to_vec::<bool>()?, vec![false, true, true]);
    assert_eq!(f.ne(&f)?.to_vec::<bool>()?, vec![true, false, false]);
    assert_eq!(f.le(f64::INFINITY)?.to_vec::<bool>()?, vec![false, true, true]);
    assert_eq!(f.gt(f64::NAN)?.to_vec::<bool>()?, vec![false, false, false]);
    Ok(())
}

#[test]
fn where_cond_broadcasts_and_promotes() -> Res {
    let mut rng = Rng::new(5);
    // cond [3, 1, 5] (bool), a [4, 5] f32, b [1] f64 -> [3, 4, 5] f64.
    let cv: Vec<f64> = (0..15).map(|_| rng.below(2) as f64).collect();
    let (c, _) = tensor(&cv, &[3, 1, 5], DType::Bool);
    let (a, av) = randn(&[4, 5], DType::F32);
    let (b, bv) = randn(&[1], DType::F64);
    let y = c.where_cond(&a, &b)?;
    assert_eq!(y.dims(), &[3, 4, 5]);
    assert_eq!(y.dtype(), DType::F64);
    let mut want = vec![];
    for i in 0..3 {
        for j in 0..4 {
            for k in 0..5 {
                want.push(if cv[i * 5 + k] != 0.0 { av[j * 5 + k] } else { bv[0] });
            }
        }
    }
    assert_same(&y.to_f64_vec()?, &want, "where [3,1,5] [4,5] [1]");

    // A float condition counts nonzero (and NaN) as true.
    let (fc, fcv) = tensor(&[0.0, 2.0, -0.0, f64::NAN, -1.0], &[5], DType::F32);
    let y = fc.where_cond(1.0, -1.0)?;
    assert_eq!(y.dtype(), DType::F32);
    assert_eq!(y.to_vec::<f32>()?, fcv.iter().map(|&v| if v != 0.0 { 1.0 } else { -1.0 }).collect::<Vec<_>>());
    // Integer branch and float scalar promote to f32.
    let i = Tensor::from_vec(vec![10i32, 20, 30, 40, 50], &[5], CPU)?;
    let y = fc.where_cond(&i, 0.5)?;
    assert_eq!(y.dtype(), DType::F32);
    assert_eq!(y.to_vec::<f32>()?, vec![0.5, 20.0, 0.5, 40.0, 50.0]);
    let y = fc.where_cond(&i, -1i32)?;
    assert_eq!(y.dtype(), DType::I32);
    assert_eq!(y.to_vec::<i32>()?, vec![-1, 20, -1, 40, 50]);
    // Empty.
    let e = Tensor::zeros(&[0, 5], DType::Bool, CPU)?;
    assert_eq!(e.where_cond(&i, 0i32)?.dims(), &[0, 5]);
    // Shapes that do not broadcast.
    assert!(c.where_cond(&Tensor::ones(&[2], DType::F32, CPU)?, 0.0).is_err());
    Ok(())
}

#[test]
fn masked_fill_values() -> Res {
    let mut rng = Rng::new(6);
    let (x, xv) = randn(&[4, 7], DType::F32);
    let mv: Vec<f64> = (0..7).map(|_| rng.below(2) as f64).collect();
    let (m, _) = tensor(&mv, &[1, 7], DType::Bool);
    let y = x.masked_fill(&m, f64::NEG_INFINITY)?;
    assert_eq!(y.dims(), &[4, 7]);
    assert_eq!(y.dtype(), DType::F32);
    let want: Vec<f64> = (0..28).map(|i| if mv[i % 7] != 0.0 { f64::NEG_INFINITY } else { xv[i] }).collect();
    assert_same(&y.to_f64_vec()?, &want, "masked_fill -inf");
    // The value is cast to the tensor's dtype.
    let i = Tensor::from_vec((0..28).collect::<Vec<i32>>(), &[4, 7], CPU)?;
    let y = i.masked_fill(&m, 7.9)?;
    assert_eq!(y.dtype(), DType::I32);
    assert_eq!(y.to_vec::<i32>()?, (0..28).map(|k| if mv[k as usize % 7] != 0.0 { 7 } else { k }).collect::<Vec<i32>>());
    // The mask must be bool and must not grow the tensor.
    assert!(x.masked_fill(&x, 0.0).is_err());
    let big = Tensor::zeros(&[2, 4, 7], DType::Bool, CPU)?;
    assert!(x.masked_fill(&big, 0.0).is_err());
    Ok(())
}

/// What casting `v` (a value of `src`) to `dst` gives: Rust `as` semantics.
fn cast_ref(v: f64, src: DType, dst: DType) -> f64 {
    let int = |d: DType| matches!(d, DType::I32 | DType::U32);
    if int(src) && int(dst) {
        // Integer to integer wraps (two's complement).
        return if dst == DType::I32 { v as i64 as i32 as f64 } else { v as i64 as u32 as f64 };
    }
    round_to(v, dst)
}

#[test]
fn casts_between_all_dtypes() -> Res {
    let dts = [DType::F32, DType::F64, DType::I32, DType::U32, DType::Bool, DType::F16, DType::BF16];
    let raw = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        -0.5,
        1.5,
        -2.7,
        3.99,
        255.0,
        256.5,
        -1e10,
        1e10,
        65504.0,
        65519.0,
        70000.0,
        1e-8,
        -3e-5,
        3e38,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        2147483647.0,
        -2147483648.0,
        4294967295.0,
        123456789.0,
        0.1,
        1.0 / 3.0,
        6e-8,
        1e-40,
        16777217.0,
        3.0e9,
    ];
    let mut rng = Rng::new(7);
    let mut vals: Vec<f64> = raw.to_vec();
    for _ in 0..200 {
        vals.push(rng.range(-1000.0, 1000.0) as f32 as f64);
    }
    let n = vals.len();
    for &src in &dts {
        let (t, sv) = tensor(&vals, &[n], src);
        for &dst in &dts {
            let y = t.to_dtype(dst)?;
            assert_eq!(y.dtype(), dst);
            assert_eq!(y.dims(), &[n]);
            let got = y.to_f64_vec()?;
            let want: Vec<f64> = sv.iter().map(|&v| cast_ref(v, src, dst)).collect();
            for i in 0..n {
                assert!(
                    got[i] == want[i] || (got[i].is_nan() && want[i].is_nan()),
                    "cast {src} -> {dst} of {} (stored {}): got {}, expected {}",
                    vals[i],
                    sv[i],
                    got[i],
                    want[i]
                );
            }
            // Also as the tail of a fused chain (a cast of a pending value).
            if src != DType::Bool {
                let m = t.mul(1i32)?;
                assert_eq!(m.dtype(), src);
                let z = m.to_dtype(dst)?;
                let want: Vec<f64> = sv.iter().map(|&v| cast_ref(v, src, dst)).collect();
                assert_same(&z.to_f64_vec()?, &want, &format!("fused cast {src} -> {dst}"));
            }
        }
        // A cast to the same dtype is the tensor itself.
        assert!(t.to_dtype(src)?.same_storage(&t));
    }
    // Spot checks of the rules, independent of the reference above.
    let f = Tensor::from_vec(vec![-2.7f32, 2.7, f32::NAN, 1e10, -1e10], &[5], CPU)?;
    assert_eq!(f.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![-2, 2, 0, i32::MAX, i32::MIN]);
    assert_eq!(f.to_dtype(DType::U32)?.to_vec::<u32>()?, vec![0, 2, 0, u32::MAX, 0]);
    assert_eq!(f.to_dtype(DType::Bool)?.to_vec::<bool>()?, vec![true, true, true, true, true]);
    let h = Tensor::from_vec(vec![1.0f32 / 3.0, 65520.0, 1e-8, 2049.0], &[4], CPU)?.to_dtype(DType::F16)?;
    assert_eq!(
        h.to_vec::<half::f16>()?,
        vec![half::f16::from_f32(1.0 / 3.0), half::f16::INFINITY, half::f16::from_f32(1e-8), half::f16::from_f32(2048.0)]
    );
    let bf = Tensor::from_vec(vec![1.0f32 / 3.0, 257.0, 259.0], &[3], CPU)?.to_dtype(DType::BF16)?;
    assert_eq!(bf.to_f64_vec()?, vec![0.333984375, 256.0, 260.0]);
    let i = Tensor::from_vec(vec![-1i32, i32::MIN], &[2], CPU)?;
    assert_eq!(i.to_dtype(DType::U32)?.to_vec::<u32>()?, vec![u32::MAX, 1 << 31]);
    Ok(())
}

#[test]
fn dtype_promotion_rules() -> Res {
    use DType::*;
    let p = DType::promote;
    for d in DType::ALL {
        assert_eq!(p(d, d), d);
        assert_eq!(p(Bool, d), d);
        assert_eq!(p(d, Bool), d);
    }
    assert_eq!(p(I32, U32), I32);
    assert_eq!(p(U32, F16), F16);
    assert_eq!(p(I32, BF16), BF16);
    assert_eq!(p(F16, BF16), F32);
    assert_eq!(p(BF16, F16), F32);
    assert_eq!(p(F16, F32), F32);
    assert_eq!(p(BF16, F64), F64);
    assert_eq!(p(F32, F64), F64);
    assert_eq!(p(I32, F64), F64);

    let t = |dt: DType| Tensor::ones(&[2], dt, CPU).unwrap();
    // Arithmetic follows promote; bool + bool stays bool (logical or), as PyTorch.
    for a in DType::ALL {
        for b in DType::ALL {
            let want = p(a, b);
            let add = t(a).add(t(b))?;
            assert_eq!(add.dtype(), want, "add {a} {b}");
            assert_eq!(t(a).div(t(b))?.dtype(), want.to_float(), "div {a} {b}");
            assert_eq!(t(a).lt(t(b))?.dtype(), Bool, "lt {a} {b}");
            assert_eq!(t(a).logical_and(t(b))?.dtype(), Bool, "and {a} {b}");
            let two = if want == Bool { 1.0 } else { 2.0 };
            assert_eq!(add.to_f64_vec()?, vec![two, two], "add {a} {b}");
        }
    }
    // Values survive promotion.
    let i = Tensor::from_vec(vec![1i32, -2], &[2], CPU)?;
    let f = Tensor::from_vec(vec![0.5f32, 0.25], &[2], CPU)?;
    let u = Tensor::from_vec(vec![3u32, 7], &[2], CPU)?;
    let d = Tensor::from_vec(vec![0.1f64, 1e-300], &[2], CPU)?;
    let h = Tensor::from_vec(vec![half::f16::from_f32(1.5), half::f16::from_f32(-3.0)], &[2], CPU)?;
    assert_eq!(i.add(&f)?.to_vec::<f32>()?, vec![1.5, -1.75]);
    assert_eq!(u.add(&i)?.to_vec::<i32>()?, vec![4, 5]);
    assert_eq!(i.sub(&u)?.to_vec::<i32>()?, vec![-2, -9]);
    assert_eq!(h.add(&d)?.to_vec::<f64>()?, vec![1.6, -3.0 + 1e-300]);
    assert_eq!(h.mul(&i)?.dtype(), F16);
    assert_eq!(h.mul(&i)?.to_f64_vec()?, vec![1.5, 6.0]);
    Ok(())
}

#[test]
fn scalar_operands_follow_pytorch() -> Res {
    let i = Tensor::from_vec(vec![1i32, -2, 3], &[3], CPU)?;
    let u = Tensor::from_vec(vec![5u32, 0, 7], &[3], CPU)?;
    let b = Tensor::from_vec(vec![true, false, true], &[3], CPU)?;
    let (f, _) = tensor(&[0.5, -1.0, 2.0], &[3], DType::F32);
    let (d, _) = tensor(&[0.5, -1.0, 2.0], &[3], DType::F64);
    let (h, _) = tensor(&[0.5, -1.0, 2.0], &[3], DType::F16);

    // Float scalar with an integer or bool tensor: f32.
    let y = i.add(2.5)?;
    assert_eq!(y.dtype(), DType::F32);
    assert_eq!(y.to_vec::<f32>()?, vec![3.5, 0.5, 5.5]);
    let y = b.mul(2.5f32)?;
    assert_eq!(y.dtype(), DType::F32);
    assert_eq!(y.to_vec::<f32>()?, vec![2.5, 0.0, 2.5]);
    // Integer scalar keeps the tensor's dtype (bool becomes i32).
    let y = i.mul(3i32)?;
    assert_eq!(y.dtype(), DType::I32);
    assert_eq!(y.to_vec::<i32>()?, vec![3, -6, 9]);
    let y = b.add(1i32)?;
    assert_eq!(y.dtype(), DType::I32);
    assert_eq!(y.to_vec::<i32>()?, vec![2, 1, 2]);
    let y = u.add(3u32)?;
    assert_eq!(y.dtype(), DType::U32);
    assert_eq!(y.to_vec::<u32>()?, vec![8, 3, 10]);
    // A negative integer scalar with an unsigned tensor wraps, like the tensor-tensor op.
    let y = u.add(-1i32)?;
    assert_eq!(y.dtype(), DType::U32);
    assert_eq!(y.to_vec::<u32>()?, vec![4, u32::MAX, 6]);
    // Float tensors keep their dtype with any scalar.
    assert_eq!(f.add(1i32)?.dtype(), DType::F32);
    assert_eq!(d.add(0.1f32)?.dtype(), DType::F64);
    assert_eq!(d.add(0.1)?.to_vec::<f64>()?, vec![0.5 + 0.1, -1.0 + 0.1, 2.0 + 0.1]);
    let y = h.mul(1.5)?;
    assert_eq!(y.dtype(), DType::F16);
    assert_eq!(y.to_f64_vec()?, vec![0.75, -1.5, 3.0]);
    assert_eq!(f.sub(true)?.to_vec::<f32>()?, vec![-0.5, -2.0, 1.0]);
    // std::ops sugar.
    assert_eq!((&f * 2.0)?.to_vec::<f32>()?, vec![1.0, -2.0, 4.0]);
    assert_eq!((&f + &f)?.to_vec::<f32>()?, vec![1.0, -2.0, 4.0]);
    assert_eq!((&f - 1.0)?.to_vec::<f32>()?, vec![-0.5, -2.0, 1.0]);
    assert_eq!((&f / 4.0)?.to_vec::<f32>()?, vec![0.125, -0.25, 0.5]);
    assert_eq!((-&f)?.to_vec::<f32>()?, vec![-0.5, 1.0, -2.0]);
    assert_eq!((f.clone() * f.clone())?.to_vec::<f32>()?, vec![0.25, 1.0, 4.0]);
    assert_eq!(f.pow(2.0)?.to_vec::<f32>()?, vec![0.25, 1.0, 4.0]);
    Ok(())
}

#[test]
fn empty_tensors_give_empty_results() -> Res {
    for dims in [vec![0], vec![3, 0], vec![0, 1, 5]] {
        for dtype in [DType::F32, DType::F64, DType::I32] {
            let t = Tensor::zeros(&dims, dtype, CPU)?.contiguous()?;
            let outs = [
                t.neg()?,
                t.exp()?,
                t.abs()?,
                t.add(&t)?,
                t.mul(2i32)?,
                t.rem(3i32)?,
                t.maximum(&t)?,
                t.lt(&t)?,
                t.lt(&t)?.where_cond(&t, &t)?,
                t.to_dtype(DType::F16)?,
                t.gelu()?,
                t.clamp(Some(0.0), Some(1.0))?,
            ];
            for o in &outs {
                assert_eq!(o.dims(), &dims[..]);
                assert_eq!(o.to_f64_vec()?, Vec::<f64>::new());
            }
        }
    }
    Ok(())
}

#[test]
fn half_types_compute_in_f32_and_round() -> Res {
    let n = 517;
    let (_, raw) = randn(&[n], DType::F64);
    let (_, raw2) = randn(&[n], DType::F64);
    for dtype in [DType::F16, DType::BF16] {
        let (x, xv) = tensor(&raw, &[n], dtype);
        let (y, yv) = tensor(&raw2.iter().map(|v| v + 0.5 * v.signum()).collect::<Vec<_>>(), &[n], dtype);
        // One ulp of the half type (the f32 intermediate may round once more).
        let ulp = if dtype == DType::F16 { 2f64.powi(-10) } else { 2f64.powi(-7) };
        // (name, result, reference, extra scale of the tolerance): a chain may
        // or may not round its intermediates to the half type, so it is
        // allowed an ulp of each intermediate too.
        let zero = vec![0.0; n];
        let checks: Vec<(&str, Tensor, Vec<f64>, Vec<f64>)> = vec![
            ("add", x.add(&y)?, xv.iter().zip(&yv).map(|(a, b)| a + b).collect(), zero.clone()),
            ("mul", x.mul(&y)?, xv.iter().zip(&yv).map(|(a, b)| a * b).collect(), zero.clone()),
            ("div", x.div(&y)?, xv.iter().zip(&yv).map(|(a, b)| a / b).collect(), zero.clone()),
            ("exp", x.exp()?, xv.iter().map(|a| a.exp()).collect(), zero.clone()),
            ("sigmoid", x.sigmoid()?, xv.iter().map(|&a| sigmoid_ref(a)).collect(), zero.clone()),
            (
                "tanh(x)*y+1",
                x.tanh()?.mul(&y)?.add(1.0)?,
                xv.iter().zip(&yv).map(|(a, b)| a.tanh() * b + 1.0).collect(),
                xv.iter().zip(&yv).map(|(a, b)| 2.0 * (a.tanh() * b).abs() + 1.0).collect(),
            ),
        ];
        for (name, t, want, extra) in checks {
            assert_eq!(t.dtype(), dtype, "{name}");
            let got = t.to_f64_vec()?;
            for i in 0..n {
                let w = want[i];
                let tol = ulp * (w.abs() + extra[i]) + 1e-6;
                assert!((got[i] - w).abs() <= tol, "{name} {dtype} element {i}: {} vs {w}", got[i]);
                // And the stored value is a value of the half type.
                assert_eq!(got[i], round_to(got[i], dtype));
            }
        }
    }
    // f16 with bf16 computes in f32.
    let a = Tensor::ones(&[2], DType::F16, CPU)?;
    let b = Tensor::full(&[2], 0.5, DType::BF16, CPU)?;
    let c = a.add(&b)?;
    assert_eq!(c.dtype(), DType::F32);
    assert_eq!(c.to_vec::<f32>()?, vec![1.5, 1.5]);
    Ok(())
}

#[test]
fn long_fused_chains_over_mixed_inputs() -> Res {
    // A chain mixing dtypes, broadcasts, comparisons and where, checked against
    // the same arithmetic done step by step in f64 on the f32-rounded values.
    let (x, xv) = randn(&[13, 1], DType::F32);
    let (y, yv) = randn(&[7], DType::F32);
    let k = Tensor::from_vec((0..7).map(|i| i - 3).collect::<Vec<i32>>(), &[7], CPU)?;
    let t = x.mul(&y)?.add(&k)?; // [13, 7] f32
    let m = t.gt(0.0)?;
    let z = m.where_cond(&t.sqrt()?, &t.neg()?.exp()?)?.mul(0.5)?.sub(&x)?;
    let got = z.to_f64_vec()?;
    assert_eq!(z.dims(), &[13, 7]);
    for i in 0..13 {
        for j in 0..7 {
            let tv = round_f32(round_f32(xv[i] * yv[j]) + (j as f64 - 3.0));
            let w = if tv > 0.0 { tv.sqrt() } else { (-tv).exp() } * 0.5 - xv[i];
            let g = got[i * 7 + j];
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "[{i},{j}] {g} vs {w}");
        }
    }
    Ok(())
}

#[test]
fn large_and_deep_graphs() -> Res {
    // ~100k elements: several parallel chunks, runs crossing rows, a transposed
    // and a broadcast input.
    let (a, av) = randn(&[331, 317], DType::F32);
    let (b, bv) = randn(&[331, 1], DType::F32);
    let y = a.t()?.mul(&b.t()?)?.add(0.5)?.tanh()?; // [317, 331]
    assert_eq!(y.dims(), &[317, 331]);
    let got = y.to_f64_vec()?;
    for i in 0..317 {
        for j in 0..331 {
            let w = (round_f32(round_f32(av[j * 317 + i] * bv[j]) + 0.5)).tanh();
            let g = got[i * 331 + j];
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "[{i},{j}] {g} vs {w}");
        }
    }
    // A pending chain deeper than the realization limit (1000) still computes.
    let (x, xv) = randn(&[13], DType::F64);
    let mut t = x.clone();
    for _ in 0..2500 {
        t = t.add(1.0)?;
    }
    assert_same(&t.to_f64_vec()?, &xv.iter().map(|v| (0..2500).fold(*v, |acc, _| acc + 1.0)).collect::<Vec<_>>(), "2500 adds");
    let mut t = x.clone();
    for k in 0..1200 {
        t = if k % 2 == 0 { t.mul(&x)? } else { t.div(&x)? };
    }
    assert_close(&t.to_f64_vec()?, &xv, 1e-12, 0.0, "1200 alternating mul/div");
    Ok(())
}

#[test]
fn half_intermediates_do_not_depend_on_fusion() -> Res {
    for dtype in [DType::F16, DType::BF16] {
        let (x, _) = randn(&[1031], dtype);
        let (y, _) = randn(&[1031], dtype);
        // One fused kernel...
        let fused = x.mul(&y)?.add(&x)?.exp()?.sub(1.0)?.to_dtype(DType::F32)?;
        // ...and the same ops with every intermediate stored.
        let a = x.mul(&y)?;
        a.realize()?;
        let b = a.add(&x)?;
        b.realize()?;
        let c = b.exp()?;
        c.realize()?;
        let d = c.sub(1.0)?;
        d.realize()?;
        assert_same(&fused.to_f64_vec()?, &d.to_dtype(DType::F32)?.to_f64_vec()?, &format!("{dtype} fused vs stepwise"));
        // A comparison sees the stored value: 1 + (less than half an ulp) is 1.
        let small = if dtype == DType::F16 { 0.0004 } else { 0.001 };
        let s = Tensor::ones(&[4], dtype, CPU)?.add(small)?;
        assert_eq!(s.gt(1.0)?.to_vec::<bool>()?, vec![false; 4], "{dtype}: pending 1 + {small} > 1");
        assert_eq!(s.to_dtype(DType::F32)?.to_vec::<f32>()?, vec![1.0; 4]);
        assert_eq!(s.to_f64_vec()?, vec![1.0; 4]);
        assert_eq!(s.gt(1.0)?.to_vec::<bool>()?, vec![false; 4], "{dtype}: realized 1 + {small} > 1");
        // Reductions read the rounded prologue too.
        let t = Tensor::ones(&[1000], dtype, CPU)?.add(small)?.sum(&[], false)?;
        assert_eq!(t.to_f64_vec()?, vec![round_to(1000.0, dtype)]);
    }
    Ok(())
}
