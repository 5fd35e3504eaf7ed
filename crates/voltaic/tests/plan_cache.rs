//! The plan cache: a graph with the structure of an earlier one reuses its
//! plan, with the new constants and input buffers; a new shape gets a new
//! plan; the cache stays within its limits however many shapes pass; a dry
//! run fills it (and the kernel cache) ahead of the step that needs it.

use std::sync::Mutex;
use voltaic::optim::Optimizer;
use voltaic::{plan_cache_stats, DType, Device, Generator, Tensor};

/// The GPU under test; panics (fails the test) when there is none.
fn gpu() -> Device {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)");
    Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0))
}

/// The tests read and change one process-wide cache.
static SERIAL: Mutex<()> = Mutex::new(());

/// `relu(x @ w * lr + 1).sum(1)` in f64 loops.
fn reference(x: &[f32], w: &[f32], (b, k, n): (usize, usize, usize), lr: f64) -> Vec<f64> {
    (0..b)
        .map(|i| {
            (0..n)
                .map(|j| {
                    let dot: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[p * n + j] as f64).sum();
                    (dot * lr + 1.0).max(0.0)
                })
                .sum()
        })
        .collect()
}

fn steps_reuse_plans_with_new_constants_shapes_and_inputs(dev: Device) {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut g = Generator::new(11);
    let (k, n) = (9, 13);
    let w_host = Tensor::randn_with(&mut g, &[k, n], DType::F32, Device::Cpu).unwrap();
    let w = w_host.to_device(dev).unwrap();
    let wv = w_host.to_vec::<f32>().unwrap();
    let before = plan_cache_stats();
    // Batch 5 three times, 7 twice, 5 again: each step a new input buffer and a new constant.
    let batches = [5, 5, 5, 7, 7, 5];
    for (step, &b) in batches.iter().enumerate() {
        let lr = 0.5 + step as f64 * 0.37;
        let x_host = Tensor::randn_with(&mut g, &[b, k], DType::F32, Device::Cpu).unwrap();
        let x = x_host.to_device(dev).unwrap();
        let y = x.matmul(&w).unwrap().mul(lr).unwrap().add(1.0).unwrap().relu().unwrap().sum(&[1], false).unwrap();
        let got = y.to_vec::<f32>().unwrap();
        let want = reference(&x_host.to_vec::<f32>().unwrap(), &wv, (b, k, n), lr);
        assert_eq!(got.len(), b);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "{dev} step {step} (batch {b}, lr {lr}) row {i}: {g} vs {w}");
        }
    }
    let after = plan_cache_stats();
    // Steps 2, 3, 5 and 6 repeat the structure of an earlier step.
    assert!(after.hits - before.hits >= 4, "{dev}: {before:?} -> {after:?}");
}

#[test]
fn cpu_steps_reuse_plans_with_new_constants_shapes_and_inputs() {
    steps_reuse_plans_with_new_constants_shapes_and_inputs(Device::Cpu);
}

#[test]
fn gpu_steps_reuse_plans_with_new_constants_shapes_and_inputs() {
    steps_reuse_plans_with_new_constants_shapes_and_inputs(gpu());
}

#[test]
fn a_training_step_gives_the_same_results_with_and_without_the_cache() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let run = || {
        let mut g = Generator::new(3);
        let w = voltaic::nn::Parameter::new(Tensor::randn_with(&mut g, &[6, 4], DType::F32, Device::Cpu).unwrap().to_device(dev).unwrap()).unwrap();
        let mut opt = voltaic::optim::Adam::new(vec![w.clone()], 0.05);
        let mut losses = vec![];
        for _ in 0..5 {
            let x = Tensor::randn_with(&mut g, &[8, 6], DType::F32, Device::Cpu).unwrap().to_device(dev).unwrap();
            let loss = x.matmul(&w.value()).unwrap().tanh().unwrap().sqr().unwrap().mean_all().unwrap();
            for p in opt.params() {
                p.zero_grad();
            }
            loss.backward().unwrap();
            opt.step().unwrap();
            losses.push(loss.item::<f32>().unwrap());
        }
        (losses, w.value().to_vec::<f32>().unwrap())
    };
    voltaic::clear_plan_cache();
    let cached = run();
    let stats = plan_cache_stats();
    voltaic::set_plan_cache_limits(0, 0);
    let uncached = run();
    voltaic::set_plan_cache_limits(1024, 64 << 20);
    assert!(stats.hits > 0, "Adam's steps repeat: {stats:?}");
    assert_eq!(cached, uncached, "the cache changes no result (Adam's bias correction is a new constant every step)");
}

#[test]
fn the_cache_stays_bounded_over_ten_thousand_shapes() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    voltaic::set_plan_cache_limits(64, 1 << 20);
    let before = plan_cache_stats();
    for n in 1..=10_000usize {
        let x = Tensor::ones(&[n], DType::F32, Device::Cpu).unwrap();
        let s = x.mul(2.0).unwrap().add(1.0).unwrap().sum_all().unwrap().item::<f32>().unwrap();
        assert_eq!(s, 3.0 * n as f32);
        let now = plan_cache_stats();
        assert!(now.entries <= 64 && now.bytes <= 1 << 20, "after {n} shapes: {now:?}");
    }
    let after = plan_cache_stats();
    assert!(after.evictions - before.evictions >= 10_000 - 64, "{before:?} -> {after:?}");
    voltaic::set_plan_cache_limits(1024, 64 << 20);
}

#[test]
fn errors_are_reported_on_every_repeat_of_a_cached_plan() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for dev in [Device::Cpu, gpu()] {
        let x = Tensor::arange(0.0, 12.0, 1.0, DType::F32, dev).unwrap().reshape(&[4, 3]).unwrap();
        let before = plan_cache_stats();
        // The same structure three times with an out-of-range index, between good ones.
        for round in 0..3 {
            let bad = Tensor::from_vec(vec![1i32, 4 + round], &[2], Device::Cpu).unwrap().to_device(dev).unwrap();
            let e = x.index_select(0, &bad).and_then(|r| r.mul(2.0)).and_then(|r| r.to_vec::<f32>()).unwrap_err().to_string();
            assert!(e.contains("index_select") && e.contains(&format!("index {}", 4 + round)), "{dev} round {round}: {e}");
            let good = Tensor::from_vec(vec![3i32, round], &[2], Device::Cpu).unwrap().to_device(dev).unwrap();
            let v = x.index_select(0, &good).unwrap().mul(2.0).unwrap().to_vec::<f32>().unwrap();
            let r = round as f32;
            assert_eq!(v, vec![18.0, 20.0, 22.0, 6.0 * r, 6.0 * r + 2.0, 6.0 * r + 4.0], "{dev} round {round}");
        }
        let after = plan_cache_stats();
        assert!(after.hits > before.hits, "{dev}: the repeats were cached: {before:?} -> {after:?}");
    }
}

/// A dry run (`voltaic::dry_run`) compiles a training step's kernels
/// without running them: the same step afterwards compiles no pipeline and
/// computes what the CPU computes. Inside, a read is an error; the default
/// random stream does not move; and a pending tensor made before the dry
/// run is refused rather than left without its values.
#[test]
fn a_dry_run_compiles_a_step_ahead_and_changes_nothing_else() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = gpu();
    let mut g = Generator::new(8);
    // Shapes no other test here uses, so their kernels are new to the process.
    let w0 = Tensor::randn_with(&mut g, &[7, 5], DType::F32, Device::Cpu).unwrap();
    let x = Tensor::randn_with(&mut g, &[9, 7], DType::F32, Device::Cpu).unwrap();
    // One Adam step with a random draw in it (as dropout makes): the loss and the new weight, realized.
    let step = |dev: Device| -> voltaic::Result<(Tensor, Tensor)> {
        let w = voltaic::nn::Parameter::new(w0.to_device(dev)?)?;
        let mut opt = voltaic::optim::Adam::new(vec![w.clone()], 0.05);
        let noise = Tensor::rand(&[9, 5], DType::F32, dev)?.mul(1e-3)?;
        let loss = x.to_device(dev)?.matmul(&w.value())?.add(&noise)?.tanh()?.sqr()?.mean_all()?;
        opt.zero_grad();
        loss.backward()?;
        opt.step()?;
        let w1 = w.value();
        Tensor::realize_all(&[&loss, &w1])?;
        Ok((loss, w1))
    };
    voltaic::manual_seed(5);
    let p0 = dev.stats().unwrap().pipelines;
    let (loss, w1) = voltaic::dry_run(|| {
        let r = step(dev)?;
        let e = r.0.item::<f32>().unwrap_err().to_string();
        assert!(e.contains("dry_run"), "{e}");
        Ok::<_, voltaic::Error>(r)
    })
    .unwrap();
    let p1 = dev.stats().unwrap().pipelines;
    assert!(p1 > p0, "the dry run compiled the step's kernels ({p0} -> {p1})");
    assert_eq!((loss.dims(), w1.dims()), (&[][..], &[7, 5][..]));
    // The default stream is where the seed left it.
    let after = g_rand();
    voltaic::manual_seed(5);
    assert_eq!(after, g_rand(), "the dry run drew from the default generator");
    // The real step: nothing compiled, the CPU's values (from the same seed).
    voltaic::manual_seed(6);
    let (gl, gw) = step(dev).unwrap();
    let (gl, gw) = (gl.item::<f32>().unwrap(), gw.to_vec::<f32>().unwrap());
    assert_eq!(dev.stats().unwrap().pipelines, p1, "the step after its dry run compiled no pipeline");
    voltaic::manual_seed(6);
    let (cl, cw) = step(Device::Cpu).unwrap();
    let (cl, cw) = (cl.item::<f32>().unwrap(), cw.to_vec::<f32>().unwrap());
    assert!((gl - cl).abs() <= 1e-5 * (1.0 + cl.abs()), "loss {gl} on the GPU, {cl} on the CPU");
    for (i, (a, b)) in gw.iter().zip(&cw).enumerate() {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "weight {i}: {a} on the GPU, {b} on the CPU");
    }
    // A pending tensor from before: refused, and still right afterwards.
    let pending = x.to_device(dev).unwrap().exp().unwrap();
    let e = voltaic::dry_run(|| pending.realize()).unwrap_err().to_string();
    assert!(e.contains("before the dry run"), "{e}");
    let want: Vec<f32> = x.to_vec::<f32>().unwrap().iter().map(|v| v.exp()).collect();
    for (a, b) in pending.to_vec::<f32>().unwrap().iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{a} vs {b}");
    }
}

/// Four draws of the default generator.
fn g_rand() -> Vec<f32> {
    Tensor::rand(&[4], DType::F32, Device::Cpu).unwrap().to_vec::<f32>().unwrap()
}
