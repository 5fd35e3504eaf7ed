//! Host memory stays bounded over a long training run: the CPU pool reuses
//! a step's buffers, frees uploaded batches, and does not grow after the
//! first steps (it once cached every batch a data loader uploaded, up to
//! 1 GiB). Its own test binary, since the pool is process-wide.

use voltaic::nn::{Forward, Linear, Module, Sequential};
use voltaic::optim::{Adam, Optimizer};
use voltaic::{DType, Device, Reduction, Tensor};

#[cfg(target_os = "linux")]
fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
fn two_thousand_training_steps_keep_the_host_pool_bounded() {
    voltaic::manual_seed(5);
    let dev = Device::Cpu;
    // Activations of 96 x 512 f32 (192 KiB) are large enough to be pooled.
    let model = Sequential::new().add(Linear::new(256, 512, true, dev).unwrap()).add(voltaic::nn::ReLU).add(Linear::new(512, 10, true, dev).unwrap());
    let mut opt = Adam::new(model.parameters(), 1e-3);
    let mut g = voltaic::Generator::new(7);
    let (mut cached_at_200, mut rss_at_200) = (0, 0);
    for step in 0..2000 {
        // A fresh upload every step, and a short batch now and then (as the
        // last batch of an epoch is), so shapes change.
        let b = if step % 50 == 49 { 37 } else { 96 };
        let x = Tensor::randn_with(&mut g, &[b, 256], DType::F32, dev).unwrap();
        let x = Tensor::from_vec(x.to_vec::<f32>().unwrap(), &[b, 256], dev).unwrap();
        let y = Tensor::from_vec((0..b as i32).map(|i| i % 10).collect::<Vec<_>>(), &[b], dev).unwrap();
        let loss = model.forward(&x).unwrap().cross_entropy(&y, 0.0, Reduction::Mean).unwrap();
        opt.zero_grad();
        loss.backward().unwrap();
        opt.step().unwrap();
        let m = dev.memory_stats().unwrap();
        assert!(m.cached <= 64 << 20, "step {step}: the pool caches {} bytes", m.cached);
        if step == 200 {
            cached_at_200 = m.peak_cached;
            #[cfg(target_os = "linux")]
            {
                rss_at_200 = rss_bytes();
            }
        }
    }
    let m = dev.memory_stats().unwrap();
    assert_eq!(m.peak_cached, cached_at_200, "the pool grew after step 200: {m:?}");
    assert!(m.hit_rate() > 0.9, "a training step should reuse its buffers: {m:?}");
    #[cfg(target_os = "linux")]
    {
        let grown = rss_bytes() as i64 - rss_at_200 as i64;
        assert!(grown < 32 << 20, "resident memory grew by {grown} bytes between steps 200 and 2000");
    }
    let _ = rss_at_200;
}
