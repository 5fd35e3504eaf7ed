//! The GPU executor against the CPU executor on the same inputs: every op
//! family, with views, broadcasting, odd sizes and every GPU dtype.
//!
//! These tests need a wgpu adapter. In CI that is Mesa's lavapipe (software
//! Vulkan); when no adapter is found they fail, they never skip.
//! `VOLTAIC_TEST_GPU=N` picks another adapter than `gpu:0`.
#![allow(clippy::cloned_ref_to_slice_refs, reason = "cases pass their inputs as arrays of tensor handles; `&[a.clone()]` reads like the others")]

mod common;


use common::{assert_close, idx_tensor, rand_tensor, tensor, Rng};
use voltaic::{Conv2dOpts, DType, Device, Reduction, Result, Tensor};

/// The GPU under test; panics (fails the test) when there is none.
fn gpu() -> Device {
    let adapters = voltaic::backend::adapters();
    assert!(
        !adapters.is_empty(),
        "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)"
    );
    let i = std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    Device::Gpu(i)
}

/// Whether the adapter under test has SHADER_F16 (not GL over llvmpipe,
/// for one: there f16 is held in 32-bit words).
fn gpu_has_f16() -> bool {
    let Device::Gpu(i) = gpu() else { unreachable!() };
    voltaic::backend::adapters()[i].features.contains(&"shader-f16")
}

/// The half-precision dtypes: both on every adapter.
fn half_dtypes() -> Vec<DType> {
    vec![DType::F16, DType::BF16]
}

fn to_gpu(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.to_device(gpu()).expect("upload")).collect()
}

/// Run `f` on CPU tensors and on the same tensors moved to the GPU; the
/// results must agree (`rtol`, `atol`), in shape, dtype and values.
fn same(what: &str, inputs: &[Tensor], rtol: f64, atol: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let want = f(inputs).unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
    let got = f(&to_gpu(inputs)).unwrap_or_else(|e| panic!("{what} on gpu: {e}"));
    assert_eq!(got.device(), gpu(), "{what}: result device");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (got.to_f64_vec().expect("gpu read"), want.to_f64_vec().expect("cpu read"));
    assert_close(&g, &w, rtol, atol, &format!("{what} (gpu vs cpu)"));
}

fn randn(rng: &mut Rng, dims: &[usize], dt: DType) -> Tensor {
    rand_tensor(rng, dims, dt).0
}

/// A strided (transposed) view with the given logical shape.
fn transposed(rng: &mut Rng, dims: &[usize], dt: DType) -> Tensor {
    let mut rev = dims.to_vec();
    rev.reverse();
    let t = randn(rng, &rev, dt);
    let perm: Vec<isize> = (0..dims.len() as isize).rev().collect();
    t.permute(&perm).expect("permute")
}

#[test]
fn unary_ops_match_cpu_on_strided_inputs() {
    let mut rng = Rng::new(1);
    let x = transposed(&mut rng, &[37, 19], DType::F32);
    let pos = x.abs().unwrap().add(0.01).unwrap();
    let small = x.mul(0.3).unwrap();
    type F = fn(&Tensor) -> Result<Tensor>;
    let all: &[(&str, F, bool)] = &[
        ("neg", Tensor::neg, false),
        ("abs", Tensor::abs, false),
        ("exp", Tensor::exp, false),
        ("log", Tensor::log, true),
        ("log1p", Tensor::log1p, true),
        ("expm1", Tensor::expm1, false),
        ("sqrt", Tensor::sqrt, true),
        ("rsqrt", Tensor::rsqrt, true),
        ("recip", Tensor::recip, true),
        ("sin", Tensor::sin, false),
        ("cos", Tensor::cos, false),
        ("tanh", Tensor::tanh, false),
        ("sigmoid", Tensor::sigmoid, false),
        ("relu", Tensor::relu, false),
        ("erf", Tensor::erf, false),
        ("floor", Tensor::floor, false),
        ("ceil", Tensor::ceil, false),
        ("round", Tensor::round, false),
        ("sign", Tensor::sign, false),
        ("gelu", Tensor::gelu, false),
        ("gelu_tanh", Tensor::gelu_tanh, false),
        ("silu", Tensor::silu, false),
        ("softplus", Tensor::softplus, false),
        ("nonfinite", Tensor::nonfinite, false),
        ("isfinite", Tensor::isfinite, false),
        ("isinf", Tensor::isinf, false),
        ("isnan", Tensor::isnan, false),
    ];
    for (name, f, positive) in all {
        let input = if *positive { &pos } else { &x };
        same(name, std::slice::from_ref(input), 2e-5, 2e-6, |t| f(&t[0]));
        same(&format!("{name} small"), std::slice::from_ref(&small), 2e-5, 2e-6, |t| f(&t[0]));
    }
    same("leaky_relu", &[x.clone()], 1e-6, 0.0, |t| t[0].leaky_relu(0.1));
    same("clamp", &[x.clone()], 0.0, 0.0, |t| t[0].clamp(Some(-0.5), Some(0.7)));
    // Special values: NaN, infinities, signed zeros, large arguments.
    let (sp, _) = tensor(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1e4, -1e4, 88.0, -88.0, 1e-7, 50.0, -50.0], &[12], DType::F32);
    for (name, f, _) in all {
        same(&format!("{name} special"), std::slice::from_ref(&sp), 1e-5, 1e-6, |t| f(&t[0]));
    }
}

#[test]
fn integer_and_bool_unary_ops_match_cpu() {
    let mut rng = Rng::new(2);
    for dt in [DType::I32, DType::U32] {
        let x = randn(&mut rng, &[5, 13], dt);
        for (name, f) in [
            ("neg", Tensor::neg as fn(&Tensor) -> Result<Tensor>),
            ("abs", Tensor::abs),
            ("relu", Tensor::relu),
            ("sign", Tensor::sign),
            ("floor", Tensor::floor),
            ("round", Tensor::round),
        ] {
            same(&format!("{name} {dt}"), std::slice::from_ref(&x), 0.0, 0.0, |t| f(&t[0]));
        }
    }
    let (extremes, _) = tensor(&[i32::MIN as f64, i32::MAX as f64, -1.0, 0.0], &[4], DType::I32);
    same("neg i32 extremes", std::slice::from_ref(&extremes), 0.0, 0.0, |t| t[0].neg());
    same("abs i32 extremes", std::slice::from_ref(&extremes), 0.0, 0.0, |t| t[0].abs());
    let b = randn(&mut rng, &[7, 3], DType::Bool);
    same("logical_not", std::slice::from_ref(&b), 0.0, 0.0, |t| t[0].logical_not());
}

#[test]
fn binary_ops_broadcast_and_match_cpu() {
    let mut rng = Rng::new(3);
    for dt in [DType::F32, DType::I32, DType::U32] {
        let a = randn(&mut rng, &[4, 1, 9], dt);
        let b = transposed(&mut rng, &[6, 1], dt);
        type Op = fn(&Tensor, &Tensor) -> Result<Tensor>;
        let ops: &[(&str, Op)] = &[
            ("add", |a, b| a.add(b)),
            ("sub", |a, b| a.sub(b)),
            ("mul", |a, b| a.mul(b)),
            ("div", |a, b| a.div(b)),
            ("rem", |a, b| a.rem(b)),
            ("maximum", |a, b| a.maximum(b)),
            ("minimum", |a, b| a.minimum(b)),
            ("eq", |a, b| a.eq(b)),
            ("ne", |a, b| a.ne(b)),
            ("lt", |a, b| a.lt(b)),
            ("le", |a, b| a.le(b)),
            ("gt", |a, b| a.gt(b)),
            ("ge", |a, b| a.ge(b)),
        ];
        for (name, f) in ops {
            same(&format!("{name} {dt}"), &[a.clone(), b.clone()], 1e-6, 1e-7, |t| f(&t[0], &t[1]));
        }
    }
    let a = randn(&mut rng, &[3, 8], DType::F32);
    let e = randn(&mut rng, &[8], DType::F32);
    same("pow", &[a.abs().unwrap(), e.clone()], 1e-5, 1e-6, |t| t[0].pow(&t[1]));
    same("pow negative base", &[a.clone()], 1e-5, 1e-6, |t| t[0].pow(3.0));
    same("pow squared", &[a.clone()], 1e-6, 0.0, |t| t[0].pow(2.0));
    same("pow nan", &[a.clone()], 1e-5, 1e-6, |t| t[0].pow(0.5));
    same("scalar chain", &[a.clone()], 1e-6, 1e-7, |t| t[0].mul(3.0)?.sub(1.5)?.div(7.0)?.rem(0.75));
    let (z, _) = tensor(&[7.0, -7.0, 7.0, -7.0, 0.0, i32::MIN as f64], &[6], DType::I32);
    let (d, _) = tensor(&[3.0, 3.0, -3.0, 0.0, 0.0, -1.0], &[6], DType::I32);
    same("int rem signs and zero", &[z, d], 0.0, 0.0, |t| t[0].rem(&t[1]));
    let p = randn(&mut rng, &[5, 5], DType::Bool);
    let q = transposed(&mut rng, &[5, 5], DType::Bool);
    same("logical_and", &[p.clone(), q.clone()], 0.0, 0.0, |t| t[0].logical_and(&t[1]));
    same("logical_or", &[p.clone(), q.clone()], 0.0, 0.0, |t| t[0].logical_or(&t[1]));
    same("bool lt", &[p.clone(), q.clone()], 0.0, 0.0, |t| t[0].lt(&t[1]));
    same("where", &[p, a.narrow(1, 0, 5).unwrap().narrow(0, 0, 1).unwrap(), e.narrow(0, 0, 5).unwrap()], 0.0, 0.0, |t| {
        t[0].where_cond(&t[1], &t[2])
    });
    let m = randn(&mut rng, &[3, 8], DType::Bool);
    same("masked_fill", &[a, m], 0.0, 0.0, |t| t[0].masked_fill(&t[1], -1.25));
}

#[test]
fn casts_between_every_gpu_dtype_match_cpu() {
    // Half-precision edges too: subnormals, ties, the largest finite values.
    let vals = [
        0.0, -0.0, 1.5, -1.5, 2.5, 0.49, 65504.0, 65519.0, 65520.0, 70000.0, -3e9, 3e9, 5e9, f64::NAN, f64::INFINITY, -1.0,
        255.0, 1e-8, 2.98e-8, 3e-8, 6e-8, 9e-8, 1e-5, -4.5e-6, 6.1e-5, 6.2e-5, 1.00048828125, 1.000732421875, 2049.0, 2051.0,
    ];
    let mut dts = vec![DType::F32, DType::BF16, DType::I32, DType::U32, DType::Bool];
    dts.extend(half_dtypes().into_iter().filter(|&d| d == DType::F16));
    for &from in &dts {
        let (x, _) = tensor(&vals, &[vals.len()], from);
        for &to in &dts {
            same(&format!("cast {from} -> {to}"), std::slice::from_ref(&x), 0.0, 0.0, |t| t[0].to_dtype(to));
        }
    }
}

#[test]
fn half_precision_arithmetic_matches_cpu() {
    let mut rng = Rng::new(4);
    for dt in half_dtypes() {
        let a = randn(&mut rng, &[9, 17], dt);
        let b = transposed(&mut rng, &[9, 17], dt);
        // Two units in the last place: NVIDIA's Vulkan driver does not always
        // round each fused intermediate to f16 as the CPU does (seen on an H100).
        let ulp = if dt == DType::F16 { 2.0 / 1024.0 } else { 2.0 / 128.0 };
        same(&format!("{dt} chain"), &[a.clone(), b.clone()], ulp, 0.0, |t| t[0].mul(&t[1])?.add(0.1)?.relu());
        same(&format!("{dt} exp"), &[a.clone()], 1e-3, 1e-4, |t| t[0].exp());
        same(&format!("{dt} sum"), &[a.clone()], 1e-2, 1e-2, |t| t[0].sum(&[-1], false));
        same(&format!("{dt} matmul"), &[a.clone(), b.t().unwrap()], 1e-2, 2e-2, |t| t[0].matmul(&t[1]));
        same(&format!("{dt} softmax"), &[a.clone()], 1e-2, 1e-3, |t| t[0].softmax(-1));
        same(&format!("{dt} cumsum"), &[a.clone()], 4.0 * ulp, 4.0 * ulp, |t| t[0].cumsum(1));
    }
}

#[test]
fn reductions_over_any_axes_match_cpu() {
    let mut rng = Rng::new(5);
    let x = randn(&mut rng, &[6, 5, 7, 4], DType::F32);
    let xt = x.permute(&[2, 0, 3, 1]).unwrap();
    let axes_sets: &[&[isize]] = &[&[], &[0], &[-1], &[1, 2], &[0, 3], &[0, 1, 2, 3], &[2]];
    for t in [&x, &xt] {
        for axes in axes_sets {
            for keep in [false, true] {
                let w = format!("{axes:?} keep={keep} contiguous={}", t.is_contiguous());
                same(&format!("sum {w}"), &[t.clone()], 1e-5, 1e-5, |v| v[0].sum(axes, keep));
                same(&format!("mean {w}"), &[t.clone()], 1e-5, 1e-6, |v| v[0].mean(axes, keep));
                same(&format!("max {w}"), &[t.clone()], 0.0, 0.0, |v| v[0].max(axes, keep));
                same(&format!("min {w}"), &[t.clone()], 0.0, 0.0, |v| v[0].min(axes, keep));
                same(&format!("prod {w}"), &[t.mul(0.5).unwrap().add(1.0).unwrap()], 1e-4, 1e-6, |v| v[0].prod(axes, keep));
                same(&format!("var {w}"), &[t.clone()], 1e-4, 1e-5, |v| v[0].var(axes, 1, keep));
                same(&format!("std {w}"), &[t.clone()], 1e-4, 1e-5, |v| v[0].std(axes, 0, keep));
                same(&format!("logsumexp {w}"), &[t.clone()], 1e-5, 1e-5, |v| v[0].logsumexp(axes, keep));
            }
        }
        for d in [None, Some(0), Some(1), Some(-1)] {
            same(&format!("argmax {d:?}"), &[t.clone()], 0.0, 0.0, |v| v[0].argmax(d, false));
            same(&format!("argmin {d:?}"), &[t.clone()], 0.0, 0.0, |v| v[0].argmin(d, true));
        }
    }
    // Ties, NaN and infinities: first index wins, NaN wins.
    let (s, _) = tensor(
        &[1.0, 3.0, 3.0, f64::NAN, 2.0, f64::NAN, -1.0, f64::NEG_INFINITY, f64::NEG_INFINITY, 5.0, 5.0, 0.0],
        &[3, 4],
        DType::F32,
    );
    for d in [0, 1] {
        same("argmax special", &[s.clone()], 0.0, 0.0, |v| v[0].argmax(Some(d), false));
        same("argmin special", &[s.clone()], 0.0, 0.0, |v| v[0].argmin(Some(d), false));
        same("max special", &[s.clone()], 0.0, 0.0, |v| v[0].max(&[d], false));
        same("min special", &[s.clone()], 0.0, 0.0, |v| v[0].min(&[d], false));
    }
    for dt in [DType::I32, DType::U32, DType::Bool] {
        let t = randn(&mut rng, &[9, 70], dt);
        same(&format!("sum {dt}"), &[t.clone()], 0.0, 0.0, |v| v[0].sum(&[1], false));
        same(&format!("max {dt}"), &[t.clone()], 0.0, 0.0, |v| v[0].max(&[0], false));
        same(&format!("argmin {dt}"), &[t.clone()], 0.0, 0.0, |v| v[0].argmin(Some(1), false));
        if dt != DType::Bool {
            same(&format!("prod {dt}"), &[t.clone()], 0.0, 0.0, |v| v[0].prod(&[1], false));
        }
    }
}

#[test]
fn long_and_strided_reductions_use_every_strategy() {
    let mut rng = Rng::new(6);
    // One long row: split over many workgroups, then combined.
    let long = randn(&mut rng, &[200_003], DType::F32);
    same("sum long", &[long.clone()], 1e-4, 1e-3, |v| v[0].sum(&[0], false));
    same("max long", &[long.clone()], 0.0, 0.0, |v| v[0].max(&[0], false));
    same("argmax long", &[long.clone()], 0.0, 0.0, |v| v[0].argmax(Some(0), false));
    same("argmin long", &[long.clone()], 0.0, 0.0, |v| v[0].argmin(None, false));
    let rows = randn(&mut rng, &[3, 40_000], DType::F32);
    same("sum few long rows", &[rows.clone()], 1e-4, 1e-3, |v| v[0].sum(&[1], false));
    same("argmax few long rows", &[rows], 0.0, 0.0, |v| v[0].argmax(Some(1), false));
    // A language model's logits, argmax split 24 ways and the partials
    // combined by a workgroup: ties (few distinct values) go to the lowest
    // index across the splits.
    let logits = randn(&mut rng, &[2, 49_152], DType::F32).abs().unwrap().mul(1.5).unwrap().floor().unwrap();
    same("argmax tied logits", &[logits.clone()], 0.0, 0.0, |v| v[0].argmax(Some(1), false));
    same("argmin tied logits", &[logits.clone()], 0.0, 0.0, |v| v[0].argmin(Some(1), false));
    same("max tied logits", &[logits], 0.0, 0.0, |v| v[0].max(&[1], false));
    // Many rows reduced along a strided dim: a thread per output.
    let cols = randn(&mut rng, &[300, 2000], DType::F32);
    same("sum over dim 0", &[cols.clone()], 1e-4, 1e-4, |v| v[0].sum(&[0], false));
    same("argmax over dim 0", &[cols.clone()], 0.0, 0.0, |v| v[0].argmax(Some(0), false));
    // Few outputs over a long strided dim: the dim split over workgroups
    // (32 splits here); ties must still go to the lowest index across
    // splits, and half inputs and bool counts fold the same.
    let ties = randn(&mut rng, &[1000, 37], DType::F32).abs().unwrap().mul(1.5).unwrap().floor().unwrap();
    same("argmax ties over split columns", &[ties.clone()], 0.0, 0.0, |v| v[0].argmax(Some(0), false));
    same("argmin ties over split columns", &[ties.clone()], 0.0, 0.0, |v| v[0].argmin(Some(0), false));
    same("sum over split columns", &[ties.clone()], 0.0, 0.0, |v| v[0].sum(&[0], false));
    same("count over split columns", &[ties], 0.0, 0.0, |v| v[0].gt(0.5)?.sum(&[0], false));
    let h = randn(&mut rng, &[4096, 24], DType::F16);
    same("f16 sum over split columns", &[h], 2e-3, 2e-2, |v| v[0].sum(&[0], false));
    // The most splits (runs of 16 rows, at most 256), folded by a workgroup
    // per column: more columns than a workgroup, and long columns.
    let wide = randn(&mut rng, &[4100, 300], DType::F32);
    same("sum over 257 runs of 300 columns", &[wide.clone()], 1e-5, 1e-4, |v| v[0].sum(&[0], false));
    same("argmax over 257 runs of 300 columns", &[wide], 0.0, 0.0, |v| v[0].argmax(Some(0), false));
    let long = randn(&mut rng, &[40_000, 3], DType::F32);
    same("sum over 256 splits of long columns", &[long.clone()], 1e-5, 1e-3, |v| v[0].sum(&[0], false));
    same("max over 256 splits of long columns", &[long], 0.0, 0.0, |v| v[0].max(&[0], false));
    // Medium rows: a workgroup per output.
    same("softmax rows", &[cols.clone()], 1e-5, 1e-7, |v| v[0].softmax(-1));
    same("log_softmax rows", &[cols.clone()], 1e-5, 1e-5, |v| v[0].log_softmax(-1));
    same("softmax cols", &[cols.clone()], 1e-5, 1e-7, |v| v[0].softmax(0));
    same("cumsum", &[cols.clone()], 1e-4, 1e-4, |v| v[0].cumsum(1));
    same("cumsum strided", &[cols.t().unwrap()], 1e-4, 1e-4, |v| v[0].cumsum(0));
    let ints = randn(&mut rng, &[4, 33, 5], DType::I32);
    same("cumsum i32", &[ints], 0.0, 0.0, |v| v[0].cumsum(1));
}

#[test]
fn matmul_matches_cpu_for_every_form() {
    let mut rng = Rng::new(7);
    let cases: &[(&[usize], &[usize])] = &[
        (&[7], &[7]),
        (&[5], &[5, 3]),
        (&[4, 6], &[6]),
        (&[1, 1], &[1, 1]),
        (&[65, 33], &[33, 70]),
        (&[3, 17, 9], &[9, 31]),
        (&[2, 1, 5, 8], &[3, 8, 4]),
        (&[128, 130], &[130, 129]),
        (&[0, 4], &[4, 3]),
        (&[3, 0], &[0, 5]),
    ];
    for (da, db) in cases {
        let a = randn(&mut rng, da, DType::F32);
        let b = randn(&mut rng, db, DType::F32);
        same(&format!("matmul {da:?} @ {db:?}"), &[a, b], 1e-5, 1e-5, |t| t[0].matmul(&t[1]));
    }
    let a = transposed(&mut rng, &[37, 21], DType::F32);
    let b = transposed(&mut rng, &[21, 45], DType::F32);
    same("matmul transposed views", &[a.clone(), b.clone()], 1e-5, 1e-5, |t| t[0].matmul(&t[1]));
    let wide = randn(&mut rng, &[1, 45], DType::F32).broadcast_to(&[5, 45]).unwrap();
    same("matmul broadcast rows", &[wide, b.t().unwrap()], 1e-5, 1e-5, |t| t[0].matmul(&t[1]));
    for dt in [DType::I32, DType::U32] {
        let a = randn(&mut rng, &[9, 13], dt);
        let b = randn(&mut rng, &[13, 6], dt);
        same(&format!("matmul {dt}"), &[a, b], 0.0, 0.0, |t| t[0].matmul(&t[1]));
    }
    same("linear + relu", &[a.clone(), b.clone(), randn(&mut rng, &[45], DType::F32)], 1e-5, 1e-5, |t| {
        t[0].matmul(&t[1])?.add(&t[2])?.relu()
    });
    // Both operands read one buffer (a Gram matrix): it is bound once.
    same("x^T @ x", &[a.clone()], 1e-5, 1e-5, |t| t[0].t()?.matmul(&t[0]));
    same("x @ x^T + 1", &[randn(&mut rng, &[6, 70], DType::F32)], 1e-5, 1e-5, |t| t[0].matmul(&t[0].t()?)?.add(1.0));
}

#[test]
fn indexing_ops_match_cpu() {
    let mut rng = Rng::new(8);
    let x = randn(&mut rng, &[5, 7, 3], DType::F32);
    let idx: Vec<i64> = (0..5 * 4 * 3).map(|_| rng.below(7) as i64).collect();
    let index = idx_tensor(&idx, &[5, 4, 3]);
    same("gather dim 1", &[x.clone(), index.clone()], 0.0, 0.0, |t| t[0].gather(1, &t[1]));
    let src = randn(&mut rng, &[5, 4, 3], DType::F32);
    same("scatter_add dim 1", &[x.clone(), index.clone(), src.clone()], 1e-6, 1e-6, |t| t[0].scatter_add(1, &t[1], &t[2]));
    let idx0: Vec<i64> = (0..2 * 7 * 3).map(|_| rng.below(5) as i64).collect();
    let index0 = idx_tensor(&idx0, &[2, 7, 3]);
    let src0 = randn(&mut rng, &[2, 7, 3], DType::F32);
    same("scatter_add dim 0", &[x.clone(), index0, src0], 1e-6, 1e-6, |t| t[0].scatter_add(0, &t[1], &t[2]));
    let sel = idx_tensor(&[6, 0, 0, 3, 2], &[5]);
    same("index_select", &[x.clone(), sel.clone()], 0.0, 0.0, |t| t[0].index_select(1, &t[1]));
    same("index_select strided", &[x.permute(&[2, 1, 0]).unwrap(), sel.clone()], 0.0, 0.0, |t| t[0].index_select(1, &t[1]));
    let table = randn(&mut rng, &[11, 6], DType::F32);
    let tokens = idx_tensor(&[1, 10, 3, 3, 0, 7], &[2, 3]);
    same("embedding", &[table, tokens.clone()], 0.0, 0.0, |t| t[0].embedding(&t[1]));
    same("one_hot", &[tokens], 0.0, 0.0, |t| t[0].one_hot(11));
    let u = Tensor::from_vec(vec![2u32, 0, 1], &[3], Device::Cpu).unwrap();
    same("index_select u32 index", &[x.clone(), u], 0.0, 0.0, |t| t[0].index_select(0, &t[1]));
    let parts = [randn(&mut rng, &[2, 3], DType::F32), transposed(&mut rng, &[2, 5], DType::F32), randn(&mut rng, &[2, 0], DType::F32)];
    same("cat", &parts, 0.0, 0.0, |t| Tensor::cat(&[&t[0], &t[1], &t[2]], 1));
    // 16-bit parts of odd widths: neighbouring halves of one word come from
    // different parts (bf16 is stored two to a word on every adapter, f16
    // where the adapter lacks shader-f16).
    for dt in [DType::BF16, DType::F16] {
        let halves = [randn(&mut rng, &[3, 3], dt), transposed(&mut rng, &[3, 5], dt), randn(&mut rng, &[3, 1], dt), randn(&mut rng, &[3, 0], dt)];
        same(&format!("cat {dt}"), &halves, 0.0, 0.0, |t| Tensor::cat(&[&t[0], &t[1], &t[2], &t[3], &t[0]], 1));
        same(&format!("cat {dt} along dim 0"), &halves[..1], 0.0, 0.0, |t| Tensor::cat(&[&t[0], &t[0].narrow(0, 1, 1)?], 0));
    }
    same("stack", &[parts[0].clone(), parts[0].mul(2.0).unwrap()], 0.0, 0.0, |t| Tensor::stack(&[&t[0], &t[1]], 1));
    same("split+chunk", &[x.clone()], 0.0, 0.0, |t| {
        let s = t[0].split(3, 1)?;
        let c = t[0].chunk(2, 0)?;
        Tensor::cat(&[&s[0], &c[1].narrow(0, 0, 1)?.narrow(1, 0, 3)?, &s[2].expand(&[5, 3, 3])?], 0)
    });
}

#[test]
fn nn_ops_match_cpu() {
    let mut rng = Rng::new(9);
    let x = randn(&mut rng, &[2, 4, 9, 8], DType::F32);
    let w = randn(&mut rng, &[6, 2, 3, 3], DType::F32);
    let b = randn(&mut rng, &[6], DType::F32);
    let opts = Conv2dOpts { stride: [2, 1], padding: [1, 2], dilation: [1, 2], groups: 2 };
    same("conv2d", &[x.clone(), w.clone(), b.clone()], 1e-5, 1e-5, |t| t[0].conv2d(&t[1], Some(&t[2]), opts));
    let w1 = randn(&mut rng, &[5, 4, 3, 3], DType::F32);
    same("conv2d plain", &[x.clone(), w1], 1e-5, 1e-5, |t| t[0].conv2d(&t[1], None, Conv2dOpts::default()));
    same("max_pool2d", &[x.clone()], 0.0, 0.0, |t| t[0].max_pool2d([3, 2], Some([2, 2]), [1, 1]));
    same("avg_pool2d", &[x.clone()], 1e-6, 1e-6, |t| t[0].avg_pool2d([2, 2], None, [0, 0]));
    let h = randn(&mut rng, &[3, 5, 24], DType::F32);
    let g = randn(&mut rng, &[24], DType::F32);
    let bb = randn(&mut rng, &[24], DType::F32);
    same("layer_norm", &[h.clone(), g, bb], 1e-5, 1e-5, |t| t[0].layer_norm(&[24], Some(&t[1]), Some(&t[2]), 1e-5));
    let logits = randn(&mut rng, &[13, 10], DType::F32);
    let target = idx_tensor(&(0..13).map(|i| (i * 7 % 10) as i64).collect::<Vec<_>>(), &[13]);
    for (ls, red) in [(0.0, Reduction::Mean), (0.1, Reduction::Sum), (0.2, Reduction::None)] {
        same(&format!("cross_entropy {ls} {red:?}"), &[logits.clone(), target.clone()], 1e-5, 1e-5, |t| {
            t[0].cross_entropy(&t[1], ls, red)
        });
    }
    same("mse_loss", &[logits.clone(), logits.t().unwrap().contiguous().unwrap().reshape(&[13, 10]).unwrap()], 1e-5, 1e-6, |t| {
        t[0].mse_loss(&t[1], Reduction::Mean)
    });
}

#[test]
fn random_tensors_are_the_same_on_every_device() {
    for (dt, f) in [
        (DType::F32, Tensor::randn as fn(&[usize], DType, Device) -> Result<Tensor>),
        (DType::F32, Tensor::rand),
        (DType::BF16, Tensor::rand),
    ] {
        voltaic::manual_seed(1234);
        let c = f(&[3, 50], dt, Device::Cpu).unwrap().to_f64_vec().unwrap();
        voltaic::manual_seed(1234);
        let g = f(&[3, 50], dt, gpu()).unwrap().to_f64_vec().unwrap();
        assert_eq!(c, g, "{dt}");
    }
    voltaic::manual_seed(7);
    let c = Tensor::ones(&[100], DType::F32, Device::Cpu).unwrap().dropout(0.3, true).unwrap().to_vec::<f32>().unwrap();
    voltaic::manual_seed(7);
    let g = Tensor::ones(&[100], DType::F32, gpu()).unwrap().dropout(0.3, true).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(c, g);
}

#[test]
fn empty_tensors_work() {
    let e = Tensor::zeros(&[0, 3], DType::F32, gpu()).unwrap();
    assert_eq!(e.add(1.0).unwrap().to_vec::<f32>().unwrap(), Vec::<f32>::new());
    assert_eq!(e.sum(&[0], false).unwrap().to_vec::<f32>().unwrap(), vec![0.0; 3]);
    assert_eq!(e.prod(&[0], false).unwrap().to_vec::<f32>().unwrap(), vec![1.0; 3]);
    assert_eq!(e.softmax(-1).unwrap().dims(), &[0, 3]);
}

#[test]
fn views_and_creation_round_trip() {
    let g = gpu();
    let a = Tensor::arange(0.0, 24.0, 1.0, DType::F32, g).unwrap().reshape(&[2, 3, 4]).unwrap();
    let v = a.permute(&[2, 0, 1]).unwrap().slice(0, 1, 4, 2).unwrap();
    let c = Tensor::arange(0.0, 24.0, 1.0, DType::F32, Device::Cpu).unwrap().reshape(&[2, 3, 4]).unwrap();
    let w = c.permute(&[2, 0, 1]).unwrap().slice(0, 1, 4, 2).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
    assert_eq!(v.contiguous().unwrap().to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
    let eye = Tensor::eye(3, DType::I32, g).unwrap();
    assert_eq!(eye.to_vec::<i32>().unwrap(), vec![1, 0, 0, 0, 1, 0, 0, 0, 1]);
    let half = *half_dtypes().first().expect("bf16 always");
    let f = Tensor::full(&[2, 2], 2.5, half, g).unwrap();
    assert_eq!(f.to_f64_vec().unwrap(), vec![2.5; 4]);
    assert_eq!(Tensor::scalar(3u32, g).unwrap().item::<u32>().unwrap(), 3);
    let s = format!("{}", Tensor::linspace(0.0, 1.0, 3, DType::F32, g).unwrap());
    assert_eq!(s, "tensor([0.0000, 0.5000, 1.0000], device=gpu:0)");
    // Moving back and forth keeps values; the GPU result is a GPU tensor.
    let back = v.to_device(Device::Cpu).unwrap();
    assert_eq!(back.device(), Device::Cpu);
    assert_eq!(back.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
}

#[test]
fn mixing_devices_is_an_error() {
    let a = Tensor::ones(&[3], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::ones(&[3], DType::F32, gpu()).unwrap();
    let e = a.add(&b).unwrap_err().to_string();
    assert!(e.contains("cpu") && e.contains("gpu:0"), "{e}");
    let e = a.matmul(&b).unwrap_err().to_string();
    assert!(e.contains("matmul"), "{e}");
}

#[test]
fn f64_is_a_clear_error_on_the_gpu() {
    let e = Tensor::zeros(&[2], DType::F64, Device::Cpu).unwrap().add(1.0).unwrap().to_device(gpu()).unwrap_err();
    assert!(e.to_string().contains("f64"), "{e}");
    // An f64 that is only a fused intermediate is refused as clearly.
    let x = Tensor::ones(&[3], DType::F32, gpu()).unwrap();
    let e = x.to_dtype(DType::F64).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap_err();
    assert!(e.to_string().contains("f64 is not supported on the GPU"), "{e}");
}

#[test]
fn software_adapters_are_not_the_best_device() {
    if std::env::var("VOLTAIC_DEVICE").is_ok() {
        return; // an explicit choice overrides; nothing to check
    }
    let hardware = voltaic::backend::adapters().into_iter().find(|a| !a.is_software());
    match hardware {
        Some(a) => assert_eq!(Device::best(), Device::Gpu(a.index)),
        None => assert_eq!(Device::best(), Device::Cpu),
    }
}

#[test]
fn large_contiguous_elementwise_kernels_match_cpu() {
    // Big enough for the vec4 path: contiguous loads, aligned and unaligned
    // offsets, a broadcast scalar, and integer types.
    let mut rng = Rng::new(10);
    let n = 70_000;
    let a = randn(&mut rng, &[n + 8], DType::F32);
    let b = randn(&mut rng, &[n], DType::F32);
    let s = randn(&mut rng, &[1], DType::F32);
    // The result (x*y + 1.5, raised to s, minus z) can be far smaller than its
    // terms, and a GPU may fuse the multiply-add: the tolerance is absolute,
    // a few ulps of the terms.
    same("vec4 aligned", &[a.clone(), b.clone(), s.clone()], 1e-6, 1e-6, |t| {
        t[0].narrow(0, 4, n)?.mul(&t[1])?.add(1.5)?.maximum(&t[2].broadcast_to(&[n])?)?.sub(&t[0].narrow(0, 0, n)?)
    });
    same("vec4 unaligned falls back", &[a.clone(), b.clone()], 1e-6, 1e-7, |t| t[0].narrow(0, 3, n)?.add(&t[1]));
    let i = randn(&mut rng, &[n], DType::I32);
    same("vec4 i32", &[i.clone(), i.clone()], 0.0, 0.0, |t| t[0].mul(&t[1])?.add(7)?.rem(5));
    same("vec4 cast", &[i], 0.0, 0.0, |t| t[0].to_dtype(DType::F32)?.mul(0.5));
    // f16 (four halves per load where the adapter stores f16 natively, the
    // scalar path where it packs them): f16 in and out, a broadcast half,
    // f16 mixed with f32 both ways, an offset view and two outputs. Every
    // op rounds to f16 on both sides, so they agree but for a fused
    // multiply-add's last bit.
    let h = randn(&mut rng, &[n + 8], DType::F16);
    let h2 = randn(&mut rng, &[n], DType::F16);
    let hs = randn(&mut rng, &[1], DType::F16);
    same("vec4 f16", &[h.clone(), h2.clone(), hs.clone()], 2e-3, 2e-3, |t| {
        t[0].narrow(0, 4, n)?.mul(&t[1])?.add(0.5)?.maximum(&t[2].broadcast_to(&[n])?)?.sub(&t[0].narrow(0, 0, n)?)
    });
    same("vec4 f16 with f32 to f32", &[h2.clone(), b.clone()], 1e-6, 1e-6, |t| t[0].mul(&t[1])?.tanh());
    same("vec4 f32 to f16", &[b.clone(), h2.clone()], 2e-3, 2e-3, |t| t[0].to_dtype(DType::F16)?.mul(&t[1])?.abs()?.sqrt());
    let both = |t: &[Tensor]| -> Result<Vec<Tensor>> {
        let y = t[0].mul(&t[1])?;
        Ok(vec![y.add(1.0)?, y.exp()?.to_dtype(DType::F16)?])
    };
    same_all("vec4 f16 two outputs", &[h2.clone(), h.narrow(0, 8, n).unwrap()], 2e-3, 2e-3, both);
}

#[test]
fn row_wise_work_runs_in_one_kernel_and_matches_cpu() {
    let mut rng = Rng::new(21);
    // A thread per row (short rows), 64- and 256-wide workgroups per row,
    // and segments of 32 threads for many rows (a partial last workgroup
    // of 8 rows; rows shorter than a segment's four trips and longer).
    // (Rows of at most 8 are unrolled into elementwise code instead.)
    for dims in [[300, 19], [37, 50], [40, 700], [5, 3001], [1029, 37], [1100, 160], [1024, 1024]] {
        let x = randn(&mut rng, &dims, DType::F32).mul(3.0).unwrap();
        let n = dims[1];
        let g = randn(&mut rng, &[n], DType::F32);
        let b = randn(&mut rng, &[n], DType::F32);
        let on_gpu = x.to_device(gpu()).unwrap();
        let sm = on_gpu.softmax(-1).unwrap();
        let plan = voltaic::inspect(&[&sm]);
        assert_eq!(plan.len(), 1, "softmax {dims:?} on the GPU is one kernel: {plan:?}");
        assert_eq!(plan[0].kind, "rows");
        // A tracked input (a training step's attention) keeps one kernel:
        // the gradient reads only the output, so no row statistic is kept.
        let tracked = on_gpu.requires_grad().unwrap();
        let plan = voltaic::inspect(&[&tracked.softmax(-1).unwrap()]);
        assert_eq!(plan.len(), 1, "softmax of a tracked {dims:?} on the GPU is one kernel: {plan:?}");
        assert_eq!(plan[0].kind, "rows", "softmax {dims:?}");
        same(&format!("softmax and log_softmax gradients {dims:?}"), &[x.clone(), g.clone()], 1e-4, 1e-6, |t| {
            let x = t[0].requires_grad()?;
            let w = t[1].broadcast_to(x.dims())?;
            x.softmax(-1)?.mul(&w)?.add(&x.log_softmax(-1)?.mul(&w)?.mul(0.25)?)?.sum_all()?.backward()?;
            Ok(x.grad().expect("a gradient"))
        });
        let ln = on_gpu.layer_norm(&[n], Some(&g.to_device(gpu()).unwrap()), Some(&b.to_device(gpu()).unwrap()), 1e-5).unwrap();
        assert_eq!(voltaic::inspect(&[&ln]).len(), 1, "layer_norm {dims:?}: {:?}", voltaic::inspect(&[&ln]));
        same(&format!("softmax {dims:?}"), &[x.clone()], 1e-5, 1e-7, |t| t[0].softmax(-1));
        same(&format!("log_softmax {dims:?}"), &[x.clone()], 1e-5, 1e-5, |t| t[0].log_softmax(-1));
        same(&format!("logsumexp {dims:?}"), &[x.clone()], 1e-5, 1e-5, |t| t[0].logsumexp(&[-1], true)?.add(&t[0]));
        same(&format!("layer_norm {dims:?}"), &[x.clone(), g, b], 1e-4, 1e-4, |t| {
            t[0].layer_norm(&[n], Some(&t[1]), Some(&t[2]), 1e-5)
        });
        same(&format!("min and prod rows {dims:?}"), &[x.clone()], 1e-4, 1e-5, |t| {
            t[0].sub(&t[0].min(&[-1], true)?)?.div(&t[0].abs()?.add(1.0)?.log()?.sum(&[-1], true)?.exp()?)
        });
    }
    // A row holding NaN is NaN throughout, as on the CPU; infinities too
    // (workgroup rows and segments).
    for rows in [4, 1030] {
        let mut v: Vec<f32> = (0..rows * 40).map(|i| (i as f32 * 0.37).sin()).collect();
        v[45] = f32::NAN;
        v[100] = f32::INFINITY;
        v[rows * 40 - 3] = f32::NAN;
        let x = Tensor::from_vec(v, &[rows, 40], Device::Cpu).unwrap();
        same(&format!("softmax with NaN and inf, {rows} rows"), &[x], 1e-5, 1e-7, |t| t[0].softmax(-1));
    }
    // f16 rows compute in f32.
    for dims in [[33, 70], [1030, 70]] {
        let h = randn(&mut rng, &dims, DType::F32);
        for dt in half_dtypes() {
            same(&format!("{dt} softmax rows {dims:?}"), &[h.to_dtype(dt).unwrap()], 1e-2, 1e-3, |t| t[0].softmax(-1));
        }
    }
    // Results someone keeps are not folded away: the max is asked for too.
    let x = randn(&mut rng, &[20, 30], DType::F32).to_device(gpu()).unwrap();
    let m = x.max(&[-1], true).unwrap();
    let y = x.sub(&m).unwrap().exp().unwrap();
    let s = y.div(y.sum(&[-1], true).unwrap()).unwrap();
    let plan = voltaic::inspect(&[&s, &m]);
    assert!(plan.len() >= 2, "a kept max keeps its kernel: {plan:?}");
    voltaic::Tensor::realize_all(&[&s, &m]).unwrap();
    let want = x.to_device(Device::Cpu).unwrap().softmax(-1).unwrap();
    assert_close(&s.to_f64_vec().unwrap(), &want.to_f64_vec().unwrap(), 1e-5, 1e-7, "softmax with its max kept");
}

#[test]
fn erf_agrees_with_the_cpu_to_one_ulp() {
    // One algorithm on both devices (`fastmath::erf_f32` and the WGSL
    // helper): only a fused multiply-add may move the last bit.
    let mut xs: Vec<f32> = (0..=80_000).map(|i| -5.0 + i as f32 * 1.25e-4).collect();
    xs.extend([0.0, -0.0, 1e-30, -1e-30, 0.99999994, 1.0, 3.9199998, 3.92, 1e30, f32::INFINITY, f32::NEG_INFINITY]);
    let n = xs.len();
    let x = Tensor::from_vec(xs.clone(), &[n], Device::Cpu).unwrap();
    let cpu = x.erf().unwrap().to_vec::<f32>().unwrap();
    let on_gpu = x.to_device(gpu()).unwrap().erf().unwrap().to_vec::<f32>().unwrap();
    let key = |v: f32| {
        let i = v.to_bits() as i32;
        if i < 0 { i32::MIN - i } else { i }
    };
    let mut worst = (0u32, 0.0f32);
    for ((&c, &g), &x) in cpu.iter().zip(&on_gpu).zip(&xs) {
        let d = key(c).abs_diff(key(g));
        if d > worst.0 {
            worst = (d, x);
        }
    }
    assert!(worst.0 <= 1, "erf differs by {} ulp at x = {} (cpu vs gpu)", worst.0, worst.1);
    let nan = Tensor::from_vec(vec![f32::NAN], &[1], gpu()).unwrap().erf().unwrap().to_vec::<f32>().unwrap();
    assert!(nan[0].is_nan());
}

#[test]
fn reductions_over_an_empty_dim_match_cpu() {
    // From host data (a realized buffer), which once generated `% 0u` on the GPU.
    for dims in [[3usize, 0, 4], [0, 5, 2]] {
        let x = Tensor::from_vec(Vec::<f32>::new(), &dims, Device::Cpu).unwrap();
        for axes in [&[1isize][..], &[0, 2], &[]] {
            let want_empty = axes.iter().any(|&a| dims[a as usize] == 0) || (axes.is_empty() && dims.contains(&0));
            type F = fn(&Tensor, &[isize]) -> Result<Tensor>;
            let ops: &[(&str, F)] = &[
                ("sum", |t, a| t.sum(a, false)),
                ("mean", |t, a| t.mean(a, true)),
                ("prod", |t, a| t.prod(a, false)),
                ("var", |t, a| t.var(a, 1, false)),
                ("logsumexp", |t, a| t.logsumexp(a, false)),
            ];
            for (name, f) in ops {
                if !want_empty && *name != "sum" {
                    continue;
                }
                same(&format!("{name} over {axes:?} of {dims:?}"), std::slice::from_ref(&x), 0.0, 0.0, |t| f(&t[0], axes));
            }
        }
    }
}

#[test]
fn pow_special_values_match_cpu() {
    let specials = [0.0f32, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, 2.5, 1e30, -1e30, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
    let n = specials.len();
    let mut a = vec![];
    let mut b = vec![];
    for &x in &specials {
        for &y in &specials {
            a.push(x);
            b.push(y);
        }
    }
    let a = Tensor::from_vec(a, &[n * n], Device::Cpu).unwrap();
    let b = Tensor::from_vec(b, &[n * n], Device::Cpu).unwrap();
    // exp2(b * log2(a)) on a GPU is a few ulp from libm: relative tolerance.
    same("pow of special values", &[a, b], 1e-5, 0.0, |t| t[0].pow(&t[1]));
}

#[test]
fn float_remainder_matches_cpu_for_infinite_divisors_and_huge_dividends() {
    let xs = [0.0f32, -0.0, 1.5, -1.5, 7.0, -7.0, 1e30, -1e30, 3.4e38, 16777217.0, f32::INFINITY, f32::NAN, 1e-40, -3e-39];
    let ys = [2.0f32, -2.0, 0.3, -0.3, 1e-3, 7.0, f32::INFINITY, f32::NEG_INFINITY, 0.0, 1e-40, 3.0e38, f32::NAN];
    let mut a = vec![];
    let mut b = vec![];
    for &x in &xs {
        for &y in &ys {
            a.push(x);
            b.push(y);
        }
    }
    let n = a.len();
    let a = Tensor::from_vec(a, &[n], Device::Cpu).unwrap();
    let b = Tensor::from_vec(b, &[n], Device::Cpu).unwrap();
    // fmod is exact, so the results are the CPU's bit for bit, except that a
    // GPU may flush subnormal results to zero (NVIDIA does): the tolerance is
    // the smallest normal f32.
    same("remainder", &[a, b], 0.0, f32::MIN_POSITIVE as f64, |t| t[0].rem(&t[1]));
}

#[test]
fn cumsum_and_scatter_add_along_long_dims_match_cpu() {
    // Longer than the 65,535 loop iterations llvmpipe allows one invocation,
    // and longer than one scan block, with several lines and a strided view.
    let mut rng = Rng::new(31);
    let long = 70_001;
    let x = randn(&mut rng, &[2, long], DType::F32);
    same("cumsum long f32", std::slice::from_ref(&x), 1e-5, 5e-3, |t| t[0].cumsum(1));
    let xt = transposed(&mut rng, &[3000, 3], DType::F32);
    same("cumsum strided", &[xt], 1e-5, 1e-4, |t| t[0].cumsum(0));
    let i = randn(&mut rng, &[long, 2], DType::I32);
    same("cumsum long i32", &[i], 0.0, 0.0, |t| t[0].cumsum(0));
    for dt in half_dtypes() {
        let h = Tensor::rand(&[5000], dt, Device::Cpu).unwrap();
        // Both accumulate in f32 and round each stored sum to the half type.
        same(&format!("cumsum {dt}"), &[h], 8e-3, 0.0, |t| t[0].cumsum(0));
    }
    let size = 37;
    let idx = Tensor::from_vec((0..long).map(|j| ((j * 7919) % size) as i32).collect::<Vec<_>>(), &[1, long], Device::Cpu).unwrap();
    let src = randn(&mut rng, &[1, long], DType::F32);
    let base = randn(&mut rng, &[1, size], DType::F32);
    same("scatter_add long f32", &[base.clone(), idx.clone(), src], 1e-5, 1e-3, |t| t[0].scatter_add(1, &t[1], &t[2]));
    let isrc = randn(&mut rng, &[1, long], DType::I32);
    let ibase = randn(&mut rng, &[1, size], DType::I32);
    same("scatter_add long i32", &[ibase, idx.clone(), isrc], 0.0, 0.0, |t| t[0].scatter_add(1, &t[1], &t[2]));
    let uidx = idx.to_dtype(DType::U32).unwrap();
    for dt in half_dtypes() {
        let hsrc = Tensor::rand(&[1, 300], dt, Device::Cpu).unwrap();
        let hb = Tensor::zeros(&[1, size], dt, Device::Cpu).unwrap();
        let ui = uidx.narrow(1, 0, 300).unwrap();
        same(&format!("scatter_add {dt}"), &[hb, ui, hsrc], 2e-2, 0.05, |t| t[0].scatter_add(1, &t[1], &t[2]));
    }
    // The embedding backward: a long index along dim 0 of a table.
    let table = randn(&mut rng, &[50, 8], DType::F32).requires_grad().unwrap();
    let ids = Tensor::from_vec((0..3000).map(|j: i32| j % 50).collect::<Vec<_>>(), &[3000], Device::Cpu).unwrap();
    let grad_on = |dev: Device| {
        let t = table.to_device(dev).unwrap().detach().requires_grad().unwrap();
        t.embedding(&ids.to_device(dev).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        t.grad().unwrap().to_f64_vec().unwrap()
    };
    assert_close(&grad_on(gpu()), &grad_on(Device::Cpu), 0.0, 1e-9, "embedding gradient");
}

#[test]
fn max_pooling_and_its_gradient_match_cpu_exactly() {
    let mut rng = Rng::new(31);
    // Values from a few levels, so windows hold ties; a NaN in some.
    let levels = |rng: &mut Rng, n: usize| -> Vec<f32> {
        (0..n).map(|i| if i % 37 == 5 { f32::NAN } else { (rng.normal() * 2.0).round() as f32 }).collect()
    };
    // (input, kernel, stride, padding): tiled, overlapping, padded, uneven.
    type Case = ([usize; 4], [usize; 2], Option<[usize; 2]>, [usize; 2]);
    // The tiled ones have rows of 9 and of 7 windows: the CPU's vector path
    // for 2x2 windows takes 8 at a time and then 4 at a time.
    let cases: [Case; 5] = [
        ([2, 3, 8, 18], [2, 2], None, [0, 0]),
        ([1, 2, 6, 14], [2, 2], None, [0, 0]),
        ([1, 2, 9, 8], [3, 3], Some([1, 1]), [1, 1]),
        ([2, 1, 7, 9], [3, 2], Some([2, 1]), [1, 1]),
        ([1, 2, 5, 5], [1, 1], None, [0, 0]),
    ];
    for (xd, k, s, p) in cases {
        let n: usize = xd.iter().product();
        let x = Tensor::from_vec(levels(&mut rng, n), &xd, Device::Cpu).unwrap();
        // A transposed view as the input, as well as the contiguous one.
        let xt = x.transpose(2, 3).unwrap().contiguous().unwrap().transpose(2, 3).unwrap();
        for (name, x) in [("contiguous", &x), ("transposed", &xt)] {
            let what = format!("max_pool2d {name} {xd:?} kernel {k:?} stride {s:?} padding {p:?}");
            same(&what, std::slice::from_ref(x), 0.0, 0.0, |t| t[0].max_pool2d(k, s, p));
            // The gradient of a weighted sum: each window's weight lands on its first maximum.
            let grad_on = |dev: Device| {
                let t = x.to_device(dev).unwrap().detach().requires_grad().unwrap();
                let y = t.max_pool2d(k, s, p).unwrap();
                let w = Tensor::arange(1.0, 1.0 + y.numel() as f64, 1.0, DType::F32, dev).unwrap().reshape_dims(y.dims()).unwrap();
                y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
                t.grad().unwrap().to_f64_vec().unwrap()
            };
            assert_eq!(grad_on(gpu()), grad_on(Device::Cpu), "{what}: gradient");
        }
        for dt in [DType::I32, DType::F16, DType::BF16] {
            let xi = x.isnan().unwrap().where_cond(0.0, &x).unwrap().to_dtype(dt).unwrap();
            same(&format!("max_pool2d {dt} {xd:?}"), &[xi], 0.0, 0.0, |t| t[0].max_pool2d(k, s, p));
        }
    }
}

#[test]
fn sin_and_cos_of_huge_arguments_match_cpu() {
    // Past 2^10 the GPU reduces with the bits of 2/pi (Payne-Hanek), as libm does.
    let mut xs: Vec<f32> = (0..4000).map(|i| (6.0f64 + i as f64 * 0.0195).exp() as f32).collect();
    xs.extend(xs.clone().iter().map(|x| -x));
    xs.extend([65535.99, 65536.0, 1e30, f32::MAX, 16777217.0, 3.1415927e20]);
    let n = xs.len();
    let x = Tensor::from_vec(xs, &[n], Device::Cpu).unwrap();
    same("sin of huge arguments", std::slice::from_ref(&x), 0.0, 2e-7, |t| t[0].sin());
    same("cos of huge arguments", &[x], 0.0, 2e-7, |t| t[0].cos());
}

/// f16 on every adapter: packed where it has SHADER_F16, else in 32-bit
/// words; either way rounded to f16 on every store, as the CPU rounds
/// (overflow to inf, subnormals, ties to even).
#[test]
fn f16_rounds_like_the_cpu_with_or_without_shader_f16() {
    let vals = vec![1.5f32, -2.25, 3.0, 65504.0, 40000.0, 6.0e-8, 1.0e-7, 2049.0, -0.0, 1.0 / 3.0];
    let x = Tensor::from_vec(vals, &[10], Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
    let y = Tensor::from_vec(vec![2.0f32; 10], &[10], Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
    let f = |x: &Tensor, y: &Tensor| -> Result<Tensor> { x.mul(y)?.add(1.0)?.mul(0.5)?.sum(&[0], true)?.add(x) };
    let want = f(&x, &y).unwrap().to_f64_vec().unwrap();
    let got = f(&x.to_device(gpu()).unwrap(), &y.to_device(gpu()).unwrap()).unwrap();
    assert_eq!(got.dtype(), DType::F16);
    assert_eq!(got.to_f64_vec().unwrap(), want, "f16 on gpu (shader-f16: {})", gpu_has_f16());
    let doubled = x.to_device(gpu()).unwrap().mul(2.0).unwrap().to_f64_vec().unwrap();
    assert_eq!(doubled, x.mul(2.0).unwrap().to_f64_vec().unwrap());
    assert!(doubled[3].is_infinite() && doubled[4].is_infinite(), "65504 * 2 and 40000 * 2 overflow f16: {doubled:?}");
}

/// A product whose fused epilogue reads the same buffer as one of its
/// operands: parameters that are slices of one flat buffer (as data-parallel
/// training's broadcast leaves them). The buffer is bound once.
#[test]
fn a_matmul_and_its_epilogue_may_read_one_buffer() {
    let mut rng = Rng::new(41);
    for (m, k, n) in [(32, 384, 96), (7, 33, 5), (64, 128, 256)] {
        let flat = randn(&mut rng, &[k * n + n + n * k], DType::F32);
        let x = randn(&mut rng, &[m, k], DType::F32);
        same(&format!("x @ w + b, w and b slices of one buffer ({m}x{k}x{n})"), &[x, flat], 1e-5, 1e-5, |t| {
            let w = t[1].narrow(0, 0, k * n)?.reshape_dims(&[k, n])?;
            let b = t[1].narrow(0, k * n, n)?;
            // And a transposed weight from the same buffer (Linear's layout).
            let wt = t[1].narrow(0, k * n + n, n * k)?.reshape_dims(&[n, k])?.t()?;
            let y = t[0].matmul(&w)?.add(&b)?.relu()?;
            let z = t[0].matmul(&wt)?.mul(&b)?.add(&t[1].narrow(0, 0, m * n)?.reshape_dims(&[m, n])?)?;
            Tensor::cat(&[&y, &z], 0)
        });
    }
}

/// More tensors than a kernel may bind (32 storage buffers on lavapipe, 8
/// in WebGPU's defaults): a sum of 100 values, a product of many with a
/// shared factor and a cat of 100 parts split into kernels the device can
/// run, with the CPU's results.
#[test]
fn graphs_reading_more_buffers_than_a_kernel_binds_are_split() {
    let mut rng = Rng::new(41);
    let xs: Vec<Tensor> = (0..100).map(|i| randn(&mut rng, &[3 + i % 4, 5], DType::F32).narrow(0, 0, 3).unwrap()).collect();
    same("sum of 100", &xs, 1e-5, 1e-5, |t| {
        let mut acc = t[0].clone();
        for x in &t[1..] {
            acc = acc.add(x)?;
        }
        acc.mul(0.5)
    });
    same("cat of 100", &xs, 0.0, 0.0, |t| Tensor::cat(&t.iter().collect::<Vec<_>>(), 1));
    same("sum of 100 reduced", &xs, 1e-5, 1e-5, |t| {
        let mut acc = t[0].clone();
        for x in &t[1..] {
            acc = acc.add(&x.sqr()?)?;
        }
        acc.sum(&[1], false)
    });
}

/// [`same`] for several results realized together (one plan), each
/// compared with the CPU's.
fn same_all(what: &str, inputs: &[Tensor], rtol: f64, atol: f64, f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Vec<voltaic::KernelSummary> {
    let want = f(inputs).unwrap_or_else(|e| panic!("{what} on cpu: {e}"));
    let got = f(&to_gpu(inputs)).unwrap_or_else(|e| panic!("{what} on gpu: {e}"));
    let plan = voltaic::inspect(&got.iter().collect::<Vec<_>>());
    Tensor::realize_all(&got.iter().collect::<Vec<_>>()).unwrap_or_else(|e| panic!("{what} on gpu: {e}"));
    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!((g.dims(), g.dtype()), (w.dims(), w.dtype()), "{what}: result {j}");
        assert_close(&g.to_f64_vec().expect("gpu read"), &w.to_f64_vec().expect("cpu read"), rtol, atol, &format!("{what}: result {j} (gpu vs cpu)"));
    }
    plan
}

#[test]
fn results_of_one_shape_computed_in_one_kernel_match_cpu() {
    let mut rng = Rng::new(31);
    // An Adam update (weight, both moments from one gradient): one kernel
    // with three outputs on the GPU, at odd sizes, a 2-D shape, and the
    // vec4 size; the gradient also read transposed.
    for dims in [vec![37], vec![300, 19], vec![70_000]] {
        let ins: Vec<Tensor> = (0..4).map(|_| randn(&mut rng, &dims, DType::F32)).collect();
        let ins = [ins[0].clone(), ins[1].clone(), ins[2].abs().unwrap(), ins[3].clone()];
        let plan = same_all(&format!("adam {dims:?}"), &ins, 1e-5, 1e-6, |t| {
            let m = t[1].mul(0.9)?.add(&t[3].mul(0.1)?)?;
            let v = t[2].mul(0.999)?.add(&t[3].sqr()?.mul(0.001)?)?;
            let w = t[0].mul(0.99)?.sub(&m.div(&v.sqrt()?.add(1e-8)?)?.mul(0.01)?)?;
            Ok(vec![w, m, v])
        });
        assert_eq!(plan.len(), 1, "adam {dims:?}: {plan:?}");
    }
    // Outputs of several dtypes (an f32 master weight and its f16/bf16
    // copy), a shared intermediate that is not stored, a broadcast row.
    for dt in half_dtypes() {
        let (x, y, r) = (randn(&mut rng, &[33, 70], DType::F32), randn(&mut rng, &[33, 70], DType::F32), randn(&mut rng, &[1, 70], DType::F32));
        same_all(&format!("{dt} copies"), &[x, y, r], 1e-2, 1e-2, |t| {
            let e = t[0].tanh()?.mul(&t[2])?;
            let a = e.add(&t[1])?;
            Ok(vec![a.clone(), a.to_dtype(dt)?, e.sub(&t[1])?.to_dtype(dt)?])
        });
    }
    // Integer and bool results beside float ones; a read of a sibling's
    // result transposed (which must not join it).
    let (a, b) = (randn(&mut rng, &[24, 24], DType::F32), randn(&mut rng, &[24, 24], DType::F32));
    same_all("mixed types and a transposed read", &[a, b], 1e-6, 1e-6, |t| {
        let e = t[0].exp()?;
        Ok(vec![e.clone(), t[0].gt(&t[1])?, t[1].mul(100.0)?.to_dtype(DType::I32)?, e.t()?.add(&t[1])?])
    });
    // A step that keeps the old values where `skip` is set, both ways.
    for skip in [false, true] {
        let (w, g) = (randn(&mut rng, &[129], DType::F32), randn(&mut rng, &[129], DType::F32));
        let s = Tensor::from_vec(vec![skip], &[], Device::Cpu).unwrap();
        same_all(&format!("skip {skip}"), &[w, g, s], 1e-6, 1e-6, |t| {
            let m = t[1].mul(0.1)?;
            let w = t[0].sub(&m)?;
            Ok(vec![t[2].where_cond(&t[0], &w)?, t[2].where_cond(&t[1], &m)?])
        });
    }
}
