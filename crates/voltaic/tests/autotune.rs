//! The matmul autotuner, switched on for a software adapter (it is off there
//! by default): every candidate kernel runs, epilogues with constants
//! included, the choice is written to the cache directory, and results match
//! the CPU. In its own test binary, because the switch is read once, when the
//! device is first opened.

use voltaic::{DType, Device, Generator, Tensor};

#[test]
fn tuned_matmul_with_an_epilogue_matches_cpu_and_is_remembered() {
    let dir = std::env::temp_dir().join(format!("voltaic-autotune-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("VOLTAIC_AUTOTUNE", "1");
    std::env::set_var("VOLTAIC_CACHE_DIR", &dir);
    assert!(
        !voltaic::backend::adapters().is_empty(),
        "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)"
    );
    let gpu = Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0));
    // 2*m*k*n above the tuner's floor of 1e7 flops; odd sizes.
    let (m, k, n) = (129, 200, 195);
    let mut g = Generator::new(7);
    let x = Tensor::randn_with(&mut g, &[m, k], DType::F32, Device::Cpu).unwrap();
    let w = Tensor::randn_with(&mut g, &[k, n], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::randn_with(&mut g, &[n], DType::F32, Device::Cpu).unwrap();
    // Linear + GELU (erf): the epilogue reads constants.
    let f = |x: &Tensor, w: &Tensor, b: &Tensor| x.matmul(w).unwrap().add(b).unwrap().mul(0.5).unwrap().gelu().unwrap();
    let want = f(&x, &w, &b).to_vec::<f32>().unwrap();
    let got = f(&x.to_device(gpu).unwrap(), &w.to_device(gpu).unwrap(), &b.to_device(gpu).unwrap()).to_vec::<f32>().unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-4 + 1e-4 * w.abs(), "element {i}: gpu {g}, cpu {w}");
    }
    let cache: Vec<_> = std::fs::read_dir(&dir).expect("the tuner writes its cache directory").flatten().collect();
    let text = cache.iter().map(|e| std::fs::read_to_string(e.path()).unwrap_or_default()).collect::<String>();
    assert!(text.contains(&format!("{m} {k} {n}")), "the tuned plan is remembered: {text:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
