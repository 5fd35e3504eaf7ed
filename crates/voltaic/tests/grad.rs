//! Every gradient against central finite differences in f64, on random
//! shapes with broadcasting, views and odd sizes; GPU gradients against CPU
//! gradients; the autograd API (accumulation, zero_grad, detach, no_grad).

mod common;

use common::Rng;
use voltaic::{Conv2dOpts, DType, Device, Reduction, Result, Tensor};

/// Leaves of the given shapes with values from `gen`, as f64 on the CPU.
fn leaves(rng: &mut Rng, shapes: &[&[usize]], gen: &dyn Fn(&mut Rng) -> f64) -> Vec<Vec<f64>> {
    shapes.iter().map(|s| (0..s.iter().product::<usize>()).map(|_| gen(rng)).collect()).collect()
}

fn build(vals: &[Vec<f64>], shapes: &[&[usize]], track: bool) -> Vec<Tensor> {
    vals.iter()
        .zip(shapes)
        .map(|(v, s)| {
            let t = Tensor::from_vec(v.clone(), s, Device::Cpu).unwrap();
            if track { t.requires_grad().unwrap() } else { t }
        })
        .collect()
}

/// `sum(f(x) * w)` for fixed random weights `w`, so every output element matters.
fn loss(y: &Tensor, w: &Tensor) -> Result<Tensor> {
    y.to_dtype(DType::F64)?.mul(w)?.sum_all()
}

/// Compare the gradients of `sum(f(inputs) * w)` with central differences.
fn check(what: &str, shapes: &[&[usize]], gen: &dyn Fn(&mut Rng) -> f64, f: &dyn Fn(&[Tensor]) -> Result<Tensor>) {
    let mut rng = Rng::new(what.len() as u64 * 7919 + shapes.len() as u64);
    let vals = leaves(&mut rng, shapes, gen);
    let xs = build(&vals, shapes, true);
    let y = f(&xs).unwrap_or_else(|e| panic!("{what}: {e}"));
    let w = Tensor::from_vec((0..y.numel()).map(|_| rng.normal()).collect::<Vec<f64>>(), y.dims(), Device::Cpu).unwrap();
    loss(&y, &w).unwrap().backward().unwrap_or_else(|e| panic!("{what}: backward: {e}"));
    let eval = |v: &[Vec<f64>]| -> f64 { loss(&f(&build(v, shapes, false)).unwrap(), &w).unwrap().item::<f64>().unwrap() };
    let eps = 1e-6;
    for (i, x) in xs.iter().enumerate() {
        let got = x.grad().unwrap_or_else(|| panic!("{what}: input {i} got no gradient")).to_vec::<f64>().unwrap();
        assert_eq!(got.len(), vals[i].len(), "{what}: gradient {i} has the wrong size");
        for j in 0..vals[i].len() {
            let mut hi = vals.to_vec();
            hi[i][j] += eps;
            let mut lo = vals.to_vec();
            lo[i][j] -= eps;
            let want = (eval(&hi) - eval(&lo)) / (2.0 * eps);
            let tol = 1e-5 * (1.0 + want.abs());
            assert!((got[j] - want).abs() <= tol, "{what}: d/dx{i}[{j}] is {}, finite differences give {want}", got[j]);
        }
    }
}

fn normal(r: &mut Rng) -> f64 {
    r.normal()
}
fn positive(r: &mut Rng) -> f64 {
    0.5 + 2.0 * r.uniform()
}
/// Draws one input value for a gradient check.
type Sample = fn(&mut Rng) -> f64;

/// Away from the kinks of abs, relu, sign-like ops at 0.
fn off_zero(r: &mut Rng) -> f64 {
    let v = 0.2 + r.uniform();
    if r.uniform() < 0.5 { -v } else { v }
}

#[test]
fn unary_gradients() {
    type F = fn(&Tensor) -> Result<Tensor>;
    let ops: &[(&str, F, Sample)] = &[
        ("neg", Tensor::neg, normal),
        ("abs", Tensor::abs, off_zero),
        ("exp", Tensor::exp, normal),
        ("log", Tensor::log, positive),
        ("log1p", Tensor::log1p, positive),
        ("expm1", Tensor::expm1, normal),
        ("sqrt", Tensor::sqrt, positive),
        ("rsqrt", Tensor::rsqrt, positive),
        ("recip", Tensor::recip, off_zero),
        ("sin", Tensor::sin, normal),
        ("cos", Tensor::cos, normal),
        ("tanh", Tensor::tanh, normal),
        ("sigmoid", Tensor::sigmoid, normal),
        ("relu", Tensor::relu, off_zero),
        ("erf", Tensor::erf, normal),
        ("gelu", Tensor::gelu, normal),
        ("gelu_tanh", Tensor::gelu_tanh, normal),
        ("silu", Tensor::silu, normal),
        ("softplus", Tensor::softplus, normal),
        ("sqr", Tensor::sqr, normal),
        ("floor", Tensor::floor, off_zero),
        ("sign", Tensor::sign, off_zero),
    ];
    for (name, f, gen) in ops {
        check(name, &[&[3, 5]], gen, &|x| f(&x[0]));
        check(&format!("{name} transposed"), &[&[4, 3]], gen, &|x| f(&x[0].t()?));
    }
    check("leaky_relu", &[&[7]], &off_zero, &|x| x[0].leaky_relu(0.1));
    check("clamp", &[&[9]], &off_zero, &|x| x[0].clamp(Some(-0.5), Some(0.6)));
}

#[test]
fn binary_gradients_with_broadcasting() {
    type F = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: &[(&str, F, Sample)] = &[
        ("add", |a, b| a.add(b), normal),
        ("sub", |a, b| a.sub(b), normal),
        ("mul", |a, b| a.mul(b), normal),
        ("div", |a, b| a.div(b), off_zero),
        ("pow", |a, b| a.pow(b), positive),
        ("rem", |a, b| a.rem(b), positive),
        ("maximum", |a, b| a.maximum(b), normal),
        ("minimum", |a, b| a.minimum(b), normal),
    ];
    for (name, f, gen) in ops {
        check(name, &[&[2, 3, 4], &[2, 3, 4]], gen, &|x| f(&x[0], &x[1]));
        check(&format!("{name} broadcast"), &[&[2, 1, 4], &[3, 1]], gen, &|x| f(&x[0], &x[1]));
        check(&format!("{name} scalar-like"), &[&[5], &[]], gen, &|x| f(&x[0], &x[1]));
    }
    check("mul scalar", &[&[4]], &normal, &|x| x[0].mul(2.5)?.add(1.0)?.div(3.0)?.sub(0.5));
    check("where", &[&[3, 4], &[4]], &normal, &|x| x[0].gt(0.0)?.where_cond(&x[0], &x[1]));
    check("masked_fill", &[&[3, 4]], &normal, &|x| x[0].masked_fill(&x[0].lt(0.0)?, 2.0));
}

#[test]
fn reduction_gradients() {
    let s: &[usize] = &[3, 4, 5];
    for axes in [&[][..], &[0], &[-1], &[0, 2], &[1]] {
        for keep in [false, true] {
            let w = format!("{axes:?} keep={keep}");
            check(&format!("sum {w}"), &[s], &normal, &|x| x[0].sum(axes, keep));
            check(&format!("mean {w}"), &[s], &normal, &|x| x[0].mean(axes, keep));
            check(&format!("prod {w}"), &[s], &positive, &|x| x[0].prod(axes, keep));
            check(&format!("max {w}"), &[s], &normal, &|x| x[0].max(axes, keep));
            check(&format!("min {w}"), &[s], &normal, &|x| x[0].min(axes, keep));
            check(&format!("var {w}"), &[s], &normal, &|x| x[0].var(axes, 1, keep));
            check(&format!("std {w}"), &[s], &normal, &|x| x[0].std(axes, 0, keep));
            check(&format!("logsumexp {w}"), &[s], &normal, &|x| x[0].logsumexp(axes, keep));
        }
    }
    for d in [0, 1, -1] {
        check(&format!("softmax {d}"), &[s], &normal, &|x| x[0].softmax(d));
        check(&format!("log_softmax {d}"), &[s], &normal, &|x| x[0].log_softmax(d));
        check(&format!("cumsum {d}"), &[s], &normal, &|x| x[0].cumsum(d));
    }
    check("sum of permuted", &[&[2, 3, 4]], &normal, &|x| x[0].permute(&[2, 0, 1])?.sum(&[1], false));
}

#[test]
fn view_gradients() {
    check("reshape", &[&[2, 6]], &normal, &|x| x[0].reshape(&[3, -1])?.mul(&x[0].reshape(&[3, 4])?));
    check("reshape of transposed (copy)", &[&[3, 4]], &normal, &|x| x[0].t()?.reshape(&[12])?.narrow(0, 2, 7));
    check("permute", &[&[2, 3, 4]], &normal, &|x| x[0].permute(&[1, 2, 0])?.sin());
    check("transpose", &[&[2, 3, 4]], &normal, &|x| x[0].transpose(0, 2)?.exp());
    check("narrow", &[&[5, 4]], &normal, &|x| x[0].narrow(0, 1, 3)?.narrow(1, 2, 2));
    check("slice step", &[&[9, 3]], &normal, &|x| x[0].slice(0, 1, 8, 3)?.mul(2.0));
    check("slice negative", &[&[7]], &normal, &|x| x[0].slice(0, -4, -1, 2));
    check("squeeze unsqueeze", &[&[3, 1, 2]], &normal, &|x| x[0].squeeze(1)?.unsqueeze(0)?.tanh());
    check("squeeze_all", &[&[1, 3, 1]], &normal, &|x| x[0].squeeze_all()?.exp());
    check("flatten", &[&[2, 3, 2]], &normal, &|x| x[0].flatten(1, 2)?.sqr());
    check("expand", &[&[3, 1]], &normal, &|x| x[0].expand(&[2, 3, 4])?.mul(&Tensor::arange(0.0, 24.0, 1.0, DType::F64, Device::Cpu)?.reshape(&[2, 3, 4])?));
    check("contiguous", &[&[3, 4]], &normal, &|x| x[0].t()?.contiguous()?.sqr());
    check("same input twice", &[&[4]], &normal, &|x| x[0].mul(&x[0])?.add(&x[0].sin()?));
}

/// Slices of one tensor have their gradients joined when it is complete
/// (one cat with zeros in the gaps): every arrangement must still give the
/// gradient of the whole.
#[test]
fn gradients_of_many_slices_of_one_tensor() {
    let mix = |parts: Vec<Tensor>| -> Result<Tensor> {
        let mut total = parts[0].sum_all()?;
        for (i, p) in parts.iter().enumerate() {
            total = total.add(&p.sqr()?.mul(1.0 + i as f64)?.sum_all()?)?;
        }
        Ok(total)
    };
    // Three that tile dim 1 (queries, keys and values of a stacked product).
    check("slices tiling a dim", &[&[2, 9]], &normal, &|x| mix(vec![x[0].narrow(1, 0, 3)?, x[0].narrow(1, 6, 3)?, x[0].narrow(1, 3, 3)?]));
    // Gaps before, between and after, out of order.
    check("slices with gaps", &[&[11, 2]], &normal, &|x| mix(vec![x[0].narrow(0, 7, 2)?, x[0].narrow(0, 1, 3)?]));
    // Overlapping slices, the same slice twice, an empty one and a whole use.
    check("overlapping slices", &[&[3, 8]], &normal, &|x| {
        mix(vec![x[0].narrow(1, 0, 5)?, x[0].narrow(1, 3, 4)?, x[0].narrow(1, 3, 4)?, x[0].narrow(1, 8, 0)?, x[0].exp()?])
    });
    // Slices along two dims of one tensor, and a slice of a slice.
    check("slices along two dims", &[&[4, 6]], &normal, &|x| {
        mix(vec![x[0].narrow(0, 1, 2)?, x[0].narrow(1, 2, 3)?, x[0].narrow(0, 0, 3)?.narrow(1, 1, 4)?, x[0].narrow(0, 3, 1)?])
    });
    // Only empty slices: the gradient is zero, of the tensor's shape.
    let x = Tensor::from_vec(vec![1f64, 2., 3.], &[3], Device::Cpu).unwrap().requires_grad().unwrap();
    x.narrow(0, 1, 0).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![0.0; 3]);
}

#[test]
fn linear_algebra_gradients() {
    let cases: &[(&[usize], &[usize])] = &[(&[4], &[4]), (&[3], &[3, 2]), (&[2, 3], &[3]), (&[2, 3], &[3, 4]), (&[2, 1, 3, 4], &[3, 4, 2]), (&[5, 2, 3], &[3, 1])];
    for (a, b) in cases {
        check(&format!("matmul {a:?} @ {b:?}"), &[a, b], &normal, &|x| x[0].matmul(&x[1]));
    }
    check("matmul transposed views", &[&[4, 3], &[5, 4]], &normal, &|x| x[0].t()?.matmul(&x[1].t()?));
    check("matmul of a batch by a transposed weight", &[&[2, 3, 4], &[5, 4]], &normal, &|x| x[0].matmul(&x[1].t()?));
}

#[test]
fn a_transposed_weights_gradient_comes_back_in_the_weights_order() {
    // `x @ w.t()` (a linear layer): the optimizer and the gradient scaler
    // then read the gradient in order. The layout is chosen above the
    // executors, so the CPU shows it for every device.
    let w = Tensor::randn(&[5, 4], DType::F32, Device::Cpu).unwrap().requires_grad().unwrap();
    for x in [&[3, 4][..], &[2, 3, 4]] {
        let x = Tensor::randn(x, DType::F32, Device::Cpu).unwrap();
        w.zero_grad();
        x.matmul(&w.t().unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let g = w.grad().unwrap();
        assert!(g.is_contiguous(), "input {:?}: gradient strides {:?}", x.dims(), g.layout().strides());
        let want: Vec<f32> = x.reshape_dims(&[x.numel() / 4, 4]).unwrap().sum(&[0], false).unwrap().to_vec().unwrap();
        let got: Vec<f32> = g.to_vec().unwrap();
        for (j, v) in got.iter().enumerate() {
            assert!((v - want[j % 4]).abs() <= 1e-5 * (1.0 + want[j % 4].abs()), "d/dw[{j}] = {v}, want {}", want[j % 4]);
        }
    }
}

#[test]
fn indexing_and_joining_gradients() {
    let idx = |v: &[i32], d: &[usize]| Tensor::from_vec(v.to_vec(), d, Device::Cpu).unwrap();
    let gi = idx(&[2, 0, 1, 1, 2, 0, 0, 0], &[2, 4]);
    check("gather", &[&[2, 3]], &normal, &|x| x[0].gather(1, &gi));
    let si = idx(&[1, 0, 1, 2, 2, 0], &[3, 2]);
    check("scatter_add", &[&[3, 2], &[3, 2]], &normal, &|x| x[0].scatter_add(0, &si, &x[1]));
    let sel = idx(&[3, 0, 3, 1], &[4]);
    check("index_select", &[&[4, 3]], &normal, &|x| x[0].index_select(0, &sel));
    check("index_select dim 1", &[&[2, 4]], &normal, &|x| x[0].index_select(1, &sel));
    let tok = idx(&[1, 4, 1, 0, 2, 2], &[2, 3]);
    check("embedding", &[&[5, 3]], &normal, &|x| x[0].embedding(&tok));
    check("cat", &[&[2, 3], &[2, 1], &[2, 2]], &normal, &|x| Tensor::cat(&[&x[0], &x[1], &x[2]], 1));
    check("stack", &[&[3], &[3]], &normal, &|x| Tensor::stack(&[&x[0], &x[1]], 1));
    check("split chunk", &[&[6, 2]], &normal, &|x| {
        let s = x[0].split(4, 0)?;
        let c = x[0].chunk(3, 0)?;
        s[1].mul(&c[0])
    });
}

#[test]
fn nn_gradients() {
    let opts = Conv2dOpts { stride: [2, 1], padding: [1, 1], dilation: [1, 2], groups: 2 };
    check("conv2d", &[&[2, 4, 5, 6], &[6, 2, 3, 2], &[6]], &normal, &|x| x[0].conv2d(&x[1], Some(&x[2]), opts));
    check("conv2d plain", &[&[1, 2, 4, 4], &[3, 2, 3, 3]], &normal, &|x| x[0].conv2d(&x[1], None, Conv2dOpts::default()));
    check("max_pool2d", &[&[1, 2, 5, 5]], &normal, &|x| x[0].max_pool2d([2, 3], Some([2, 1]), [1, 1]));
    check("avg_pool2d", &[&[2, 1, 4, 6]], &normal, &|x| x[0].avg_pool2d([2, 2], None, [0, 0]));
    check("layer_norm", &[&[3, 6], &[6], &[6]], &normal, &|x| x[0].layer_norm(&[6], Some(&x[1]), Some(&x[2]), 1e-5));
    // Its gradient is one formula: over two trailing dims, without the
    // weight or the bias, over a whole 1-d input, and fed a transposed view.
    check("layer_norm over two dims", &[&[2, 3, 4], &[3, 4]], &normal, &|x| x[0].layer_norm(&[3, 4], Some(&x[1]), None, 1e-5));
    check("layer_norm, bias only", &[&[4, 5], &[5]], &normal, &|x| x[0].layer_norm(&[5], None, Some(&x[1]), 1e-3));
    check("layer_norm of a vector", &[&[7]], &normal, &|x| x[0].layer_norm(&[7], None, None, 1e-5)?.exp());
    check("layer_norm of a view", &[&[5, 3], &[5]], &normal, &|x| x[0].t()?.layer_norm(&[5], Some(&x[1]), None, 1e-5)?.sqr());
    let target = Tensor::from_vec(vec![2i32, 0, 4], &[3], Device::Cpu).unwrap();
    for (ls, red) in [(0.0, Reduction::Mean), (0.1, Reduction::Sum), (0.2, Reduction::None)] {
        check(&format!("cross_entropy {ls} {red:?}"), &[&[3, 5]], &normal, &|x| x[0].cross_entropy(&target, ls, red));
    }
    check("mse_loss", &[&[4, 2], &[4, 2]], &normal, &|x| x[0].mse_loss(&x[1], Reduction::Mean));
}

#[test]
fn gradients_accumulate_and_reset() {
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0], &[3], Device::Cpu).unwrap().requires_grad().unwrap();
    let y = x.sqr().unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![2.0, 4.0, 6.0]);
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![4.0, 8.0, 12.0], "accumulates across calls");
    x.zero_grad();
    assert!(x.grad().is_none());
    // Only leaves accumulate; detached values stop the flow.
    let z = x.mul(x.detach()).unwrap().sum_all().unwrap();
    z.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0, 3.0]);
    assert!(y.grad().is_none() && !y.is_leaf() && x.is_leaf());
    // no_grad records nothing.
    let n = voltaic::no_grad(|| x.mul(2.0).unwrap());
    assert!(!n.is_tracked());
    assert!(n.sum_all().unwrap().backward().is_err());
    // A given output gradient.
    x.zero_grad();
    let v = x.mul(3.0).unwrap();
    v.backward_with(&Tensor::from_vec(vec![1.0f64, 0.0, -1.0], &[3], Device::Cpu).unwrap()).unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![3.0, 0.0, -3.0]);
    assert!(Tensor::from_vec(vec![1i32], &[1], Device::Cpu).unwrap().requires_grad().is_err());
    // Casts pass gradients through, converted back to the input's dtype.
    x.zero_grad();
    x.to_dtype(DType::F32).unwrap().mul(2.0).unwrap().sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!((g.dtype(), g.to_vec::<f64>().unwrap()), (DType::F64, vec![2.0; 3]));
    assert!(v.backward().is_err(), "backward() needs a scalar");
}

#[test]
fn a_long_chain_backpropagates_without_overflowing_the_stack() {
    let x = Tensor::from_vec(vec![0.5f64; 4], &[4], Device::Cpu).unwrap().requires_grad().unwrap();
    let mut y = x.clone();
    for _ in 0..5000 {
        y = y.mul(1.0001).unwrap();
    }
    y.sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap().to_vec::<f64>().unwrap();
    assert!((g[0] - 1.0001f64.powi(5000)).abs() < 1e-9, "{}", g[0]);
}

/// GPU gradients against CPU gradients on the same f32 inputs (lavapipe in CI).
#[test]
fn gpu_gradients_match_cpu() {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    let gpu = Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0));
    let mut rng = Rng::new(42);
    let mut t = |d: &[usize]| Tensor::from_vec((0..d.iter().product::<usize>()).map(|_| rng.normal() as f32).collect::<Vec<f32>>(), d, Device::Cpu).unwrap();
    let (x, w1, b1, w2) = (t(&[6, 2, 5, 5]), t(&[3, 2, 3, 3]), t(&[3]), t(&[12, 4]));
    let target = Tensor::from_vec(vec![0i32, 3, 1, 2, 2, 0], &[6], Device::Cpu).unwrap();
    let run = |dev: Device| -> Vec<Vec<f32>> {
        let p: Vec<Tensor> = [&x, &w1, &b1, &w2].iter().map(|v| v.to_device(dev).unwrap().requires_grad().unwrap()).collect();
        let h = p[0].conv2d(&p[1], Some(&p[2]), Conv2dOpts { padding: [1, 1], ..Default::default() }).unwrap();
        let h = h.relu().unwrap().max_pool2d([2, 2], None, [0, 0]).unwrap().flatten(1, -1).unwrap();
        let h = h.layer_norm(&[12], None, None, 1e-5).unwrap();
        // The product in two halves: slices of h and of w2, whose gradients are joined.
        let half = |t: &Tensor, d: isize, i: usize| t.narrow(d, 6 * i, 6).unwrap();
        let logits = half(&h, 1, 0).matmul(&half(&p[3], 0, 0)).unwrap().add(half(&h, 1, 1).matmul(&half(&p[3], 0, 1)).unwrap()).unwrap();
        let loss = logits.cross_entropy(&target.to_device(dev).unwrap(), 0.1, Reduction::Mean).unwrap();
        loss.backward().unwrap();
        let mut out = vec![loss.to_vec::<f32>().unwrap()];
        out.extend(p.iter().map(|v| v.grad().unwrap().to_vec::<f32>().unwrap()));
        out
    };
    let (c, g) = (run(Device::Cpu), run(gpu));
    for (i, (a, b)) in c.iter().zip(&g).enumerate() {
        for (j, (u, v)) in a.iter().zip(b).enumerate() {
            assert!((u - v).abs() <= 1e-4 * (1.0 + u.abs()), "tensor {i}, element {j}: cpu {u} vs gpu {v}");
        }
    }
}

/// The gradient of `f` at the given f64 inputs, one vector per input.
fn grads_at(inputs: &[(&[f64], &[usize])], f: &dyn Fn(&[Tensor]) -> Result<Tensor>) -> Vec<Vec<f64>> {
    let xs: Vec<Tensor> = inputs.iter().map(|(v, s)| Tensor::from_vec(v.to_vec(), s, Device::Cpu).unwrap().requires_grad().unwrap()).collect();
    f(&xs).unwrap().sum_all().unwrap().backward().unwrap();
    xs.iter().map(|x| x.grad().unwrap().to_vec::<f64>().unwrap()).collect()
}

#[test]
fn gradients_at_kinks_follow_pytorch() {
    // softplus'(0) = sigmoid(0) = 0.5 (its parts relu and abs have kinks there).
    let g = grads_at(&[(&[0.0, -30.0, 30.0], &[3])], &|t| t[0].softplus());
    assert_eq!(g[0][0], 0.5);
    assert!((g[0][1] - 1.0 / (1.0 + 30f64.exp())).abs() < 1e-15 && (g[0][2] - 1.0).abs() < 1e-12, "{:?}", g[0]);
    // clamp passes the whole gradient at its bounds (inclusive), none outside.
    let g = grads_at(&[(&[-1.0, 0.0, 0.5, 1.0, 2.0], &[5])], &|t| t[0].clamp(Some(0.0), Some(1.0)));
    assert_eq!(g[0], vec![0.0, 1.0, 1.0, 1.0, 0.0]);
    let g = grads_at(&[(&[0.0, 5.0], &[2])], &|t| t[0].clamp(Some(2.0), Some(1.0)));
    assert_eq!(g[0], vec![0.0, 0.0], "min > max: constant max, no gradient");
    // prod: the product of the others at a lone zero, 0 at zeros that share a group.
    let g = grads_at(&[(&[2.0, 0.0, 3.0, 0.0, 0.0, 5.0, 1.5, 2.0, 4.0], &[3, 3])], &|t| t[0].prod(&[1], false));
    assert_eq!(g[0], vec![0.0, 6.0, 0.0, 0.0, 0.0, 0.0, 8.0, 6.0, 3.0]);
    // max_pool2d routes each window's gradient to its first maximum (tiled and unfolded windows).
    let x = [1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 2.0, 2.0, 5.0, 5.0, 1.0, 1.0, 5.0, 5.0, 1.0, 1.0];
    let g = grads_at(&[(&x, &[1, 1, 4, 4])], &|t| t[0].max_pool2d([2, 2], None, [0, 0]));
    assert_eq!(g[0], vec![0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    // A NaN is the maximum of its window (as in PyTorch): the first NaN gets the gradient.
    let n = f64::NAN;
    let xn = [1.0, n, 3.0, 0.0, n, 2.0, 2.0, 2.0, 5.0, 5.0, n, 1.0, 5.0, 5.0, 1.0, n];
    let g = grads_at(&[(&xn, &[1, 1, 4, 4])], &|t| t[0].max_pool2d([2, 2], None, [0, 0]));
    assert_eq!(g[0], vec![0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let g = grads_at(&[(&x, &[1, 1, 4, 4])], &|t| t[0].max_pool2d([3, 3], Some([1, 1]), [1, 1]));
    let want = {
        // First maximum of each 3x3 window (padded with -inf) in row-major order, counted.
        let mut w = vec![0.0; 16];
        for oy in 0..4i32 {
            for ox in 0..4i32 {
                let mut best = (f64::NEG_INFINITY, 0usize);
                for ky in -1..=1 {
                    for kx in -1..=1 {
                        let (y, xx) = (oy + ky, ox + kx);
                        if (0..4).contains(&y) && (0..4).contains(&xx) && x[(y * 4 + xx) as usize] > best.0 {
                            best = (x[(y * 4 + xx) as usize], (y * 4 + xx) as usize);
                        }
                    }
                }
                w[best.1] += 1.0;
            }
        }
        w
    };
    assert_eq!(g[0], want);
    // pow at a = 0, b = 0: d/da is 0 (PyTorch), d/db is 0 where a = 0 and b >= 0.
    let g = grads_at(&[(&[0.0, 0.0, 2.0], &[3]), (&[0.0, 2.0, 3.0], &[3])], &|t| t[0].pow(&t[1]));
    assert_eq!(g[0], vec![0.0, 0.0, 12.0]);
    assert_eq!(g[1][..2], [0.0, 0.0]);
    assert!((g[1][2] - 8.0 * 2f64.ln()).abs() < 1e-12);
}

#[test]
fn new_gradients_match_finite_differences() {
    let away = |r: &mut Rng| {
        let v = 0.3 + r.uniform() * 2.0;
        if r.uniform() < 0.5 { -v } else { v }
    };
    check("softplus", &[&[7]], &normal, &|t| t[0].softplus());
    check("clamp", &[&[3, 5]], &away, &|t| t[0].clamp(Some(-1.0), Some(0.8)));
    check("prod with a zero", &[&[4, 3]], &normal, &|t| t[0].mul(&Tensor::from_vec(vec![1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], &[4, 3], Device::Cpu)?)?.add(&t[0].mul(0.0)?)?.prod(&[1], false));
    check("max_pool2d overlapping", &[&[2, 2, 5, 5]], &normal, &|t| t[0].max_pool2d([3, 3], Some([2, 2]), [1, 1]));
    check("max_pool2d tiled", &[&[1, 3, 4, 6]], &normal, &|t| t[0].max_pool2d([2, 2], None, [0, 0]));
    check("cross_entropy ignore_index + smoothing", &[&[5, 4]], &normal, &|t| {
        let target = Tensor::from_vec(vec![1i32, -100, 3, 0, -100], &[5], Device::Cpu)?;
        t[0].cross_entropy(&target, 0.2, Reduction::Mean)
    });
}
