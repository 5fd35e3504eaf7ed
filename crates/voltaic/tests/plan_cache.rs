//! The plan cache: a graph with the structure of an earlier one reuses its
//! plan, with the new constants and input buffers; a new shape gets a new
//! plan; the cache stays within its limits however many shapes pass.

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
