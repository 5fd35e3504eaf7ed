//! Mixed precision: 16-bit storage on the GPU (bf16 packed two to a word
//! everywhere, f16 too where the adapter lacks SHADER_F16), conversions
//! rounding to nearest even on edge values, the autocast policy and its
//! gradients, and dynamic loss scaling with a forced overflow.

mod common;
use common::{round_bf16, round_f16, Rng};
use voltaic::nn::{Conv2d, Forward, LayerNorm, Linear, Module};
use voltaic::optim::{Adam, GradScaler, Optimizer, Sgd};
use voltaic::{autocast, Conv2dOpts, DType, Device, Reduction, Tensor};

/// The memory test reads the device's pool counters, which other tests'
/// buffers would move: the tests of this file run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn gpu() -> Device {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)");
    Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0))
}

fn devices() -> [Device; 2] {
    [Device::Cpu, gpu()]
}

/// Same value, NaN equal to NaN and -0 different from +0.
fn same(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || (a == b && a.is_sign_negative() == b.is_sign_negative())
}

#[test]
fn half_types_take_two_bytes_per_element_on_the_gpu() {
    let _serial = serial();
    let dev = gpu();
    let n = 1 << 20;
    let in_use = || dev.memory_stats().unwrap().in_use;
    let mut rng = Rng::new(1);
    let data: Vec<f32> = rng.normals(n).into_iter().map(|v| v as f32).collect();
    let x32 = Tensor::from_vec(data, &[n], Device::Cpu).unwrap();
    let before = in_use();
    let g32 = x32.to_device(dev).unwrap();
    let f32_bytes = in_use() - before;
    assert!(f32_bytes >= 4 * n as u64, "an f32 tensor of {n} elements took {f32_bytes} bytes");
    for dt in [DType::BF16, DType::F16] {
        let h = x32.to_dtype(dt).unwrap();
        let before = in_use();
        let g = h.to_device(dev).unwrap();
        let bytes = in_use() - before;
        // The pool rounds sizes up to its buckets: half, to within them.
        let half = |b: u64| (b as f64 / f32_bytes as f64 - 0.5).abs() < 0.01;
        assert!(half(bytes), "{dt}: {bytes} bytes on the GPU against {f32_bytes} for f32");
        // And a tensor computed on the GPU in that type.
        let before = in_use();
        let y = g32.to_dtype(dt).unwrap();
        y.realize().unwrap();
        assert!(half(in_use() - before), "{dt} computed on the GPU: {} bytes", in_use() - before);
        assert_eq!(y.to_f64_vec().unwrap(), h.to_f64_vec().unwrap(), "{dt}: the GPU cast differs from the CPU's");
        drop((g, y));
    }
}

/// f32 values at the edges of both half types: ties, subnormals, overflow
/// thresholds, infinities, NaN, signed zeros.
fn edge_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        -f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,  // f32 subnormal
        -1e-45, // smallest f32 subnormal
        65504.0,
        65519.0,  // rounds down to f16's max
        65520.0,  // ties away to inf in f16
        -65520.0, // and -inf
        5.960_464_5e-8,       // 2^-24, f16's smallest subnormal
        2.980_232_2e-8,       // 2^-25: a tie between 0 and 2^-24, to even (0)
        8.940_697e-8,         // 3 * 2^-25: a tie, to even (2^-22)
        6.097_555e-5,         // f16's largest subnormal
        f32::from_bits(0x7f7f_0000), // bf16's largest finite
        f32::from_bits(0x7f7f_8000), // halfway from it to inf: to even, inf
        f32::from_bits(0x0001_0000), // a bf16 subnormal
        -3.0e-39,             // an f32 subnormal that bf16 rounds
    ];
    // Ties and near-ties around 1 for both mantissa widths.
    for k in [1u32, 2, 3, 4, 5, 7, 8] {
        v.push(f32::from_bits(0x3f80_0000 + (k << 15))); // bf16: k halves of its ulp
        v.push(f32::from_bits(0x3f80_0000 + (k << 12))); // f16: k halves of its ulp
        v.push(-f32::from_bits(0x3f80_0000 + (k << 15) + 1));
    }
    let mut rng = Rng::new(7);
    for _ in 0..41 {
        // Odd count: the packed layout's last word is half used.
        v.push((rng.normal() * 10f64.powi(rng.below(20) as i32 - 10)) as f32);
    }
    v
}

#[test]
fn conversions_round_to_nearest_even_on_edge_values() {
    let _serial = serial();
    let vals = edge_values();
    assert!(vals.len() % 2 == 1);
    for dev in devices() {
        let x = Tensor::from_vec(vals.clone(), &[vals.len()], Device::Cpu).unwrap().to_device(dev).unwrap();
        for (dt, round) in [(DType::BF16, round_bf16 as fn(f64) -> f64), (DType::F16, round_f16)] {
            let h = x.to_dtype(dt).unwrap();
            let got = h.to_f64_vec().unwrap();
            for (v, g) in vals.iter().zip(&got) {
                let want = round(*v as f64);
                assert!(same(*g, want), "{dev} {v:e} ({:#010x}) -> {dt}: got {g:e}, want {want:e}", v.to_bits());
            }
            // Back to f32 exactly, and through a computation (x * 1 + 0 rounds again: no change).
            let back = h.to_dtype(DType::F32).unwrap().to_f64_vec().unwrap();
            assert!(back.iter().zip(&got).all(|(a, b)| same(*a, *b)), "{dev} {dt} -> f32 is not exact");
            // Arithmetic may flush f32 subnormals to zero (WGSL allows it;
            // NVIDIA's Vulkan driver does), conversions never do.
            let again = h.mul(1.0).unwrap().to_f64_vec().unwrap();
            let flushed = |a: f64, b: f64| a == 0.0 && b.abs() < f32::MIN_POSITIVE as f64;
            for (a, b) in again.iter().zip(&got) {
                assert!(same(*a, *b) || (*a == 0.0 && *b == 0.0) || flushed(*a, *b), "{dev} {dt}: x * 1 gave {a:e} for {b:e}");
            }
        }
    }
}

/// Elementwise work, odd-sized strided views and scatter-adds in the half
/// types give the same bits on the GPU as on the CPU: every thread's
/// half-word stores land, whatever the word's other half is doing.
/// GELU (both forms) and SiLU on half inputs compute in f32 and round once,
/// forward and backward, as PyTorch's kernels do: the results are the f32
/// op's on the same half values, rounded to the half type, bit for bit.
#[test]
fn half_activations_compute_in_f32_and_round_once() {
    let _serial = serial();
    let mut rng = Rng::new(11);
    let n = 1001;
    let xs: Vec<f32> = rng.normals(n).into_iter().map(|v| (v * 3.0) as f32).collect();
    let gs: Vec<f32> = rng.normals(n).into_iter().map(|v| v as f32).collect();
    type Act = fn(&Tensor) -> voltaic::Result<Tensor>;
    let acts: [(&str, Act); 3] = [("gelu", Tensor::gelu), ("gelu_tanh", Tensor::gelu_tanh), ("silu", Tensor::silu)];
    for dev in devices() {
        for dt in [DType::F16, DType::BF16] {
            let x = Tensor::from_vec(xs.clone(), &[n], dev).unwrap().to_dtype(dt).unwrap();
            let g = Tensor::from_vec(gs.clone(), &[n], dev).unwrap().to_dtype(dt).unwrap();
            for (name, f) in acts {
                // The half op, its upstream gradient `g` exactly.
                let xh = x.detach().requires_grad().unwrap();
                let yh = f(&xh).unwrap();
                assert_eq!(yh.dtype(), dt, "{name} {dt} on {dev}: output dtype");
                yh.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
                // The f32 op on the same values, rounded once.
                let x32 = x.to_dtype(DType::F32).unwrap().requires_grad().unwrap();
                let y32 = f(&x32).unwrap();
                y32.mul(g.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                let want_y = y32.to_dtype(dt).unwrap().to_f64_vec().unwrap();
                let want_g = x32.grad().unwrap().to_dtype(dt).unwrap().to_f64_vec().unwrap();
                let got_y = yh.to_f64_vec().unwrap();
                let got_g = xh.grad().unwrap().to_f64_vec().unwrap();
                let bad_y = want_y.iter().zip(&got_y).filter(|(w, g)| !same(**w, **g)).count();
                let bad_g = want_g.iter().zip(&got_g).filter(|(w, g)| !same(**w, **g)).count();
                assert_eq!((bad_y, bad_g), (0, 0), "{name} {dt} on {dev}: values (forward, gradient) that differ from f32 rounded once");
            }
        }
    }
}

#[test]
fn packed_halves_compute_like_the_cpu() {
    let _serial = serial();
    let dev = gpu();
    let mut rng = Rng::new(3);
    for dt in [DType::BF16, DType::F16] {
        for n in [1usize, 3, 255, 4097, 100_003] {
            let a: Vec<f32> = rng.normals(n).into_iter().map(|v| v as f32).collect();
            let b: Vec<f32> = rng.normals(n).into_iter().map(|v| v as f32).collect();
            let ca = Tensor::from_vec(a, &[n], Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let cb = Tensor::from_vec(b, &[n], Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let (ga, gb) = (ca.to_device(dev).unwrap(), cb.to_device(dev).unwrap());
            // Correctly rounded f32 ops only (WGSL's exp and division may be an ulp off).
            let f = |x: &Tensor, y: &Tensor| x.mul(y)?.add(1.5)?.maximum(&x.neg()?)?.sub(&x.sqr()?);
            let (want, got) = (f(&ca, &cb).unwrap().to_f64_vec().unwrap(), f(&ga, &gb).unwrap().to_f64_vec().unwrap());
            let bad = want.iter().zip(&got).filter(|(w, g)| !same(**w, **g)).count();
            assert_eq!(bad, 0, "{dt} n={n}: {bad} elements differ between CPU and GPU");
            // Views at odd element offsets and strides (half-word starts).
            if n > 8 {
                let m = (n - 3) / 2;
                let v = |t: &Tensor| t.narrow(0, 1, n - 2)?.narrow(0, 1, 2 * m)?.reshape(&[m as isize, 2])?.t()?.add(0.25);
                let (want, got) = (v(&ca).unwrap().to_f64_vec().unwrap(), v(&ga).unwrap().to_f64_vec().unwrap());
                assert!(want.iter().zip(&got).all(|(w, g)| same(*w, *g)), "{dt} n={n}: a strided view differs");
            }
        }
        // Scatter-add into a half tensor along a long dim (the atomic path) and a short one.
        for (rows, len) in [(5usize, 300usize), (33, 7)] {
            let idx: Vec<i32> = (0..rows * len).map(|_| rng.below(rows) as i32).collect();
            let src: Vec<f32> = rng.normals(rows * len).into_iter().map(|v| (v * 4.0).round() as f32 / 4.0).collect();
            let idx = Tensor::from_vec(idx, &[len, rows], Device::Cpu).unwrap().t().unwrap();
            let src = Tensor::from_vec(src, &[rows, len], Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let base = Tensor::zeros(&[rows, 3], dt, Device::Cpu).unwrap();
            let idx = idx.narrow(1, 0, len).unwrap();
            let c = base.scatter_add(1, &idx.rem(3).unwrap(), &src).unwrap().to_f64_vec().unwrap();
            let g = base
                .to_device(dev)
                .unwrap()
                .scatter_add(1, &idx.rem(3).unwrap().to_device(dev).unwrap(), &src.to_device(dev).unwrap())
                .unwrap()
                .to_f64_vec()
                .unwrap();
            // Small multiples of 1/4 add exactly in either order while they stay small.
            for (a, b) in c.iter().zip(&g) {
                assert!((a - b).abs() <= 0.02 * a.abs().max(1.0), "{dt} scatter_add [{rows}, {len}]: cpu {a} gpu {b}");
            }
        }
    }
}

#[test]
fn autocast_runs_products_low_and_norms_softmax_losses_in_f32() {
    let _serial = serial();
    for dev in devices() {
        for low in [DType::F16, DType::BF16] {
            voltaic::manual_seed(4);
            let lin = Linear::new(12, 5, true, dev).unwrap();
            let conv = Conv2d::new(3, 4, [3, 3], Conv2dOpts::default(), true, dev).unwrap();
            let norm = LayerNorm::new(&[5], 1e-5, dev).unwrap();
            let x = Tensor::randn(&[6, 12], DType::F32, dev).unwrap();
            let img = Tensor::randn(&[2, 3, 7, 7], DType::F32, dev).unwrap();
            let y = Tensor::from_vec(vec![0i32, 4, 2, 1, 3, 0], &[6], dev).unwrap();
            let (h, c, n, p, loss) = autocast(low, || -> voltaic::Result<_> {
                let h = lin.forward(&x)?;
                let c = conv.forward(&img)?;
                let n = norm.forward(&h)?;
                let p = h.softmax(-1)?;
                let loss = h.cross_entropy(&y, 0.0, Reduction::Mean)?;
                Ok((h, c, n, p, loss))
            })
            .unwrap();
            assert_eq!([h.dtype(), c.dtype()], [low, low], "{dev}: products under autocast({low})");
            assert_eq!([n.dtype(), p.dtype(), loss.dtype()], [DType::F32; 3], "{dev}: f32 ops under autocast({low})");
            assert_eq!(lin.forward(&x).unwrap().dtype(), DType::F32, "outside the scope nothing changes");
            assert_eq!(voltaic::autocast_dtype(), None);
            // The gradient reaches the f32 weights as f32 and matches the
            // f32 computation within the low type's rounding.
            lin.zero_grad();
            loss.backward().unwrap();
            let g_low = lin.weight.grad().unwrap();
            assert_eq!(g_low.dtype(), DType::F32);
            lin.zero_grad();
            lin.forward(&x).unwrap().cross_entropy(&y, 0.0, Reduction::Mean).unwrap().backward().unwrap();
            let g32 = lin.weight.grad().unwrap().to_f64_vec().unwrap();
            let g_low = g_low.to_f64_vec().unwrap();
            let scale = g32.iter().fold(0f64, |m, v| m.max(v.abs()));
            let tol = if low == DType::BF16 { 3e-2 } else { 4e-3 } * scale;
            for (a, b) in g_low.iter().zip(&g32) {
                assert!((a - b).abs() <= tol, "{dev} {low}: weight gradient {a} against f32's {b} (tolerance {tol:e})");
            }
            // Conv weights get gradients too, in f32.
            conv.zero_grad();
            c.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
            assert_eq!(conv.weight.grad().unwrap().dtype(), DType::F32);
        }
    }
}

#[test]
fn autocast_rejects_non_half_types_and_restores_the_previous_scope() {
    let _serial = serial();
    assert!(voltaic::ops::autocast::check_autocast_dtype(DType::F32).is_err());
    autocast(DType::F16, || {
        assert_eq!(voltaic::autocast_dtype(), Some(DType::F16));
        autocast(DType::BF16, || assert_eq!(voltaic::autocast_dtype(), Some(DType::BF16)));
        assert_eq!(voltaic::autocast_dtype(), Some(DType::F16));
        autocast(DType::F32, || assert_eq!(voltaic::autocast_dtype(), None));
    });
    assert_eq!(voltaic::autocast_dtype(), None);
}

/// Bits of every parameter.
fn snapshot(m: &dyn Module) -> Vec<Vec<f64>> {
    m.parameters().iter().map(|p| p.value().to_f64_vec().unwrap()).collect()
}

#[test]
fn grad_scaler_skips_exactly_the_overflowing_step() {
    let _serial = serial();
    for dev in devices() {
        voltaic::manual_seed(9);
        let lin = Linear::new(8, 3, true, dev).unwrap();
        let mut opt = Adam::new(lin.parameters(), 1e-2);
        let mut scaler = GradScaler::with_scale(1024.0);
        scaler.growth_interval = 2;
        let y = Tensor::from_vec(vec![0i32, 1, 2, 1], &[4], dev).unwrap();
        let mut scales = vec![];
        for step in 0..6 {
            let mut x = Tensor::randn(&[4, 8], DType::F32, dev).unwrap();
            if step == 3 {
                // 1e6 is beyond f16's range: the product overflows to inf.
                x = x.mul(1e6).unwrap();
            }
            let before = snapshot(&lin);
            let state_before = opt_state(&opt);
            let skipped_before = scaler.skipped_steps().unwrap();
            let loss = autocast(DType::F16, || lin.forward(&x)?.cross_entropy(&y, 0.0, Reduction::Mean)).unwrap();
            opt.zero_grad();
            scaler.scale(&loss).unwrap().backward().unwrap();
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            scales.push(scaler.get_scale().unwrap());
            let stepped = scaler.skipped_steps().unwrap() == skipped_before;
            let after = snapshot(&lin);
            if step == 3 {
                assert!(!stepped, "{dev}: the overflowing step was taken");
                assert_eq!(before, after, "{dev}: a skipped step changed the weights");
                assert_eq!(state_before, opt_state(&opt), "{dev}: a skipped step changed Adam's moments or count");
            } else {
                assert!(stepped, "{dev}: clean step {step} was skipped");
                assert_ne!(before, after, "{dev}: step {step} left the weights unchanged");
                assert!(after.iter().flatten().all(|v| v.is_finite()));
            }
        }
        // Grows after two clean steps, halves on the overflow, grows again.
        assert_eq!(scales, vec![1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0], "{dev}");
        assert_eq!(scaler.skipped_steps().unwrap(), 1, "{dev}");
        // Adam counted only the steps it took.
        let step = opt.state().into_iter().find(|(n, _)| n == "step").unwrap().1.to_f64_vec().unwrap();
        assert_eq!(step, vec![5.0], "{dev}");
    }
}

/// An optimizer's state tensors by name, as values.
fn opt_state(opt: &dyn Optimizer) -> Vec<(String, Vec<f64>)> {
    opt.state().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect()
}

#[test]
fn steps_decided_on_the_device_match_plain_steps() {
    // Adam's device-side count and bias corrections, and SGD's masked
    // momentum, against the plain host-side steps over the same gradients.
    let _serial = serial();
    for dev in devices() {
        for adam in [true, false] {
            let mut weights = vec![];
            for masked in [false, true] {
                voltaic::manual_seed(5);
                let lin = Linear::new(6, 3, true, dev).unwrap();
                let mut opt: Box<dyn Optimizer> =
                    if adam { Box::new(Adam::adamw(lin.parameters(), 1e-2)) } else { Box::new(Sgd::new(lin.parameters(), 1e-1).with_momentum(0.9, true)) };
                let never = Tensor::from_vec(vec![false], &[], dev).unwrap();
                for _ in 0..4 {
                    let x = Tensor::randn(&[5, 6], DType::F32, dev).unwrap();
                    opt.zero_grad();
                    lin.forward(&x).unwrap().sqr().unwrap().mean_all().unwrap().backward().unwrap();
                    if masked {
                        opt.step_unless(&never).unwrap();
                    } else {
                        opt.step().unwrap();
                    }
                }
                weights.push(snapshot(&lin));
            }
            for (a, b) in weights[0].iter().flatten().zip(weights[1].iter().flatten()) {
                assert!((a - b).abs() <= 1e-6 * a.abs().max(1e-3), "{dev} adam={adam}: plain {a}, decided on the device {b}");
            }
        }
    }
}

#[test]
fn grad_scaler_unscales_to_the_plain_gradients() {
    let _serial = serial();
    voltaic::manual_seed(2);
    let lin = Linear::new(5, 2, false, Device::Cpu).unwrap();
    let opt = Adam::new(lin.parameters(), 1e-3);
    let x = Tensor::randn(&[3, 5], DType::F32, Device::Cpu).unwrap();
    lin.forward(&x).unwrap().sum_all().unwrap().backward().unwrap();
    let plain = lin.weight.grad().unwrap().to_f64_vec().unwrap();
    lin.zero_grad();
    let mut scaler = GradScaler::with_scale(4096.0);
    scaler.scale(&lin.forward(&x).unwrap().sum_all().unwrap()).unwrap().backward().unwrap();
    scaler.unscale(&opt).unwrap();
    // A second unscale in the same step does nothing.
    scaler.unscale(&opt).unwrap();
    let got = lin.weight.grad().unwrap().to_f64_vec().unwrap();
    for (a, b) in got.iter().zip(&plain) {
        assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "unscaled {a}, plain {b}");
    }
}

/// A weight too large to be joined with the small tensors (it is checked
/// by a reduction of its own) beside small ones: unscaled to the plain
/// gradients, and an inf in it or in a small one skips the step.
#[test]
fn grad_scaler_checks_large_and_small_tensors_alike() {
    let _serial = serial();
    for dev in devices() {
        voltaic::manual_seed(3);
        let big = Linear::new(640, 512, true, dev).unwrap();
        let small = Linear::new(512, 3, true, dev).unwrap();
        assert!(big.weight.value().numel() > 1 << 18);
        let mut opt = Adam::new(big.parameters().into_iter().chain(small.parameters()).collect(), 1e-3);
        let x = Tensor::randn(&[4, 640], DType::F32, dev).unwrap();
        let loss = || small.forward(&big.forward(&x)?.tanh()?)?.sqr()?.sum_all();
        loss().unwrap().backward().unwrap();
        let plain = [big.weight.grad().unwrap().to_f64_vec().unwrap(), small.bias.as_ref().unwrap().grad().unwrap().to_f64_vec().unwrap()];
        opt.zero_grad();
        let mut scaler = GradScaler::with_scale(512.0);
        scaler.scale(&loss().unwrap()).unwrap().backward().unwrap();
        scaler.unscale(&opt).unwrap();
        let got = [big.weight.grad().unwrap().to_f64_vec().unwrap(), small.bias.as_ref().unwrap().grad().unwrap().to_f64_vec().unwrap()];
        for (g, p) in got.iter().zip(&plain) {
            for (a, b) in g.iter().zip(p) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-3), "{dev}: unscaled {a}, plain {b}");
            }
        }
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        assert_eq!(scaler.skipped_steps().unwrap(), 0, "{dev}: a clean step");
        for (k, bad) in [(0usize, f64::INFINITY), (1, f64::NAN)] {
            opt.zero_grad();
            scaler.scale(&loss().unwrap()).unwrap().backward().unwrap();
            let p = if k == 0 { big.weight.value() } else { small.bias.as_ref().unwrap().value() };
            let g = p.grad().unwrap();
            // One element made non-finite, the rest left as they are.
            let mut mask = vec![0.0f32; g.numel()];
            mask[g.numel() / 2] = 1.0;
            let mask = Tensor::from_vec(mask, g.dims(), dev).unwrap().gt(0.5).unwrap();
            p.set_grad(Some(mask.where_cond(bad, &g).unwrap())).unwrap();
            let before = big.weight.value().to_f64_vec().unwrap();
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            assert_eq!(big.weight.value().to_f64_vec().unwrap(), before, "{dev}: {bad} in tensor {k} skips the step");
            assert_eq!(scaler.skipped_steps().unwrap(), k as u64 + 1, "{dev}");
        }
    }
}

#[test]
fn grad_scaler_unscales_each_optimizer_once() {
    let _serial = serial();
    for dev in devices() {
        voltaic::manual_seed(4);
        let (l1, l2) = (Linear::new(5, 4, true, dev).unwrap(), Linear::new(4, 2, true, dev).unwrap());
        let x = Tensor::randn(&[3, 5], DType::F32, dev).unwrap();
        let loss = || l2.forward(&l1.forward(&x)?.relu()?)?.sqr()?.sum_all();
        loss().unwrap().backward().unwrap();
        let grads = |m: &Linear| m.weight.grad().unwrap().to_f64_vec().unwrap();
        let plain = (grads(&l1), grads(&l2));
        l1.zero_grad();
        l2.zero_grad();
        // One optimizer per layer, as with different learning rates; plain
        // SGD, so each step moves the weights by lr times the gradient it saw.
        let lr = 0.5;
        let (mut o1, mut o2) = (Sgd::new(l1.parameters(), lr), Sgd::new(l2.parameters(), lr));
        let weights = |m: &Linear| m.weight.value().to_f64_vec().unwrap();
        let before = (weights(&l1), weights(&l2));
        let mut scaler = GradScaler::with_scale(4096.0);
        scaler.scale(&loss().unwrap()).unwrap().backward().unwrap();
        scaler.unscale(&o1).unwrap();
        scaler.step(&mut o1).unwrap();
        // The second optimizer's gradients are unscaled by its own step.
        scaler.step(&mut o2).unwrap();
        for (name, b, a, want) in [("first", &before.0, weights(&l1), &plain.0), ("second", &before.1, weights(&l2), &plain.1)] {
            for ((b, a), w) in b.iter().zip(&a).zip(want) {
                let seen = (b - a) / lr;
                assert!((seen - w).abs() <= 1e-4 * w.abs().max(1.0), "{dev}: the {name} optimizer stepped with gradient {seen}, plain {w}");
            }
        }
        scaler.update().unwrap();
        // An overflow in the second optimizer's gradients skips its step and backs the scale off.
        l1.zero_grad();
        l2.zero_grad();
        scaler.scale(&loss().unwrap()).unwrap().backward().unwrap();
        let bias = l2.bias.as_ref().unwrap();
        bias.value().set_grad(Some(bias.grad().unwrap().mul(f64::INFINITY).unwrap())).unwrap();
        let before = (weights(&l1), weights(&l2));
        scaler.step(&mut o1).unwrap();
        scaler.step(&mut o2).unwrap();
        scaler.update().unwrap();
        assert_ne!(weights(&l1), before.0, "{dev}: the first optimizer's clean step was skipped");
        assert_eq!(weights(&l2), before.1, "{dev}: the second optimizer stepped with inf gradients");
        assert_eq!(scaler.get_scale().unwrap(), 2048.0, "{dev}");
        assert_eq!(scaler.skipped_steps().unwrap(), 1, "{dev}");
    }
}

/// A model of many parameter tensors (a transformer has a hundred): the
/// scaler's checks over all of them run on the GPU as well as the CPU (its
/// per-tensor sums fused into one kernel once bound more buffers than
/// lavapipe allows), and an overflow in any one tensor skips the step.
#[test]
fn grad_scaler_steps_a_model_of_many_tensors() {
    let _serial = serial();
    for dev in devices() {
        voltaic::manual_seed(6);
        let layers: Vec<Linear> = (0..40).map(|_| Linear::new(3, 3, true, dev).unwrap()).collect();
        let params: Vec<_> = layers.iter().flat_map(|l| l.parameters()).collect();
        assert_eq!(params.len(), 80);
        let mut opt = Adam::new(params, 1e-2);
        let x = Tensor::randn(&[2, 3], DType::F32, dev).unwrap();
        let loss = || -> voltaic::Result<Tensor> {
            let mut h = x.clone();
            for l in &layers {
                h = h.add(&l.forward(&h)?.tanh()?)?;
            }
            h.sqr()?.sum_all()
        };
        let weights = || layers.iter().map(|l| l.weight.value().to_f64_vec().unwrap()).collect::<Vec<_>>();
        let mut scaler = GradScaler::with_scale(1024.0);
        let before = weights();
        scaler.scale(&loss().unwrap()).unwrap().backward().unwrap();
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        let after = weights();
        let moved: Vec<bool> = before.iter().zip(&after).map(|(b, a)| b != a).collect();
        assert!(moved.iter().all(|&m| m), "{dev}: a clean step moves every layer: {moved:?}, skipped {}", scaler.skipped_steps().unwrap());
        opt.zero_grad();
        scaler.scale(&loss().unwrap()).unwrap().backward().unwrap();
        let w = &layers[17].weight;
        w.value().set_grad(Some(w.grad().unwrap().mul(f64::NAN).unwrap())).unwrap();
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        assert_eq!(weights(), after, "{dev}: a NaN in one tensor of 80 skips the whole step");
        assert_eq!(scaler.skipped_steps().unwrap(), 1, "{dev}");
    }
}
