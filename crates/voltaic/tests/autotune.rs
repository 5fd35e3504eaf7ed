//! The matmul autotuner, switched on for a software adapter (it is off there
//! by default): in the background (the default on hardware), a new shape
//! runs at once with the heuristic kernel and the measured choice serves
//! from the next realization on; with `VOLTAIC_AUTOTUNE=sync` it is measured
//! first. Every candidate runs, epilogues with constants included, the
//! choice is written to the cache directory, and results match the CPU. In
//! its own test binary: it sets the cache directory before the device opens.

use voltaic::{DType, Device, Generator, Tensor};

fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Vec<f32> {
    // Linear + GELU (erf): the epilogue reads constants.
    x.matmul(w).unwrap().add(b).unwrap().mul(0.5).unwrap().gelu().unwrap().to_vec::<f32>().unwrap()
}

fn check(gpu: Device, (m, k, n): (usize, usize, usize), seed: u64) {
    let mut g = Generator::new(seed);
    let x = Tensor::randn_with(&mut g, &[m, k], DType::F32, Device::Cpu).unwrap();
    let w = Tensor::randn_with(&mut g, &[k, n], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::randn_with(&mut g, &[n], DType::F32, Device::Cpu).unwrap();
    let want = linear_gelu(&x, &w, &b);
    let (gx, gw, gb) = (x.to_device(gpu).unwrap(), w.to_device(gpu).unwrap(), b.to_device(gpu).unwrap());
    let got = linear_gelu(&gx, &gw, &gb);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-4 + 1e-4 * w.abs(), "{m}x{k}x{n} element {i}: gpu {g}, cpu {w}");
    }
}

fn remembered(dir: &std::path::Path) -> String {
    let cache: Vec<_> = std::fs::read_dir(dir).map(|d| d.flatten().collect()).unwrap_or_default();
    cache.iter().map(|e| std::fs::read_to_string(e.path()).unwrap_or_default()).collect::<String>()
}

#[test]
fn tuned_matmul_with_an_epilogue_matches_cpu_and_is_remembered() {
    let dir = std::env::temp_dir().join(format!("voltaic-autotune-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("VOLTAIC_CACHE_DIR", &dir);
    assert!(
        !voltaic::backend::adapters().is_empty(),
        "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)"
    );
    let gpu = Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0));
    // 2*m*k*n above the tuner's floor of 1e7 flops; odd sizes.
    let background = (129, 200, 195);
    std::env::set_var("VOLTAIC_AUTOTUNE", "1");
    check(gpu, background, 7);
    voltaic::backend::finish_tuning();
    assert!(remembered(&dir).contains("1 129 200 195 "), "the background choice is remembered: {:?}", remembered(&dir));
    // Same structure again: the cached plan re-resolves to the tuned kernel.
    check(gpu, background, 8);

    let blocking = (131, 190, 297);
    std::env::set_var("VOLTAIC_AUTOTUNE", "sync");
    check(gpu, blocking, 9);
    assert!(remembered(&dir).contains("1 131 190 297 "), "a sync choice is remembered before the result: {:?}", remembered(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}
