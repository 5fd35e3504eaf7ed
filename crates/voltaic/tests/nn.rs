//! Neural-network ops against naive f64 references: conv2d, max/avg pooling,
//! layer_norm, dropout, cross_entropy (with label smoothing) and mse_loss.

mod common;
use common::*;
use voltaic::{Conv2dOpts, DType, Device, Reduction, Tensor};

// ---------------------------------------------------------------- conv2d

struct ConvCase {
    n: usize,
    cin: usize,
    h: usize,
    w: usize,
    cout: usize,
    k: [usize; 2],
    opts: Conv2dOpts,
    bias: bool,
}

/// Naive cross-correlation; returns values, |terms| sums (error scale) and dims.
fn ref_conv2d(x: &[f64], xd: [usize; 4], wt: &[f64], wd: [usize; 4], bias: Option<&[f64]>, o: Conv2dOpts) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
    let [n, cin, h, w] = xd;
    let [cout, cpg, kh, kw] = wd;
    let g = o.groups;
    assert_eq!(cpg * g, cin);
    let opg = cout / g;
    let oh = (h + 2 * o.padding[0] - o.dilation[0] * (kh - 1) - 1) / o.stride[0] + 1;
    let ow = (w + 2 * o.padding[1] - o.dilation[1] * (kw - 1) - 1) / o.stride[1] + 1;
    let mut out = vec![0.0; n * cout * oh * ow];
    let mut scale = vec![0.0; n * cout * oh * ow];
    for b in 0..n {
        for co in 0..cout {
            let grp = co / opg;
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut s, mut sa) = (0.0, 0.0);
                    if let Some(bv) = bias {
                        s += bv[co];
                        sa += bv[co].abs();
                    }
                    for cl in 0..cpg {
                        let ci = grp * cpg + cl;
                        for ki in 0..kh {
                            for kj in 0..kw {
                                let iy = (oy * o.stride[0] + ki * o.dilation[0]) as isize - o.padding[0] as isize;
                                let ix = (ox * o.stride[1] + kj * o.dilation[1]) as isize - o.padding[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                let xv = x[((b * cin + ci) * h + iy as usize) * w + ix as usize];
                                let wv = wt[((co * cpg + cl) * kh + ki) * kw + kj];
                                s += xv * wv;
                                sa += (xv * wv).abs();
                            }
                        }
                    }
                    let at = ((b * cout + co) * oh + oy) * ow + ox;
                    out[at] = s;
                    scale[at] = sa;
                }
            }
        }
    }
    (out, scale, vec![n, cout, oh, ow])
}

fn check_conv(c: &ConvCase, dt: DType, seed: u64) -> voltaic::Result<()> {
    let mut rng = Rng::new(seed);
    let cpg = c.cin / c.opts.groups;
    let xd = [c.n, c.cin, c.h, c.w];
    let wd = [c.cout, cpg, c.k[0], c.k[1]];
    let (x, xv) = rand_tensor(&mut rng, &xd, dt);
    let (w, wv) = rand_tensor(&mut rng, &wd, dt);
    let (b, bv) = rand_tensor(&mut rng, &[c.cout], dt);
    let bias = if c.bias { Some(&b) } else { None };
    let (want, scale, dims) = ref_conv2d(&xv, xd, &wv, wd, c.bias.then_some(bv.as_slice()), c.opts);
    let y = x.conv2d(&w, bias, c.opts)?;
    let what = format!("conv2d x {xd:?} w {wd:?} {:?} bias {} {dt}", c.opts, c.bias);
    assert_eq!(y.dims(), dims.as_slice(), "{what}");
    let tol = if dt == DType::F64 { 1e-12 } else { 1e-5 };
    let scale: Vec<f64> = scale.iter().map(|s| s + 1e-30).collect();
    assert_close_scaled(&y.to_f64_vec()?, &want, &scale, tol, &what);
    Ok(())
}

fn opts(stride: usize, padding: usize, dilation: usize, groups: usize) -> Conv2dOpts {
    Conv2dOpts { stride: [stride, stride], padding: [padding, padding], dilation: [dilation, dilation], groups }
}

#[test]
fn conv2d_plain_and_padded() -> voltaic::Result<()> {
    let cases = [
        ConvCase { n: 1, cin: 1, h: 5, w: 5, cout: 1, k: [3, 3], opts: opts(1, 0, 1, 1), bias: false },
        ConvCase { n: 2, cin: 3, h: 7, w: 5, cout: 4, k: [3, 3], opts: opts(1, 1, 1, 1), bias: true },
        ConvCase { n: 2, cin: 3, h: 7, w: 5, cout: 4, k: [3, 3], opts: opts(1, 1, 1, 1), bias: false },
        ConvCase { n: 1, cin: 2, h: 9, w: 11, cout: 3, k: [1, 1], opts: opts(1, 0, 1, 1), bias: true },
        ConvCase { n: 3, cin: 2, h: 6, w: 7, cout: 5, k: [2, 3], opts: opts(1, 0, 1, 1), bias: true },
        ConvCase { n: 1, cin: 1, h: 1, w: 1, cout: 2, k: [1, 1], opts: opts(1, 0, 1, 1), bias: true },
        // Kernel exactly the padded input.
        ConvCase { n: 1, cin: 2, h: 3, w: 4, cout: 2, k: [5, 6], opts: opts(1, 1, 1, 1), bias: true },
        // Padding larger than the kernel (allowed for conv).
        ConvCase { n: 1, cin: 1, h: 3, w: 3, cout: 1, k: [2, 2], opts: opts(1, 3, 1, 1), bias: true },
    ];
    for (i, c) in cases.iter().enumerate() {
        check_conv(c, DType::F32, i as u64)?;
        check_conv(c, DType::F64, 100 + i as u64)?;
    }
    Ok(())
}

#[test]
fn conv2d_stride_dilation_and_asymmetric_options() -> voltaic::Result<()> {
    let asym = Conv2dOpts { stride: [2, 3], padding: [1, 0], dilation: [1, 2], groups: 1 };
    let cases = [
        ConvCase { n: 2, cin: 3, h: 9, w: 7, cout: 4, k: [3, 3], opts: opts(2, 0, 1, 1), bias: true },
        ConvCase { n: 2, cin: 3, h: 9, w: 7, cout: 4, k: [3, 3], opts: opts(2, 1, 1, 1), bias: false },
        ConvCase { n: 1, cin: 2, h: 11, w: 9, cout: 3, k: [3, 3], opts: opts(1, 2, 2, 1), bias: true },
        ConvCase { n: 1, cin: 2, h: 11, w: 13, cout: 3, k: [3, 2], opts: opts(3, 1, 3, 1), bias: true },
        ConvCase { n: 2, cin: 1, h: 8, w: 13, cout: 2, k: [3, 3], opts: asym, bias: true },
        ConvCase { n: 1, cin: 3, h: 5, w: 5, cout: 2, k: [3, 3], opts: opts(5, 1, 1, 1), bias: true },
    ];
    for (i, c) in cases.iter().enumerate() {
        check_conv(c, DType::F32, 200 + i as u64)?;
        check_conv(c, DType::F64, 300 + i as u64)?;
    }
    Ok(())
}

#[test]
fn conv2d_groups_and_depthwise() -> voltaic::Result<()> {
    let cases = [
        ConvCase { n: 2, cin: 4, h: 7, w: 5, cout: 6, k: [3, 3], opts: opts(1, 1, 1, 2), bias: true },
        ConvCase { n: 1, cin: 6, h: 5, w: 9, cout: 3, k: [3, 1], opts: opts(2, 1, 1, 3), bias: false },
        // Depthwise: groups = cin = cout.
        ConvCase { n: 2, cin: 5, h: 7, w: 7, cout: 5, k: [3, 3], opts: opts(1, 1, 1, 5), bias: true },
        // Depthwise with a channel multiplier of 2, stride and dilation.
        ConvCase { n: 1, cin: 3, h: 9, w: 8, cout: 6, k: [3, 3], opts: opts(2, 2, 2, 3), bias: true },
        ConvCase { n: 1, cin: 4, h: 6, w: 6, cout: 8, k: [2, 2], opts: opts(1, 0, 1, 4), bias: false },
    ];
    for (i, c) in cases.iter().enumerate() {
        check_conv(c, DType::F32, 400 + i as u64)?;
        check_conv(c, DType::F64, 500 + i as u64)?;
    }
    Ok(())
}

#[test]
fn conv2d_non_contiguous_input_and_errors() -> voltaic::Result<()> {
    // An NHWC buffer permuted to NCHW.
    let mut rng = Rng::new(600);
    let (n, h, w, c) = (2, 5, 7, 3);
    let (nhwc, nv) = rand_tensor(&mut rng, &[n, h, w, c], DType::F32);
    let x = nhwc.permute(&[0, 3, 1, 2])?;
    let xv = strided(&nv, &[n, c, h, w], &[h * w * c, 1, w * c, c], 0);
    let (wt, wv) = rand_tensor(&mut rng, &[4, 3, 3, 3], DType::F32);
    let o = opts(1, 1, 1, 1);
    let (want, scale, dims) = ref_conv2d(&xv, [n, c, h, w], &wv, [4, 3, 3, 3], None, o);
    let y = x.conv2d(&wt, None, o)?;
    assert_eq!(y.dims(), dims.as_slice());
    assert_close_scaled(&y.to_f64_vec()?, &want, &scale, 1e-5, "conv2d of a permuted input");

    // Errors name the op and the shapes.
    let x = Tensor::ones(&[1, 3, 5, 5], DType::F32, Device::Cpu)?;
    let w = Tensor::ones(&[2, 2, 3, 3], DType::F32, Device::Cpu)?;
    assert_err_mentions(x.conv2d(&w, None, Conv2dOpts::default()), &["conv2d", "[2, 2, 3, 3]"]);
    let w = Tensor::ones(&[2, 3, 3, 3], DType::F32, Device::Cpu)?;
    let b = Tensor::ones(&[3], DType::F32, Device::Cpu)?;
    assert_err_mentions(x.conv2d(&w, Some(&b), Conv2dOpts::default()), &["conv2d", "bias", "[3]"]);
    assert_err_mentions(x.conv2d(&w, None, opts(1, 0, 1, 0)), &["conv2d"]);
    assert_err_mentions(x.conv2d(&w, None, opts(0, 0, 1, 1)), &["conv2d"]);
    assert_err_mentions(x.conv2d(&w, None, opts(1, 0, 0, 1)), &["conv2d"]);
    assert_err_mentions(x.conv2d(&w, None, opts(1, 0, 3, 1)), &["conv2d", "5x5"]);
    assert_err_mentions(x.reshape_dims(&[15, 5])?.conv2d(&w, None, Conv2dOpts::default()), &["conv2d", "[15, 5]"]);
    // An unbatched [C, H, W] input is accepted, as PyTorch.
    assert_eq!(x.reshape_dims(&[3, 5, 5])?.conv2d(&w, None, Conv2dOpts::default())?.dims(), &[2, 3, 3]);
    Ok(())
}

// ---------------------------------------------------------------- pooling

fn ref_pool(x: &[f64], xd: [usize; 4], k: [usize; 2], s: [usize; 2], p: [usize; 2], max: bool) -> (Vec<f64>, Vec<usize>) {
    let [n, c, h, w] = xd;
    let oh = (h + 2 * p[0] - k[0]) / s[0] + 1;
    let ow = (w + 2 * p[1] - k[1]) / s[1] + 1;
    let mut out = Vec::with_capacity(n * c * oh * ow);
    for b in 0..n {
        for ch in 0..c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = if max { f64::NEG_INFINITY } else { 0.0 };
                    for ki in 0..k[0] {
                        for kj in 0..k[1] {
                            let iy = (oy * s[0] + ki) as isize - p[0] as isize;
                            let ix = (ox * s[1] + kj) as isize - p[1] as isize;
                            if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                continue; // -inf for max, 0 (counted) for avg
                            }
                            let v = x[((b * c + ch) * h + iy as usize) * w + ix as usize];
                            if max {
                                acc = acc.max(v);
                            } else {
                                acc += v;
                            }
                        }
                    }
                    out.push(if max { acc } else { acc / (k[0] * k[1]) as f64 });
                }
            }
        }
    }
    (out, vec![n, c, oh, ow])
}

#[test]
fn max_and_avg_pool2d() -> voltaic::Result<()> {
    let mut rng = Rng::new(700);
    // (input shape, kernel, stride, padding)
    type Case = ([usize; 4], [usize; 2], Option<[usize; 2]>, [usize; 2]);
    let cases: &[Case] = &[
        ([1, 1, 4, 4], [2, 2], None, [0, 0]),
        ([2, 3, 7, 5], [2, 2], None, [0, 0]),
        ([2, 3, 7, 5], [3, 3], Some([1, 1]), [1, 1]),
        ([1, 2, 9, 8], [3, 3], Some([2, 2]), [1, 1]),
        ([1, 2, 9, 8], [3, 2], Some([2, 1]), [1, 1]),
        ([2, 1, 5, 7], [1, 1], None, [0, 0]),
        ([1, 1, 5, 5], [5, 5], None, [2, 2]),
        ([1, 2, 6, 11], [4, 3], Some([3, 4]), [2, 1]),
        ([3, 2, 1, 1], [1, 1], Some([2, 2]), [0, 0]),
    ];
    for &(xd, k, s, p) in cases {
        for dt in [DType::F32, DType::F64] {
            let (x, xv) = rand_tensor(&mut rng, &xd, dt);
            let st = s.unwrap_or(k);
            let what = format!("x {xd:?} kernel {k:?} stride {s:?} padding {p:?} {dt}");
            let (want, dims) = ref_pool(&xv, xd, k, st, p, true);
            let y = x.max_pool2d(k, s, p)?;
            assert_eq!(y.dims(), dims.as_slice(), "max_pool2d {what}");
            assert_eq!(y.to_f64_vec()?, want, "max_pool2d {what}");
            let (want, dims) = ref_pool(&xv, xd, k, st, p, false);
            let y = x.avg_pool2d(k, s, p)?;
            assert_eq!(y.dims(), dims.as_slice(), "avg_pool2d {what}");
            let tol = if dt == DType::F64 { 1e-12 } else { 1e-5 };
            assert_close(&y.to_f64_vec()?, &want, tol, tol, &format!("avg_pool2d {what}"));
        }
    }
    // Max pooling of all-negative values with padding: the padding never wins.
    let x = Tensor::full(&[1, 1, 3, 3], -5.0, DType::F32, Device::Cpu)?;
    assert_eq!(x.max_pool2d([3, 3], Some([1, 1]), [1, 1])?.to_vec::<f32>()?, vec![-5.0; 9]);
    // avg_pool2d counts the zero padding: corners of ones with a 3x3 window see 4 of 9.
    let x = Tensor::ones(&[1, 1, 3, 3], DType::F32, Device::Cpu)?;
    let y = x.avg_pool2d([3, 3], Some([1, 1]), [1, 1])?.to_vec::<f32>()?;
    assert_close(&y.iter().map(|&v| v as f64).collect::<Vec<_>>(), &[4. / 9., 6. / 9., 4. / 9., 6. / 9., 1., 6. / 9., 4. / 9., 6. / 9., 4. / 9.], 1e-6, 1e-7, "avg corners");
    // Integer input: max stays i32, avg becomes float.
    let xi = Tensor::from_vec((0..16).collect::<Vec<i32>>(), &[1, 1, 4, 4], Device::Cpu)?;
    let m = xi.max_pool2d([2, 2], None, [0, 0])?;
    assert_eq!(m.to_f64_vec()?, vec![5., 7., 13., 15.]);
    let a = xi.avg_pool2d([2, 2], None, [0, 0])?;
    assert!(a.dtype().is_float());
    assert_eq!(a.to_f64_vec()?, vec![2.5, 4.5, 10.5, 12.5]);
    // A non-contiguous (transposed spatial dims) input.
    let (base, bv) = rand_tensor(&mut rng, &[1, 2, 5, 6], DType::F64);
    let xt = base.transpose(2, 3)?; // [1, 2, 6, 5]
    let xtv = strided(&bv, &[1, 2, 6, 5], &[60, 30, 1, 6], 0);
    let (want, _) = ref_pool(&xtv, [1, 2, 6, 5], [3, 2], [2, 2], [1, 1], true);
    assert_eq!(xt.max_pool2d([3, 2], Some([2, 2]), [1, 1])?.to_f64_vec()?, want);
    // Errors.
    let x = Tensor::ones(&[1, 1, 4, 4], DType::F32, Device::Cpu)?;
    assert_err_mentions(x.max_pool2d([2, 2], None, [2, 2]), &["max_pool2d", "padding"]);
    assert_err_mentions(x.avg_pool2d([0, 2], None, [0, 0]), &["avg_pool2d"]);
    assert_err_mentions(x.max_pool2d([2, 2], Some([0, 1]), [0, 0]), &["max_pool2d"]);
    assert_err_mentions(x.max_pool2d([5, 5], None, [0, 0]), &["max_pool2d", "4x4"]);
    assert_err_mentions(x.reshape_dims(&[4, 4])?.avg_pool2d([2, 2], None, [0, 0]), &["avg_pool2d", "[4, 4]"]);
    Ok(())
}

// ---------------------------------------------------------------- layer_norm

fn ref_layer_norm(x: &[f64], inner: usize, w: Option<&[f64]>, b: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(inner) {
        let mu = row.iter().sum::<f64>() / inner as f64;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / inner as f64;
        for (j, v) in row.iter().enumerate() {
            let mut y = (v - mu) / (var + eps).sqrt();
            if let Some(w) = w {
                y *= w[j];
            }
            if let Some(b) = b {
                y += b[j];
            }
            out.push(y);
        }
    }
    out
}

#[test]
fn layer_norm_over_one_and_two_trailing_dims() -> voltaic::Result<()> {
    let mut rng = Rng::new(800);
    let cases: &[(&[usize], usize)] = &[
        (&[7], 1),
        (&[3, 5], 1),
        (&[2, 3, 33], 1),
        (&[2, 3, 5], 2),
        (&[4, 1, 7], 2),
        (&[2, 7, 3], 3),
        (&[5, 1], 1),
    ];
    for &(xd, k) in cases {
        let ns = &xd[xd.len() - k..];
        let inner = numel(ns);
        for dt in [DType::F32, DType::F64] {
            for (use_w, use_b) in [(false, false), (true, false), (false, true), (true, true)] {
                // Shifted data, so the centring matters.
                let (x, xv) = {
                    let v: Vec<f64> = rng.normals(numel(xd)).iter().map(|v| 3.0 + 2.0 * v).collect();
                    tensor(&v, xd, dt)
                };
                let (w, wv) = rand_tensor(&mut rng, ns, dt);
                let (b, bv) = rand_tensor(&mut rng, ns, dt);
                let eps = 1e-5;
                let y = x.layer_norm(ns, use_w.then_some(&w), use_b.then_some(&b), eps)?;
                assert_eq!(y.dims(), xd);
                assert_eq!(y.dtype(), dt);
                let want = ref_layer_norm(&xv, inner, use_w.then_some(wv.as_slice()), use_b.then_some(bv.as_slice()), eps);
                let tol = if dt == DType::F64 { 1e-10 } else { 1e-4 };
                assert_close(&y.to_f64_vec()?, &want, tol, tol, &format!("layer_norm {xd:?} over {ns:?} w {use_w} b {use_b} {dt}"));
            }
        }
    }
    // A constant row normalises to 0 (then the bias).
    let x = Tensor::full(&[2, 4], 3.0, DType::F32, Device::Cpu)?;
    let b = Tensor::from_vec(vec![1f32, 2., 3., 4.], &[4], Device::Cpu)?;
    assert_eq!(x.layer_norm(&[4], None, Some(&b), 1e-5)?.to_vec::<f32>()?, vec![1., 2., 3., 4., 1., 2., 3., 4.]);
    // A transposed input.
    let (base, bv) = rand_tensor(&mut rng, &[5, 3], DType::F64);
    let xt = base.t()?;
    let xtv = strided(&bv, &[3, 5], &[1, 3], 0);
    assert_close(&xt.layer_norm(&[5], None, None, 1e-5)?.to_f64_vec()?, &ref_layer_norm(&xtv, 5, None, None, 1e-5), 1e-10, 1e-10, "layer_norm of x.T");
    // Errors.
    let x = Tensor::ones(&[2, 3, 4], DType::F32, Device::Cpu)?;
    assert_err_mentions(x.layer_norm(&[3], None, None, 1e-5), &["layer_norm", "[3]", "[2, 3, 4]"]);
    assert_err_mentions(x.layer_norm(&[], None, None, 1e-5), &["layer_norm"]);
    assert_err_mentions(x.layer_norm(&[1, 2, 3, 4], None, None, 1e-5), &["layer_norm"]);
    let w = Tensor::ones(&[3, 4], DType::F32, Device::Cpu)?;
    assert_err_mentions(x.layer_norm(&[4], Some(&w), None, 1e-5), &["layer_norm", "weight", "[3, 4]"]);
    assert_err_mentions(x.layer_norm(&[4], None, Some(&w), 1e-5), &["layer_norm", "bias", "[3, 4]"]);
    Ok(())
}

// ---------------------------------------------------------------- dropout

#[test]
fn dropout_masks_scales_and_reproduces() -> voltaic::Result<()> {
    // The only test of this file that uses the library's default generator.
    let mut rng = Rng::new(900);
    let n = 20_000;
    let v: Vec<f64> = (0..n).map(|_| 1.0 + rng.uniform()).collect(); // all nonzero
    let (x, xv) = tensor(&v, &[100, 200], DType::F32);
    // Eval mode: identity.
    for p in [0.0, 0.3, 1.0] {
        assert_eq!(x.dropout(p, false)?.to_f64_vec()?, xv);
    }
    // p = 0 in training: identity too; p = 1: all zeros.
    assert_eq!(x.dropout(0.0, true)?.to_f64_vec()?, xv);
    assert_eq!(x.dropout(1.0, true)?.to_f64_vec()?, vec![0.0; n]);
    for p in [0.1, 0.5, 0.8] {
        voltaic::manual_seed(1234);
        let y = x.dropout(p, true)?.to_f64_vec()?;
        let zeros = y.iter().filter(|&&v| v == 0.0).count();
        let frac = zeros as f64 / n as f64;
        // Binomial std is at most 0.0036 here; allow 5 sigma.
        assert!((frac - p).abs() < 0.02, "p {p}: zero fraction {frac}");
        for (i, (&g, &x0)) in y.iter().zip(&xv).enumerate() {
            if g != 0.0 {
                let want = x0 / (1.0 - p);
                assert!((g - want).abs() <= 1e-6 * want.abs(), "p {p}: element {i} is {g}, expected 0 or {want}");
            }
        }
        // Same seed, same mask; another seed, another mask.
        voltaic::manual_seed(1234);
        assert_eq!(x.dropout(p, true)?.to_f64_vec()?, y);
        voltaic::manual_seed(4321);
        assert_ne!(x.dropout(p, true)?.to_f64_vec()?, y);
        // Successive calls without reseeding differ.
        voltaic::manual_seed(1234);
        let a = x.dropout(p, true)?.to_f64_vec()?;
        let b = x.dropout(p, true)?.to_f64_vec()?;
        assert_ne!(a, b);
    }
    // f64 input keeps f64 and exact 1/(1-p) scaling.
    let xd = Tensor::full(&[1000], 2.0, DType::F64, Device::Cpu)?;
    let y = xd.dropout(0.25, true)?;
    assert_eq!(y.dtype(), DType::F64);
    assert!(y.to_f64_vec()?.iter().all(|&v| v == 0.0 || (v - 2.0 / 0.75).abs() < 1e-12));
    // Bad probabilities.
    for p in [-0.1, 1.5, f64::NAN] {
        assert_err_mentions(x.dropout(p, true), &["dropout"]);
        assert_err_mentions(x.dropout(p, false), &["dropout"]);
    }
    Ok(())
}

// ---------------------------------------------------------------- losses

/// Reference cross entropy over logits [N, C, rest...] and targets [N, rest...]:
/// per-position losses (row-major over [N, rest...]).
fn ref_cross_entropy(x: &[f64], xd: &[usize], t: &[i64], eps: f64) -> Vec<f64> {
    let (n, c) = (xd[0], xd[1]);
    let rest: usize = xd[2..].iter().product();
    let mut out = vec![];
    for b in 0..n {
        for r in 0..rest {
            let at = |ci: usize| x[(b * c + ci) * rest + r];
            let m = (0..c).map(at).fold(f64::NEG_INFINITY, f64::max);
            let lse = m + (0..c).map(|ci| (at(ci) - m).exp()).sum::<f64>().ln();
            let logp = |ci: usize| at(ci) - lse;
            let nll = -logp(t[b * rest + r] as usize);
            let smooth = -(0..c).map(logp).sum::<f64>() / c as f64;
            out.push((1.0 - eps) * nll + eps * smooth);
        }
    }
    out
}

#[test]
fn cross_entropy_with_and_without_label_smoothing() -> voltaic::Result<()> {
    let mut rng = Rng::new(1000);
    let shapes: &[&[usize]] = &[&[1, 1], &[4, 3], &[7, 10], &[3, 5, 4], &[2, 3, 2, 5], &[5, 1, 3]];
    for xd in shapes {
        let mut td = xd.to_vec();
        let c = td.remove(1);
        for dt in [DType::F32, DType::F64] {
            let (x, xv) = {
                let v: Vec<f64> = rng.normals(numel(xd)).iter().map(|v| 3.0 * v).collect();
                tensor(&v, xd, dt)
            };
            let tv: Vec<i64> = (0..numel(&td)).map(|_| rng.below(c) as i64).collect();
            let t = idx_tensor(&tv, &td);
            for eps in [0.0, 0.1, 0.5, 1.0] {
                let per = ref_cross_entropy(&xv, xd, &tv, eps);
                let tol = if dt == DType::F64 { 1e-10 } else { 1e-5 };
                let what = format!("cross_entropy {xd:?} eps {eps} {dt}");
                let none = x.cross_entropy(&t, eps, Reduction::None)?;
                assert_eq!(none.dims(), td.as_slice(), "{what}");
                assert_close(&none.to_f64_vec()?, &per, tol, tol, &format!("{what} none"));
                let sum: f64 = per.iter().sum();
                let s = x.cross_entropy(&t, eps, Reduction::Sum)?;
                assert_eq!(s.dims(), &[] as &[usize]);
                assert_close(&s.to_f64_vec()?, &[sum], tol, tol, &format!("{what} sum"));
                let m = x.cross_entropy(&t, eps, Reduction::Mean)?;
                assert_eq!(m.dims(), &[] as &[usize]);
                assert_close(&m.to_f64_vec()?, &[sum / per.len() as f64], tol, tol, &format!("{what} mean"));
            }
        }
    }
    // u32 targets and a hand-checked value: logits [0, ln 3] -> p = [1/4, 3/4].
    let x = Tensor::from_vec(vec![0f64, 3f64.ln()], &[1, 2], Device::Cpu)?;
    let t = Tensor::from_vec(vec![1u32], &[1], Device::Cpu)?;
    assert_close(&x.cross_entropy(&t, 0.0, Reduction::Mean)?.to_f64_vec()?, &[-(0.75f64).ln()], 1e-12, 1e-12, "ce 2 classes");
    // eps = 0.2: 0.8 * -ln(3/4) + 0.2 * (-(ln(1/4) + ln(3/4)) / 2)
    let want = 0.8 * -(0.75f64).ln() + 0.2 * (-((0.25f64).ln() + (0.75f64).ln()) / 2.0);
    assert_close(&x.cross_entropy(&t, 0.2, Reduction::Sum)?.to_f64_vec()?, &[want], 1e-12, 1e-12, "ce smoothing");
    // Large logits stay finite (stable log-softmax).
    let x = Tensor::from_vec(vec![1000f32, 0., -1000.], &[1, 3], Device::Cpu)?;
    let l = x.cross_entropy(&idx_tensor(&[1], &[1]), 0.0, Reduction::Mean)?.to_f64_vec()?;
    assert_close(&l, &[1000.0], 1e-6, 1e-3, "ce large logits");
    // Transposed logits: base [C, N] -> [N, C].
    let (base, bv) = rand_tensor(&mut rng, &[4, 3], DType::F64);
    let xt = base.t()?;
    let xtv = strided(&bv, &[3, 4], &[1, 3], 0);
    let tv = vec![3i64, 0, 2];
    let per = ref_cross_entropy(&xtv, &[3, 4], &tv, 0.1);
    assert_close(&xt.cross_entropy(&idx_tensor(&tv, &[3]), 0.1, Reduction::None)?.to_f64_vec()?, &per, 1e-10, 1e-10, "ce of x.T");
    // Errors.
    let x = Tensor::ones(&[4, 3], DType::F32, Device::Cpu)?;
    assert_err_mentions(x.cross_entropy(&idx_tensor(&[0; 3], &[3]), 0.0, Reduction::Mean), &["cross_entropy", "[4, 3]", "[3]"]);
    assert_err_mentions(x.cross_entropy(&idx_tensor(&[0; 4], &[4, 1]), 0.0, Reduction::Mean), &["cross_entropy", "[4, 1]"]);
    assert_err_mentions(x.cross_entropy(&Tensor::zeros(&[4], DType::F32, Device::Cpu)?, 0.0, Reduction::Mean), &["cross_entropy", "f32"]);
    assert_err_mentions(x.cross_entropy(&idx_tensor(&[0; 4], &[4]), 1.5, Reduction::Mean), &["cross_entropy", "1.5"]);
    assert_err_mentions(x.cross_entropy(&idx_tensor(&[0; 4], &[4]), -0.1, Reduction::Mean), &["cross_entropy"]);
    assert_err_mentions(Tensor::ones(&[3], DType::F32, Device::Cpu)?.cross_entropy(&idx_tensor(&[0], &[1]), 0.0, Reduction::Mean), &["cross_entropy", "[3]"]);
    // Unbatched [C] logits with a 0-d target are accepted, as PyTorch: ln(3) for equal logits.
    let l = Tensor::ones(&[3], DType::F32, Device::Cpu)?.cross_entropy(&idx_tensor(&[0], &[]), 0.0, Reduction::Mean)?;
    assert!((l.item::<f32>()? - 3f32.ln()).abs() < 1e-6);
    // Out-of-range class indices are errors when computed.
    for bad in [3i64, -1, 100] {
        let r = x.cross_entropy(&idx_tensor(&[0, bad, 1, 2], &[4]), 0.0, Reduction::Mean).and_then(|t| t.to_f64_vec());
        assert!(r.is_err(), "target {bad}");
    }
    Ok(())
}

#[test]
fn mse_loss_reductions() -> voltaic::Result<()> {
    let mut rng = Rng::new(1100);
    let shapes: &[&[usize]] = &[&[], &[1], &[7], &[3, 5], &[2, 3, 4]];
    for xd in shapes {
        for dt in [DType::F32, DType::F64] {
            let (x, xv) = rand_tensor(&mut rng, xd, dt);
            let (t, tv) = rand_tensor(&mut rng, xd, dt);
            let per: Vec<f64> = xv.iter().zip(&tv).map(|(a, b)| (a - b) * (a - b)).collect();
            let tol = if dt == DType::F64 { 1e-12 } else { 1e-5 };
            let what = format!("mse_loss {xd:?} {dt}");
            let none = x.mse_loss(&t, Reduction::None)?;
            assert_eq!(none.dims(), *xd);
            assert_close(&none.to_f64_vec()?, &per, tol, tol, &what);
            let sum: f64 = per.iter().sum();
            assert_close(&x.mse_loss(&t, Reduction::Sum)?.to_f64_vec()?, &[sum], tol, tol, &what);
            assert_close(&x.mse_loss(&t, Reduction::Mean)?.to_f64_vec()?, &[sum / per.len() as f64], tol, tol, &what);
        }
    }
    // Empty input: mean is NaN (as PyTorch), sum is 0.
    let e = Tensor::zeros(&[0, 3], DType::F32, Device::Cpu)?;
    assert!(e.mse_loss(&e, Reduction::Mean)?.item_f64()?.is_nan());
    assert_eq!(e.mse_loss(&e, Reduction::Sum)?.item_f64()?, 0.0);
    // Errors.
    let a = Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?;
    let b = Tensor::ones(&[2], DType::F32, Device::Cpu)?;
    assert_err_mentions(a.mse_loss(&b, Reduction::Mean), &["mse_loss", "[2, 3]", "[2]"]);
    Ok(())
}

#[test]
fn pytorch_semantics_for_losses_and_unbatched_inputs() {
    let cpu = Device::Cpu;
    // cross_entropy: ignore_index (default -100) and label smoothing together.
    let logits: Vec<f64> = (0..20).map(|i| ((i * 37 % 11) as f64 - 5.0) * 0.3).collect();
    let x = Tensor::from_vec(logits.clone(), &[5, 4], cpu).unwrap();
    let target = [1i32, -100, 3, 0, -100];
    let t = Tensor::from_vec(target.to_vec(), &[5], cpu).unwrap();
    let eps = 0.2;
    let (mut total, mut count) = (0.0, 0.0);
    let mut per = vec![];
    for (n, &c) in target.iter().enumerate() {
        let row = &logits[n * 4..n * 4 + 4];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let l = if c < 0 { 0.0 } else { (1.0 - eps) * (lse - row[c as usize]) + eps * (lse - row.iter().sum::<f64>() / 4.0) };
        per.push(l);
        if c >= 0 {
            total += l;
            count += 1.0;
        }
    }
    let mean = x.cross_entropy(&t, eps, Reduction::Mean).unwrap().item::<f64>().unwrap();
    assert!((mean - total / count).abs() < 1e-12, "{mean} vs {}", total / count);
    let none = x.cross_entropy(&t, eps, Reduction::None).unwrap().to_vec::<f64>().unwrap();
    assert!(none.iter().zip(&per).all(|(a, b)| (a - b).abs() < 1e-12), "{none:?} vs {per:?}");
    let opts = voltaic::CrossEntropyOpts { ignore_index: 3, ..Default::default() };
    let t3 = Tensor::from_vec(vec![1i32, 2, 3, 0, 2], &[5], cpu).unwrap();
    let l = x.cross_entropy_with(&t3, &opts).unwrap().item::<f64>().unwrap();
    let keep = x.narrow(0, 0, 2).unwrap();
    let rest = Tensor::cat(&[&keep, &x.narrow(0, 3, 2).unwrap()], 0).unwrap();
    let want = rest.cross_entropy(&Tensor::from_vec(vec![1i32, 2, 0, 2], &[4], cpu).unwrap(), 0.0, Reduction::Mean).unwrap().item::<f64>().unwrap();
    assert!((l - want).abs() < 1e-12);
    // Unbatched (C) logits with a 0-d target.
    let one = x.narrow(0, 0, 1).unwrap().squeeze(0).unwrap();
    let l = one.cross_entropy(&Tensor::scalar(1i32, cpu).unwrap(), 0.0, Reduction::Mean).unwrap();
    assert!((l.item::<f64>().unwrap() - x.narrow(0, 0, 1).unwrap().cross_entropy(&t.narrow(0, 0, 1).unwrap(), 0.0, Reduction::Mean).unwrap().item::<f64>().unwrap()).abs() < 1e-12);
    // Unbatched conv2d and pooling give the batched result without the batch dim.
    let img = Tensor::randn(&[3, 6, 6], DType::F32, cpu).unwrap();
    let w = Tensor::randn(&[2, 3, 3, 3], DType::F32, cpu).unwrap();
    let o = Conv2dOpts { padding: [1, 1], ..Default::default() };
    let a = img.conv2d(&w, None, o).unwrap();
    let b = img.unsqueeze(0).unwrap().conv2d(&w, None, o).unwrap().squeeze(0).unwrap();
    assert_eq!(a.dims(), &[2, 6, 6]);
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(img.max_pool2d([2, 2], None, [0, 0]).unwrap().dims(), &[3, 3, 3]);
    assert_eq!(img.avg_pool2d([3, 3], Some([1, 1]), [1, 1]).unwrap().dims(), &[3, 6, 6]);
    // mse_loss broadcasts as PyTorch, and names both shapes when it cannot.
    let p = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], cpu).unwrap();
    let q = Tensor::from_vec(vec![1.0f32, 0.0], &[2], cpu).unwrap();
    assert_eq!(p.mse_loss(&q, Reduction::Mean).unwrap().item::<f32>().unwrap(), (0.0 + 4.0 + 4.0 + 16.0) / 4.0);
    let e = p.mse_loss(&Tensor::zeros(&[3], DType::F32, cpu).unwrap(), Reduction::Mean).unwrap_err().to_string();
    assert!(e.starts_with("mse_loss:") && e.contains("[2, 2]") && e.contains("[3]"), "{e}");
}

#[test]
fn relu_masks_after_pooling_and_fold_gradients_match_f64() -> voltaic::Result<()> {
    // On the CPU a ReLU's backward after max pooling's gradient or after
    // fold (a convolution's input gradient) runs on each block of their
    // result as it is made, in f32; f64 runs it as a pass of its own. The
    // f32 gradients must agree with the f64 ones.
    let mut rng = Rng::new(31);
    let dims: [&[usize]; 5] = [&[3, 3, 10, 9], &[5, 3, 3, 3], &[4, 5, 3, 3], &[2, 4, 3, 3], &[3, 2, 5, 4]];
    let vals: Vec<Vec<f64>> = dims.iter().map(|d| rng.normals(numel(d))).collect();
    let grads = |dt: DType| -> voltaic::Result<Vec<Vec<f64>>> {
        let ts: Vec<Tensor> = vals.iter().zip(dims).map(|(v, d)| tensor(v, d, dt).0).collect();
        let x = ts[0].requires_grad()?;
        let w: Vec<Tensor> = ts[1..4].iter().map(|t| t.requires_grad()).collect::<voltaic::Result<_>>()?;
        let o = Conv2dOpts { padding: [1, 1], ..Default::default() };
        // Pooling's gradient then a mask; fold then a mask.
        let h = x.conv2d(&w[0], None, o)?.relu()?.max_pool2d([2, 2], None, [0, 0])?;
        let y = h.conv2d(&w[1], None, o)?.relu()?.conv2d(&w[2], None, o)?;
        y.mul(&ts[4])?.sum_all()?.backward()?;
        [&x, &w[0], &w[1], &w[2]].iter().map(|t| t.grad().expect("a gradient").to_f64_vec()).collect()
    };
    let (want, got) = (grads(DType::F64)?, grads(DType::F32)?);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(w.iter().any(|v| *v != 0.0), "gradient {i} is all zeros: the test would not see a wrong mask");
        assert_close(g, w, 1e-4, 1e-4, &format!("gradient {i}"));
    }
    Ok(())
}

#[test]
fn max_pooling_gradients_of_2x2_windows_match_a_reference() -> voltaic::Result<()> {
    // 2x2 windows at stride 2 over contiguous f32 images of even size take
    // a vector path on the CPU (4 or 8 windows at a time, a row's last group
    // overlapping the one before, or one at a time below 4), with a ReLU's
    // mask as its epilogue. Ties (many after a ReLU) and NaNs decide which
    // tap gets each window's gradient: the first maximum in row-major
    // order, the first NaN.
    let mut rng = Rng::new(53);
    for dims in [[2, 3, 6, 14], [1, 2, 4, 16], [2, 1, 8, 34], [1, 1, 2, 8], [3, 2, 4, 6]] {
        let n = numel(&dims);
        let gv: Vec<f64> = rng.normals(n / 4).iter().map(|&v| round_f32(v)).collect();
        for relu in [false, true] {
            // NaNs only without the ReLU, whose own gradient at a NaN is not the point here.
            let xv: Vec<f64> = (0..n).map(|i| if i % 29 == 3 && !relu { f64::NAN } else { (rng.normal() * 1.5).round() }).collect();
            let x = tensor(&xv, &dims, DType::F32).0.requires_grad()?;
            let h = if relu { x.relu()? } else { x.clone() };
            let y = h.max_pool2d([2, 2], None, [0, 0])?;
            y.mul(&tensor(&gv, y.dims(), DType::F32).0)?.sum_all()?.backward()?;
            let got = x.grad().expect("a gradient").to_f64_vec()?;
            let (w, oh, ow) = (dims[3], dims[2] / 2, dims[3] / 2);
            let mut want = vec![0.0; n];
            for (k, &g) in gv.iter().enumerate() {
                let (plane, oy, ox) = (k / (oh * ow), k / ow % oh, k % ow);
                let taps = [(0, 0), (0, 1), (1, 0), (1, 1)].map(|(i, j)| plane * dims[2] * w + (2 * oy + i) * w + 2 * ox + j);
                let val = |p: usize| if relu { xv[p].max(0.0) } else { xv[p] };
                let first = taps.iter().copied().find(|&p| val(p).is_nan()).unwrap_or_else(|| {
                    let m = taps.iter().map(|&p| val(p)).fold(f64::NEG_INFINITY, f64::max);
                    taps.into_iter().find(|&p| val(p) == m).unwrap()
                });
                want[first] = if relu && xv[first] <= 0.0 { 0.0 } else { g };
            }
            assert_eq!(got, want, "{dims:?} relu {relu}");
        }
    }
    Ok(())
}
