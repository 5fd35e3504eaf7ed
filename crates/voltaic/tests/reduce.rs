//! Reduction values against naive f64 loops written here: sum, mean, prod,
//! max, min, argmax, argmin, var, std, logsumexp over any axes (negative, all,
//! keepdim or not), softmax, log_softmax and cumsum along every dim, on
//! contiguous, strided and fused inputs, including empty ones.

mod common;

use common::*;
use voltaic::{DType, Device, Tensor};

type Res = voltaic::Result<()>;
const CPU: Device = Device::Cpu;

/// The values of each output group of reducing `x` (shape `dims`) over
/// `axes` (normalised, sorted), in row-major order of the reduced dims; and
/// the output shape with the reduced dims kept as 1.
fn groups(x: &[f64], dims: &[usize], axes: &[usize]) -> (Vec<usize>, Vec<Vec<f64>>) {
    let out: Vec<usize> = dims.iter().enumerate().map(|(d, &n)| if axes.contains(&d) { 1 } else { n }).collect();
    let mut g = vec![vec![]; numel(&out)];
    for (i, &v) in x.iter().enumerate() {
        let mut idx = unravel(i, dims);
        for &a in axes {
            idx[a] = 0;
        }
        g[ravel(&idx, &out)].push(v);
    }
    (out, g)
}

fn out_dims(dims: &[usize], axes: &[usize], keepdim: bool) -> Vec<usize> {
    (0..dims.len()).filter_map(|d| if axes.contains(&d) { keepdim.then_some(1) } else { Some(dims[d]) }).collect()
}

/// A random set of axes of a rank-`r` tensor, normalised, and a spelling of it
/// with some axes negative (empty spelling = all axes).
fn random_axes(rng: &mut Rng, r: usize) -> (Vec<usize>, Vec<isize>) {
    if r == 0 || rng.below(6) == 0 {
        return ((0..r).collect(), vec![]);
    }
    let mut axes: Vec<usize> = (0..r).filter(|_| rng.below(2) == 0).collect();
    if axes.is_empty() {
        axes.push(rng.below(r));
    }
    let mut spelled: Vec<isize> = axes.iter().map(|&a| if rng.below(2) == 0 { a as isize } else { a as isize - r as isize }).collect();
    // Order does not matter.
    if rng.below(2) == 0 {
        spelled.reverse();
    }
    (axes, spelled)
}

fn sum_abs(g: &[f64]) -> f64 {
    g.iter().map(|v| v.abs()).sum()
}
fn max_ref(g: &[f64]) -> f64 {
    g.iter().fold(f64::NEG_INFINITY, |m, &v| {
        if v.is_nan() || m.is_nan() {
            f64::NAN
        } else if v > m {
            v
        } else {
            m
        }
    })
}
fn min_ref(g: &[f64]) -> f64 {
    g.iter().fold(f64::INFINITY, |m, &v| {
        if v.is_nan() || m.is_nan() {
            f64::NAN
        } else if v < m {
            v
        } else {
            m
        }
    })
}
fn var_ref(g: &[f64], correction: usize) -> f64 {
    let n = g.len() as f64;
    let mu = g.iter().sum::<f64>() / n;
    let ss: f64 = g.iter().map(|v| (v - mu) * (v - mu)).sum();
    ss / (n - correction as f64).max(0.0)
}
fn lse_ref(g: &[f64]) -> f64 {
    let m = max_ref(g);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + g.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
}

#[test]
fn reductions_over_random_axes_match_reference() -> Res {
    let mut rng = Rng::new(11);
    let mut shapes: Vec<Vec<usize>> = vec![vec![1031], vec![7, 13], vec![1, 1, 1], vec![], vec![2, 1, 3, 5]];
    for _ in 0..14 {
        shapes.push(rng.shape_nz(1, 4, 1500));
    }
    for dims in &shapes {
        for dtype in [DType::F32, DType::F64, DType::I32] {
            let (x, xv) = randn(dims, dtype);
            for _ in 0..3 {
                let (axes, spelled) = random_axes(&mut rng, dims.len());
                let keepdim = rng.below(2) == 0;
                let (_, gs) = groups(&xv, dims, &axes);
                let od = out_dims(dims, &axes, keepdim);
                let ctx = format!("{dtype} {dims:?} axes {spelled:?} keepdim {keepdim}");
                let float = dtype.to_float();
                let check = |name: &str, t: Tensor, want_dt: DType, want: Vec<f64>, scale: Vec<f64>| -> Res {
                    let (rt, at) = tol(want_dt);
                    assert_eq!(t.dims(), &od[..], "{name} shape, {ctx}");
                    assert_eq!(t.dtype(), want_dt, "{name} dtype, {ctx}");
                    let got = t.to_f64_vec()?;
                    for i in 0..want.len() {
                        let (g, w) = (got[i], want[i]);
                        let tol = rt * scale[i] + at;
                        assert!((g - w).abs() <= tol || (g.is_nan() && w.is_nan()), "{name} {ctx} output {i}: {g} vs {w}");
                    }
                    Ok(())
                };
                let sums: Vec<f64> = gs.iter().map(|g| g.iter().sum()).collect();
                let abs: Vec<f64> = gs.iter().map(|g| sum_abs(g)).collect();
                check("sum", x.sum(&spelled, keepdim)?, dtype, sums.clone(), abs.clone())?;
                let means: Vec<f64> = gs.iter().map(|g| g.iter().sum::<f64>() / g.len() as f64).collect();
                let mean_scale: Vec<f64> = gs.iter().map(|g| sum_abs(g) / g.len() as f64).collect();
                check("mean", x.mean(&spelled, keepdim)?, float, means, mean_scale)?;
                let maxs: Vec<f64> = gs.iter().map(|g| max_ref(g)).collect();
                let mins: Vec<f64> = gs.iter().map(|g| min_ref(g)).collect();
                check("max", x.max(&spelled, keepdim)?, dtype, maxs.clone(), maxs.iter().map(|v| v.abs()).collect())?;
                check("min", x.min(&spelled, keepdim)?, dtype, mins.clone(), mins.iter().map(|v| v.abs()).collect())?;
                for c in [0, 1] {
                    let vars: Vec<f64> = gs.iter().map(|g| var_ref(g, c)).collect();
                    // The two-pass variance in the tensor's precision: relative to sum of squares.
                    let scale: Vec<f64> =
                        gs.iter().map(|g| 4.0 * g.iter().map(|v| v * v).sum::<f64>() / (g.len() as f64 - c as f64).max(1.0)).collect();
                    check("var", x.var(&spelled, c, keepdim)?, float, vars.clone(), scale.clone())?;
                    let stds: Vec<f64> = vars.iter().map(|v| v.sqrt()).collect();
                    let sscale: Vec<f64> =
                        scale.iter().zip(&stds).map(|(s, sd)| if *sd > 1e-3 { s / sd } else { s.sqrt() * 1e3 }).collect();
                    check("std", x.std(&spelled, c, keepdim)?, float, stds, sscale)?;
                }
                if dtype != DType::I32 {
                    let lses: Vec<f64> = gs.iter().map(|g| lse_ref(g)).collect();
                    check("logsumexp", x.logsumexp(&spelled, keepdim)?, float, lses.clone(), lses.iter().map(|v| v.abs() + 1.0).collect())?;
                    // prod of values near 1, so nothing overflows.
                    let (y, yv) = tensor(&xv.iter().map(|v| 1.0 + 0.2 * v).collect::<Vec<_>>(), dims, dtype);
                    let (_, ygs) = groups(&yv, dims, &axes);
                    let prods: Vec<f64> = ygs.iter().map(|g| g.iter().product()).collect();
                    check("prod", y.prod(&spelled, keepdim)?, dtype, prods.clone(), prods.iter().map(|v| v.abs() * 10.0).collect())?;
                } else {
                    // Integer products of -1, 1 and a few 2s (exact in i32).
                    let pv: Vec<f64> = (0..xv.len())
                        .map(|i| {
                            if i % 17 == 3 {
                                2.0
                            } else if xv[i] < 0.0 {
                                -1.0
                            } else {
                                1.0
                            }
                        })
                        .collect();
                    let (y, yv) = tensor(&pv, dims, DType::I32);
                    let (_, ygs) = groups(&yv, dims, &axes);
                    let prods: Vec<f64> = ygs.iter().map(|g| g.iter().product()).collect();
                    if prods.iter().all(|p| p.abs() < 2f64.powi(31)) {
                        check("prod", y.prod(&spelled, keepdim)?, DType::I32, prods, vec![0.0; ygs.len()])?;
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn argmax_argmin_along_each_dim() -> Res {
    let mut rng = Rng::new(12);
    let mut shapes: Vec<Vec<usize>> = vec![vec![1031], vec![13, 7], vec![1, 5, 1], vec![]];
    for _ in 0..8 {
        shapes.push(rng.shape_nz(1, 4, 1500));
    }
    for dims in &shapes {
        for dtype in [DType::F32, DType::F64, DType::I32] {
            // i32 data has many ties: the first index must win.
            let (x, xv) = randn(dims, dtype);
            let r = dims.len();
            let mut dim_list: Vec<Option<isize>> = (0..r as isize).map(Some).collect();
            dim_list.extend((1..=r as isize).map(|d| Some(-d)));
            dim_list.push(None);
            for dim in dim_list {
                for keepdim in [false, true] {
                    let (axes, od) = match dim {
                        Some(d) => {
                            let a = if d < 0 { (d + r as isize) as usize } else { d as usize };
                            (vec![a], out_dims(dims, &[a], keepdim))
                        }
                        None => ((0..r).collect(), if keepdim { vec![1; r] } else { vec![] }),
                    };
                    let (_, gs) = groups(&xv, dims, &axes);
                    let first = |g: &Vec<f64>, better: fn(f64, f64) -> bool| {
                        let mut bi = 0;
                        for (i, &v) in g.iter().enumerate() {
                            if better(v, g[bi]) {
                                bi = i;
                            }
                        }
                        bi as f64
                    };
                    let want_max: Vec<f64> = gs.iter().map(|g| first(g, |a, b| a > b)).collect();
                    let want_min: Vec<f64> = gs.iter().map(|g| first(g, |a, b| a < b)).collect();
                    let am = x.argmax(dim, keepdim)?;
                    let an = x.argmin(dim, keepdim)?;
                    let ctx = format!("{dtype} {dims:?} dim {dim:?} keepdim {keepdim}");
                    assert_eq!(am.dtype(), DType::I32, "{ctx}");
                    assert_eq!(am.dims(), &od[..], "argmax {ctx}");
                    assert_eq!(an.dims(), &od[..], "argmin {ctx}");
                    assert_same(&am.to_f64_vec()?, &want_max, &format!("argmax {ctx}"));
                    assert_same(&an.to_f64_vec()?, &want_min, &format!("argmin {ctx}"));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn nan_propagates_through_max_min_and_wins_argmax() -> Res {
    let nan = f64::NAN;
    for dtype in [DType::F32, DType::F64] {
        // NaN first, in the middle, last, and a row without NaN; long rows cross blocks.
        let n = 2500;
        let mut v = vec![0.0; 4 * n];
        for (i, x) in v.iter_mut().enumerate() {
            *x = ((i * 7919) % 1000) as f64 / 10.0;
        }
        v[0] = nan;
        v[n + 1700] = nan;
        v[n + 2400] = nan;
        v[3 * n - 1] = nan;
        let (t, _) = tensor(&v, &[4, n], dtype);
        assert_same(&t.max(&[1], false)?.to_f64_vec()?, &[nan, nan, nan, 99.9].map(|w| round_to(w, dtype)), &format!("max {dtype}"));
        assert_same(&t.min(&[-1], false)?.to_f64_vec()?, &[nan, nan, nan, 0.0], &format!("min {dtype}"));
        assert_eq!(t.argmax(Some(1), false)?.to_vec::<i32>()?[..3], [0, 1700, (n - 1) as i32]);
        assert_eq!(t.argmin(Some(1), false)?.to_vec::<i32>()?[..3], [0, 1700, (n - 1) as i32]);
        assert!(t.max(&[], false)?.item_f64()?.is_nan());
        assert_eq!(t.argmax(None, false)?.item::<i32>()?, 0);
        // sum and mean propagate NaN as well.
        assert!(t.sum(&[1], false)?.to_f64_vec()?[..3].iter().all(|s| s.is_nan()));
        // Infinities are ordinary values.
        let (u, _) = tensor(&[1.0, f64::INFINITY, -f64::INFINITY, 3.0], &[4], dtype);
        assert_eq!(u.max(&[0], false)?.item_f64()?, f64::INFINITY);
        assert_eq!(u.min(&[0], false)?.item_f64()?, f64::NEG_INFINITY);
        assert_eq!(u.argmax(None, false)?.item::<i32>()?, 1);
        assert_eq!(u.argmin(None, false)?.item::<i32>()?, 2);
        assert!(u.sum(&[0], false)?.item_f64()?.is_nan());
    }
    Ok(())
}

#[test]
fn integer_and_bool_reductions() -> Res {
    let i = Tensor::from_vec(vec![3i32, -7, 3, 9, 9, -7], &[2, 3], CPU)?;
    assert_eq!(i.sum(&[1], false)?.to_vec::<i32>()?, vec![-1, 11]);
    assert_eq!(i.sum(&[0], true)?.dims(), &[1, 3]);
    assert_eq!(i.sum(&[0], true)?.to_vec::<i32>()?, vec![12, 2, -4]);
    assert_eq!(i.prod(&[], false)?.item::<i32>()?, 3 * -7 * 3 * 9 * 9 * -7);
    assert_eq!(i.max(&[0], false)?.to_vec::<i32>()?, vec![9, 9, 3]);
    assert_eq!(i.min(&[1], false)?.to_vec::<i32>()?, vec![-7, -7]);
    // Ties: the first index.
    assert_eq!(i.argmax(None, false)?.item::<i32>()?, 3);
    assert_eq!(i.argmin(None, false)?.item::<i32>()?, 1);
    assert_eq!(i.argmax(Some(1), false)?.to_vec::<i32>()?, vec![0, 0]);
    let m = i.mean(&[1], false)?;
    assert_eq!(m.dtype(), DType::F32);
    assert_close(&m.to_f64_vec()?, &[-1.0 / 3.0, 11.0 / 3.0], 1e-6, 0.0, "mean of i32");

    // Integer sums and products wrap, as the elementwise integer ops do.
    let w = Tensor::from_vec(vec![i32::MAX, 1, i32::MIN, -1], &[2, 2], CPU)?;
    assert_eq!(w.sum(&[1], false)?.to_vec::<i32>()?, vec![i32::MIN, i32::MAX]);
    let p = Tensor::from_vec(vec![65536i32, 65536, 3, 1 << 30, 1 << 20, 1 << 16], &[2, 3], CPU)?;
    assert_eq!(p.prod(&[1], false)?.to_vec::<i32>()?, vec![0, 0]);
    let p = Tensor::from_vec(vec![123456789i32, 987654321, 1000003], &[3], CPU)?;
    let want = 123456789i32.wrapping_mul(987654321).wrapping_mul(1000003);
    assert_eq!(p.prod(&[0], false)?.item::<i32>()?, want);
    let u = Tensor::from_vec(vec![u32::MAX, 2, 7], &[3], CPU)?;
    assert_eq!(u.sum(&[0], false)?.item::<u32>()?, 8);
    assert_eq!(u.max(&[0], false)?.item::<u32>()?, u32::MAX);
    assert_eq!(u.argmin(None, false)?.item::<i32>()?, 1);

    // Bool sums count (as i32), max/min work, argmax finds the first true.
    let b = Tensor::from_vec(vec![false, true, true, false, false, false], &[2, 3], CPU)?;
    let s = b.sum(&[1], false)?;
    assert_eq!(s.dtype(), DType::I32);
    assert_eq!(s.to_vec::<i32>()?, vec![2, 0]);
    assert_eq!(b.sum_all()?.item::<i32>()?, 2);
    assert_eq!(b.argmax(Some(1), false)?.to_vec::<i32>()?, vec![1, 0]);
    assert_eq!(b.max(&[1], false)?.to_f64_vec()?, vec![1.0, 0.0]);
    assert_eq!(b.mean(&[], false)?.item::<f32>()?, 2.0 / 6.0);
    Ok(())
}

#[test]
fn empty_reductions() -> Res {
    for dtype in [DType::F32, DType::F64, DType::I32] {
        let e = Tensor::zeros(&[0], dtype, CPU)?;
        assert_eq!(e.sum(&[], false)?.to_f64_vec()?, vec![0.0]);
        assert_eq!(e.sum(&[0], true)?.dims(), &[1]);
        assert_eq!(e.prod(&[0], false)?.to_f64_vec()?, vec![1.0]);
        assert!(e.mean(&[], false)?.item_f64()?.is_nan());
        assert!(e.max(&[], false).is_err());
        assert!(e.argmax(None, false).is_err());
        assert_eq!(e.cumsum(0)?.dims(), &[0]);

        let e = Tensor::zeros(&[3, 0, 2], dtype, CPU)?;
        assert_eq!(e.sum(&[1], false)?.dims(), &[3, 2]);
        assert_eq!(e.sum(&[1], false)?.to_f64_vec()?, vec![0.0; 6]);
        assert_eq!(e.sum(&[-2, 0], true)?.to_f64_vec()?, vec![0.0; 2]);
        assert_eq!(e.prod(&[1], false)?.to_f64_vec()?, vec![1.0; 6]);
        assert!(e.mean(&[1], false)?.to_f64_vec()?.iter().all(|v| v.is_nan()));
        // Reducing a non-empty dim of an empty tensor gives an empty result.
        for t in [e.sum(&[0], false)?, e.max(&[2], false)?, e.min(&[0, 2], true)?, e.argmax(Some(2), false)?, e.mean(&[0], false)?] {
            assert_eq!(t.numel(), 0);
            assert_eq!(t.to_f64_vec()?, Vec::<f64>::new());
        }
        assert_eq!(e.max(&[2], false)?.dims(), &[3, 0]);
        // max over an empty dim has no identity.
        assert!(e.max(&[1], false).is_err());
        assert!(e.argmin(Some(1), false).is_err());
        assert_eq!(e.cumsum(1)?.dims(), &[3, 0, 2]);
        assert_eq!(e.cumsum(2)?.to_f64_vec()?, Vec::<f64>::new());
    }
    // Softmax-like ops of empty tensors are empty; logsumexp of nothing is log(0) = -inf.
    let e = Tensor::zeros(&[0, 3], DType::F32, CPU)?;
    for d in [0, 1, -1] {
        assert_eq!(e.softmax(d)?.dims(), &[0, 3]);
        assert_eq!(e.log_softmax(d)?.dims(), &[0, 3]);
        assert_eq!(e.softmax(d)?.to_f64_vec()?, Vec::<f64>::new());
    }
    assert_eq!(e.logsumexp(&[1], false)?.dims(), &[0]);
    let l = e.logsumexp(&[0], false)?;
    assert_eq!(l.dims(), &[3]);
    assert_eq!(l.to_f64_vec()?, vec![f64::NEG_INFINITY; 3]);
    Ok(())
}

fn softmax_ref(x: &[f64], dims: &[usize], d: usize, log: bool) -> Vec<f64> {
    let (_, gs) = groups(x, dims, &[d]);
    let od: Vec<usize> = dims.iter().enumerate().map(|(k, &n)| if k == d { 1 } else { n }).collect();
    (0..x.len())
        .map(|i| {
            let mut idx = unravel(i, dims);
            idx[d] = 0;
            let g = &gs[ravel(&idx, &od)];
            let m = max_ref(g);
            let z: f64 = g.iter().map(|v| (v - m).exp()).sum();
            if log {
                x[i] - m - z.ln()
            } else {
                (x[i] - m).exp() / z
            }
        })
        .collect()
}

#[test]
fn softmax_and_log_softmax_along_each_dim() -> Res {
    let mut rng = Rng::new(13);
    let mut shapes: Vec<Vec<usize>> = vec![vec![1031], vec![7, 13], vec![1, 3, 1], vec![5, 1]];
    for _ in 0..8 {
        shapes.push(rng.shape_nz(1, 4, 1500));
    }
    for dims in &shapes {
        for dtype in [DType::F32, DType::F64] {
            let (_, raw) = randn(dims, DType::F64);
            // Scaled up so that stability matters (exp(300) overflows f32).
            let scale = if rng.below(2) == 0 { 3.0 } else { 300.0 };
            let (x, xv) = tensor(&raw.iter().map(|v| v * scale).collect::<Vec<_>>(), dims, dtype);
            let r = dims.len();
            for d in 0..r {
                for spelled in [d as isize, d as isize - r as isize] {
                    let s = x.softmax(spelled)?;
                    let ls = x.log_softmax(spelled)?;
                    assert_eq!(s.dims(), &dims[..]);
                    assert_eq!(ls.dtype(), dtype);
                    let ctx = format!("{dtype} {dims:?} dim {spelled} scale {scale}");
                    let (rt, at) = tol(dtype);
                    assert_close(&s.to_f64_vec()?, &softmax_ref(&xv, dims, d, false), rt, at * 0.1, &format!("softmax {ctx}"));
                    let want = softmax_ref(&xv, dims, d, true);
                    let got = ls.to_f64_vec()?;
                    for i in 0..got.len() {
                        // log_softmax subtracts numbers of size |x|: tolerance relative to them.
                        let t = rt * (xv[i].abs() + want[i].abs() + 1.0);
                        assert!((got[i] - want[i]).abs() <= t, "log_softmax {ctx} element {i}: {} vs {}", got[i], want[i]);
                    }
                }
            }
        }
    }
    // -inf entries get probability 0; integer input gives f32.
    let (x, _) = tensor(&[f64::NEG_INFINITY, 0.0, 0.0, f64::NEG_INFINITY], &[4], DType::F32);
    assert_eq!(x.softmax(0)?.to_vec::<f32>()?, vec![0.0, 0.5, 0.5, 0.0]);
    let ls = x.log_softmax(0)?.to_vec::<f32>()?;
    assert_eq!(ls[0], f32::NEG_INFINITY);
    assert!((ls[1] + std::f32::consts::LN_2).abs() < 1e-6);
    let i = Tensor::from_vec(vec![1i32, 2, 3], &[3], CPU)?;
    let s = i.softmax(-1)?;
    assert_eq!(s.dtype(), DType::F32);
    let z = 1f64.exp() + 2f64.exp() + 3f64.exp();
    assert_close(&s.to_f64_vec()?, &[1f64.exp() / z, 2f64.exp() / z, 3f64.exp() / z], 1e-6, 1e-7, "softmax of i32");
    // A 0-d tensor: softmax is 1, log_softmax 0.
    let s0 = Tensor::scalar(5.0f32, CPU)?;
    assert_eq!(s0.softmax(0)?.item::<f32>()?, 1.0);
    assert_eq!(s0.log_softmax(-1)?.item::<f32>()?, 0.0);
    assert!(x.softmax(1).is_err());
    Ok(())
}

fn cumsum_ref(x: &[f64], dims: &[usize], d: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; x.len()];
    let mut abs = vec![0.0; x.len()];
    let st = strides(dims);
    for i in 0..x.len() {
        let idx = unravel(i, dims);
        let (mut s, mut a) = (x[i], x[i].abs());
        if idx[d] > 0 {
            s += out[i - st[d]];
            a += abs[i - st[d]];
        }
        out[i] = s;
        abs[i] = a;
    }
    (out, abs)
}

#[test]
fn cumsum_along_each_dim() -> Res {
    let mut rng = Rng::new(14);
    let mut shapes: Vec<Vec<usize>> = vec![vec![1031], vec![13, 7], vec![1, 4, 1], vec![3, 0, 2]];
    for _ in 0..8 {
        shapes.push(rng.shape(4, 1500));
    }
    for dims in &shapes {
        for dtype in [DType::F32, DType::F64, DType::I32] {
            let (x, xv) = randn(dims, dtype);
            let r = dims.len();
            if r == 0 {
                assert_same(&x.cumsum(0)?.to_f64_vec()?, &xv, "cumsum of 0-d");
                continue;
            }
            for d in 0..r {
                for spelled in [d as isize, d as isize - r as isize] {
                    let c = x.cumsum(spelled)?;
                    assert_eq!(c.dims(), &dims[..]);
                    assert_eq!(c.dtype(), dtype);
                    let (want, abs) = cumsum_ref(&xv, dims, d);
                    let got = c.to_f64_vec()?;
                    let (rt, at) = tol(dtype);
                    for i in 0..got.len() {
                        assert!(
                            (got[i] - want[i]).abs() <= rt * abs[i] + at,
                            "cumsum {dtype} {dims:?} dim {spelled} element {i}: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
    // Bool counts as i32; integers wrap.
    let b = Tensor::from_vec(vec![true, false, true, true], &[2, 2], CPU)?;
    let c = b.cumsum(0)?;
    assert_eq!(c.dtype(), DType::I32);
    assert_eq!(c.to_vec::<i32>()?, vec![1, 0, 2, 1]);
    assert_eq!(b.cumsum(1)?.to_vec::<i32>()?, vec![1, 1, 1, 2]);
    let w = Tensor::from_vec(vec![i32::MAX, 1, 1], &[3], CPU)?;
    assert_eq!(w.cumsum(0)?.to_vec::<i32>()?, vec![i32::MAX, i32::MIN, i32::MIN + 1]);
    assert!(w.cumsum(1).is_err());
    Ok(())
}

#[test]
fn reductions_of_strided_broadcast_and_fused_inputs() -> Res {
    let mut rng = Rng::new(15);
    for _ in 0..12 {
        let dims = rng.shape_nz(2, 4, 1200);
        let r = dims.len();
        let (x, xv) = randn(&dims, DType::F32);
        // A permuted view, a step-2 slice of it, and an expanded input.
        let perm = rng.perm(r);
        let pdims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let pidx: Vec<isize> = perm.iter().map(|&p| p as isize).collect();
        let xp = x.permute(&pidx)?;
        let pv: Vec<f64> = (0..numel(&pdims))
            .map(|i| {
                let idx = unravel(i, &pdims);
                let mut src = vec![0; r];
                for k in 0..r {
                    src[perm[k]] = idx[k];
                }
                xv[ravel(&src, &dims)]
            })
            .collect();
        let (axes, spelled) = random_axes(&mut rng, r);
        let keepdim = rng.below(2) == 0;

        // sum of the permuted view
        let (_, gs) = groups(&pv, &pdims, &axes);
        let want: Vec<f64> = gs.iter().map(|g| g.iter().sum()).collect();
        let scale: Vec<f64> = gs.iter().map(|g| sum_abs(g)).collect();
        let got = xp.sum(&spelled, keepdim)?.to_f64_vec()?;
        for i in 0..want.len() {
            assert!((got[i] - want[i]).abs() <= 1e-5 * scale[i] + 1e-6, "sum of permuted {dims:?} perm {perm:?} axes {spelled:?}");
        }
        // max of (2 * permuted + 1) as a fused prologue, and of its step-2 slice along dim 0
        let y = xp.mul(2.0)?.add(1.0)?;
        let yv: Vec<f64> = pv.iter().map(|v| round_f32(round_f32(2.0 * v) + 1.0)).collect();
        let (_, gs) = groups(&yv, &pdims, &axes);
        assert_same(&y.max(&spelled, keepdim)?.to_f64_vec()?, &gs.iter().map(|g| max_ref(g)).collect::<Vec<_>>(), "max of fused");
        let ys = y.slice(0, 0, pdims[0] as isize, 2)?;
        let sdims: Vec<usize> = ys.dims().to_vec();
        let sv: Vec<f64> = (0..numel(&sdims))
            .map(|i| {
                let mut idx = unravel(i, &sdims);
                idx[0] *= 2;
                yv[ravel(&idx, &pdims)]
            })
            .collect();
        let (_, gs) = groups(&sv, &sdims, &axes);
        assert_same(&ys.min(&spelled, keepdim)?.to_f64_vec()?, &gs.iter().map(|g| min_ref(g)).collect::<Vec<_>>(), "min of sliced fused");
        let want_sum: Vec<f64> = gs.iter().map(|g| g.iter().sum()).collect();
        let sc: Vec<f64> = gs.iter().map(|g| sum_abs(g)).collect();
        let got = ys.sum(&spelled, keepdim)?.to_f64_vec()?;
        for i in 0..want_sum.len() {
            assert!((got[i] - want_sum[i]).abs() <= 1e-5 * sc[i] + 1e-6, "sum of sliced fused {dims:?}");
        }

        // An expanded input: [1, d1, ...] -> [5, d1, ...]; each output counts the row 5 times where reduced.
        let mut one = dims.clone();
        one[0] = 1;
        let x1 = x.narrow(0, 0, 1)?;
        let mut big = dims.clone();
        big[0] = 5;
        let xe = x1.expand(&big.iter().map(|&d| d as isize).collect::<Vec<_>>())?;
        let ev: Vec<f64> = (0..numel(&big))
            .map(|i| {
                let mut idx = unravel(i, &big);
                idx[0] = 0;
                xv[ravel(&idx, &dims)]
            })
            .collect();
        let (_, gs) = groups(&ev, &big, &axes);
        let want: Vec<f64> = gs.iter().map(|g| g.iter().sum()).collect();
        let scale: Vec<f64> = gs.iter().map(|g| sum_abs(g)).collect();
        let got = xe.sum(&spelled, keepdim)?.to_f64_vec()?;
        for i in 0..want.len() {
            assert!(
                (got[i] - want[i]).abs() <= 1e-5 * scale[i] + 1e-6,
                "sum of expanded {big:?} axes {spelled:?}: {} vs {}",
                got[i],
                want[i]
            );
        }
        let got = xe.argmax(Some(-1), false)?.to_f64_vec()?;
        let (_, gs) = groups(&ev, &big, &[r - 1]);
        for (i, g) in gs.iter().enumerate() {
            let mut bi = 0;
            for (j, &v) in g.iter().enumerate() {
                if v > g[bi] {
                    bi = j;
                }
            }
            assert_eq!(got[i], bi as f64, "argmax of expanded");
        }
    }
    // A reduction of a reduction, and of a broadcast constant.
    let (x, xv) = randn(&[7, 13], DType::F64);
    let m = x.sum(&[1], true)?.max(&[0], false)?;
    let want = (0..7).map(|i| xv[i * 13..(i + 1) * 13].iter().sum::<f64>()).fold(f64::NEG_INFINITY, f64::max);
    assert!((m.to_f64_vec()?[0] - want).abs() < 1e-12);
    let f = Tensor::full(&[3, 1031], 0.5, DType::F32, CPU)?;
    assert_eq!(f.sum(&[1], false)?.to_vec::<f32>()?, vec![515.5; 3]);
    assert_eq!(f.mean(&[], false)?.item::<f32>()?, 0.5);
    Ok(())
}

#[test]
fn reduce_axis_errors() -> Res {
    let (x, _) = randn(&[3, 4], DType::F32);
    assert!(x.sum(&[2], false).is_err());
    assert!(x.sum(&[-3], false).is_err());
    assert!(x.sum(&[0, -2], false).is_err(), "repeated axis");
    assert!(x.argmax(Some(2), false).is_err());
    assert!(x.softmax(-3).is_err());
    assert!(x.cumsum(2).is_err());
    Ok(())
}

#[test]
fn large_sums_are_accurate() -> Res {
    // 100k elements (multiple blocks and threads); f32 input, reference in f64.
    let (x, xv) = randn(&[100_002], DType::F32);
    let got = x.sum(&[], false)?.item_f64()?;
    let want: f64 = xv.iter().sum();
    let scale: f64 = xv.iter().map(|v| v.abs()).sum();
    assert!((got - want).abs() <= 1e-6 * scale, "{got} vs {want}");
    // Rows of 14286 (not a multiple of the block size), and the transposed columns.
    let x2 = x.reshape(&[7, -1])?;
    let got = x2.sum(&[1], false)?.to_f64_vec()?;
    assert_eq!(got.len(), 7);
    for (i, g) in got.iter().enumerate() {
        let row = &xv[i * 14_286..(i + 1) * 14_286];
        let w: f64 = row.iter().sum();
        let sc: f64 = row.iter().map(|v| v.abs()).sum();
        assert!((g - w).abs() <= 1e-6 * sc, "row {i}: {g} vs {w}");
    }
    let got = x2.t()?.mean(&[0], false)?.to_f64_vec()?;
    assert_eq!(got.len(), 7);
    for (i, g) in got.iter().enumerate() {
        let w: f64 = xv[i * 14_286..(i + 1) * 14_286].iter().sum::<f64>() / 14_286.0;
        assert!((g - w).abs() <= 1e-6, "mean of column {i}: {g} vs {w}");
    }
    Ok(())
}

#[test]
fn reductions_of_offset_and_half_inputs() -> Res {
    // Contiguous views at an offset (read straight from the buffer), column
    // blocks (strided), half-precision inputs and bool argmax.
    let (x, xv) = randn(&[7, 1031], DType::F32);
    let rows = x.narrow(0, 2, 3)?;
    let want: Vec<f64> = (2..5).map(|r| xv[r * 1031..(r + 1) * 1031].iter().sum()).collect();
    assert_close(&rows.sum(&[1], false)?.to_f64_vec()?, &want, 1e-5, 1e-4, "sum of narrowed rows");
    let want: Vec<f64> = (2..5).map(|r| max_ref(&xv[r * 1031..(r + 1) * 1031])).collect();
    assert_same(&rows.max(&[-1], false)?.to_f64_vec()?, &want, "max of narrowed rows");
    let want: Vec<f64> = (2..5)
        .map(|r| {
            let row = &xv[r * 1031..(r + 1) * 1031];
            (0..1031).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as f64
        })
        .collect();
    assert_same(&rows.argmax(Some(1), false)?.to_f64_vec()?, &want, "argmax of narrowed rows");
    let flat = x.flatten_all()?.narrow(0, 1500, 3000)?;
    let want: f64 = xv[1500..4500].iter().sum();
    assert!((flat.sum(&[], false)?.item_f64()? - want).abs() < 1e-3);
    let cols = x.narrow(1, 5, 100)?;
    let want: Vec<f64> = (0..7).map(|r| xv[r * 1031 + 5..r * 1031 + 105].iter().sum()).collect();
    assert_close(&cols.sum(&[1], false)?.to_f64_vec()?, &want, 1e-5, 1e-4, "sum of a column block");
    let want: Vec<f64> = (0..100).map(|c| (0..7).map(|r| xv[r * 1031 + 5 + c]).sum()).collect();
    assert_close(&cols.sum(&[0], false)?.to_f64_vec()?, &want, 1e-5, 1e-5, "sum over rows of a column block");

    for dtype in [DType::F16, DType::BF16] {
        let (h, hv) = tensor(&xv, &[7, 1031], dtype);
        let s = h.sum(&[1], false)?;
        assert_eq!(s.dtype(), dtype);
        let want: Vec<f64> = (0..7).map(|r| hv[r * 1031..(r + 1) * 1031].iter().sum()).collect();
        let (rt, _) = tol(dtype);
        let got = s.to_f64_vec()?;
        for r in 0..7 {
            let scale: f64 = hv[r * 1031..(r + 1) * 1031].iter().map(|v| v.abs()).sum();
            assert!(
                (got[r] - want[r]).abs() <= rt * (want[r].abs() + 1e-3 * scale) + 1e-3,
                "{dtype} row sum {r}: {} vs {}",
                got[r],
                want[r]
            );
        }
        let want: Vec<f64> = (0..7).map(|r| max_ref(&hv[r * 1031..(r + 1) * 1031])).collect();
        assert_same(&h.max(&[1], false)?.to_f64_vec()?, &want, &format!("{dtype} max"));
        let m = h.mean(&[], false)?;
        assert_eq!(m.dtype(), dtype);
        assert!((m.item_f64()? - hv.iter().sum::<f64>() / hv.len() as f64).abs() < 1e-2);
    }
    let b = Tensor::from_vec((0..2000).map(|i| i % 701 == 700).collect::<Vec<bool>>(), &[2, 1000], CPU)?;
    assert_eq!(b.argmax(Some(1), false)?.to_vec::<i32>()?, vec![700, 401]);
    assert_eq!(b.argmin(Some(1), false)?.to_vec::<i32>()?, vec![0, 0]);
    assert_eq!(b.sum(&[1], false)?.to_vec::<i32>()?, vec![1, 1]);
    Ok(())
}

#[test]
fn logsumexp_with_infinities() -> Res {
    for dtype in [DType::F32, DType::F64] {
        let inf = f64::INFINITY;
        let (x, _) = tensor(&[-inf, -inf, 0.0, -inf, inf, 1.0, 1000.0, 1000.0, -1000.0], &[3, 3], dtype);
        let got = x.logsumexp(&[1], false)?.to_f64_vec()?;
        assert_eq!(got[0], 0.0, "{dtype}: log(e^-inf + e^-inf + e^0)");
        assert_eq!(got[1], inf, "{dtype}: +inf wins");
        assert!((got[2] - (1000.0 + 2f64.ln())).abs() < 1e-3, "{dtype}: stable for large values: {}", got[2]);
        let (y, _) = tensor(&[-inf, -inf], &[2], dtype);
        assert_eq!(y.logsumexp(&[0], true)?.to_f64_vec()?, vec![-inf], "{dtype}: all -inf gives -inf");
    }
    Ok(())
}

#[test]
fn cumsum_and_softmax_of_views_and_pending_inputs() -> Res {
    let (x, xv) = randn(&[13, 7], DType::F64);
    // The transposed values, as a row-major [7, 13] Vec.
    let tv: Vec<f64> = (0..91).map(|i| xv[(i % 13) * 7 + i / 13]).collect();
    for d in 0..2 {
        let (want, _) = cumsum_ref(&tv, &[7, 13], d);
        assert_close(&x.t()?.cumsum(d as isize)?.to_f64_vec()?, &want, 1e-12, 1e-12, &format!("cumsum of t() along {d}"));
        let doubled: Vec<f64> = tv.iter().map(|v| v * 2.0).collect();
        let (want, _) = cumsum_ref(&doubled, &[7, 13], d);
        assert_close(&x.t()?.mul(2.0)?.cumsum(d as isize)?.to_f64_vec()?, &want, 1e-12, 1e-12, &format!("cumsum of pending along {d}"));
        let want = softmax_ref(&tv, &[7, 13], d, false);
        assert_close(&x.t()?.softmax(d as isize)?.to_f64_vec()?, &want, 1e-12, 1e-14, &format!("softmax of t() along {d}"));
        let want = softmax_ref(&doubled, &[7, 13], d, true);
        assert_close(
            &x.t()?.mul(2.0)?.log_softmax(d as isize)?.to_f64_vec()?,
            &want,
            1e-12,
            1e-12,
            &format!("log_softmax of pending along {d}"),
        );
    }
    // A stepped slice and an expanded input.
    let s = x.slice(0, 1, 13, 3)?; // rows 1, 4, 7, 10
    let sv: Vec<f64> = [1, 4, 7, 10].iter().flat_map(|&r| xv[r * 7..(r + 1) * 7].to_vec()).collect();
    let (want, _) = cumsum_ref(&sv, &[4, 7], 0);
    assert_close(&s.cumsum(0)?.to_f64_vec()?, &want, 1e-12, 1e-12, "cumsum of stepped slice");
    let e = x.narrow(0, 0, 1)?.expand(&[5, 7])?;
    let ev: Vec<f64> = (0..35).map(|i| xv[i % 7]).collect();
    let (want, _) = cumsum_ref(&ev, &[5, 7], 0);
    assert_close(&e.cumsum(0)?.to_f64_vec()?, &want, 1e-12, 1e-12, "cumsum of expanded");
    assert_close(&e.softmax(0)?.to_f64_vec()?, &vec![0.2; 35], 1e-12, 1e-14, "softmax of expanded");
    Ok(())
}

#[test]
fn pytorch_semantics_for_bools_and_0d_tensors() {
    let cpu = Device::Cpu;
    let b = Tensor::from_vec(vec![true, false, true, false], &[2, 2], cpu).unwrap();
    let c = Tensor::from_vec(vec![true, true, false, false], &[2, 2], cpu).unwrap();
    // bool op bool stays bool: + and maximum are "or", * and minimum "and"; - is refused.
    assert_eq!(b.add(&c).unwrap().to_vec::<bool>().unwrap(), vec![true, true, true, false]);
    assert_eq!(b.maximum(&c).unwrap().to_vec::<bool>().unwrap(), vec![true, true, true, false]);
    assert_eq!(b.mul(&c).unwrap().to_vec::<bool>().unwrap(), vec![true, false, false, false]);
    assert_eq!(b.minimum(&c).unwrap().to_vec::<bool>().unwrap(), vec![true, false, false, false]);
    assert_err_mentions(b.sub(&c), &["sub", "bool"]);
    // max/min over axes of bools stay bool (any/all); sum counts as i32.
    let m = b.max(&[1], false).unwrap();
    assert_eq!((m.dtype(), m.to_vec::<bool>().unwrap()), (DType::Bool, vec![true, true]));
    assert_eq!(c.min(&[0], false).unwrap().to_vec::<bool>().unwrap(), vec![false, false]);
    assert_eq!(b.sum(&[0], false).unwrap().dtype(), DType::I32);
    // A 0-d tensor reduces over dim 0 or -1 (nothing to reduce), as PyTorch.
    let s = Tensor::scalar(2.5f32, cpu).unwrap();
    for d in [0isize, -1] {
        assert_eq!(s.sum(&[d], false).unwrap().item::<f32>().unwrap(), 2.5);
        assert_eq!(s.mean(&[d], true).unwrap().dims(), &[] as &[usize]);
        assert_eq!(s.max(&[d], false).unwrap().item::<f32>().unwrap(), 2.5);
        assert_eq!(s.logsumexp(&[d], false).unwrap().item::<f32>().unwrap(), 2.5);
    }
    assert_err_mentions(s.sum(&[1], false), &["sum", "0-d", "1"]);
    // Errors name the op the user called.
    let x = Tensor::ones(&[2, 3], DType::F32, cpu).unwrap();
    assert_err_mentions(x.var(&[5], 1, false), &["var:"]);
    assert_err_mentions(x.std(&[5], 1, false), &["std:"]);
    assert_err_mentions(x.logsumexp(&[-3], false), &["logsumexp:"]);
}
