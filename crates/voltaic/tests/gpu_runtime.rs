//! The GPU executor's runtime properties: one dispatch per fused kernel, at
//! most one submission per realization (small ones share one), pipelines compiled once, memory that does not
//! grow in a loop, tensors larger than one binding, huge dispatches, and
//! allocation failures as errors.
//!
//! These tests read device-wide counters, so they run one at a time (each
//! holds `SERIAL`), in their own test binary.

use std::sync::Mutex;
use voltaic::DeviceStats;

fn stats(i: usize) -> voltaic::Result<DeviceStats> {
    Device::Gpu(i).stats()
}
use voltaic::{inspect, DType, Device, Tensor};

static SERIAL: Mutex<()> = Mutex::new(());

fn gpu() -> (Device, usize) {
    assert!(
        !voltaic::backend::adapters().is_empty(),
        "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)"
    );
    let i = std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    (Device::Gpu(i), i)
}

fn delta(a: &DeviceStats, b: &DeviceStats) -> (u64, u64, u64) {
    (b.submissions - a.submissions, b.dispatches - a.dispatches, b.pipelines - a.pipelines)
}

#[test]
fn fused_chain_is_one_dispatch_and_a_realization_one_submission() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, i) = gpu();
    let x = Tensor::randn(&[1, 37], DType::F32, g).unwrap().broadcast_to(&[23, 37]).unwrap();
    let y = Tensor::randn(&[23, 1], DType::F32, g).unwrap();
    let chain = |x: &Tensor| {
        let mut t = x.clone();
        for k in 0..20 {
            t = match k % 4 {
                0 => t.mul(1.01).unwrap(),
                1 => t.add(&y).unwrap(),
                2 => t.tanh().unwrap(),
                _ => t.sub(0.5).unwrap(),
            };
        }
        t
    };
    let t = chain(&x);
    assert_eq!(inspect(&[&t]).len(), 1);
    g.synchronize().unwrap();
    let before = stats(i).unwrap();
    t.realize().unwrap();
    g.synchronize().unwrap();
    let (subs, disp, _) = delta(&before, &stats(i).unwrap());
    assert_eq!((subs, disp), (1, 1), "a 20-op chain over a broadcast input: one dispatch, one submission");

    // A multi-kernel graph: matmul, softmax, sum, argmax.
    let w = Tensor::randn(&[37, 16], DType::F32, g).unwrap();
    let build = || {
        let h = chain(&x).matmul(&w).unwrap().softmax(-1).unwrap();
        (h.sum(&[0], false).unwrap(), h.argmax(Some(-1), false).unwrap())
    };
    let (s, a) = build();
    let kernels = inspect(&[&s, &a]).len();
    assert!(kernels >= 4, "{kernels}");
    let before = stats(i).unwrap();
    Tensor::realize_all(&[&s, &a]).unwrap();
    g.synchronize().unwrap();
    let (subs, disp, compiled) = delta(&before, &stats(i).unwrap());
    assert_eq!(subs, 1, "one realization, one submission");
    assert_eq!(disp, kernels as u64);
    assert!(compiled > 0);
    // The same graph again compiles nothing new.
    let (s, a) = build();
    let before = stats(i).unwrap();
    Tensor::realize_all(&[&s, &a]).unwrap();
    g.synchronize().unwrap();
    let (subs, _, compiled) = delta(&before, &stats(i).unwrap());
    assert_eq!((subs, compiled), (1, 0), "pipelines are cached by kernel");
    // Kernels that differ only in their constants (a learning rate that
    // changes every step) share one pipeline.
    let step = |lr: f64| x.mul(lr).unwrap().add(lr * 2.0).unwrap().sum(&[1], false).unwrap().realize().map(|_| ()).unwrap();
    step(0.1);
    let before = stats(i).unwrap();
    for k in 0..5 {
        step(0.01 * k as f64 + 0.3);
    }
    let (_, _, compiled) = delta(&before, &stats(i).unwrap());
    assert_eq!(compiled, 0, "new constants compiled new kernels");
}

#[test]
fn small_realizations_share_a_submission_and_keep_their_order() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, i) = gpu();
    voltaic::manual_seed(5);
    let x = Tensor::randn(&[64], DType::F32, g).unwrap();
    let xv = x.to_vec::<f32>().unwrap();
    let before = stats(i).unwrap();
    let mut kept = vec![];
    for k in 0..40 {
        // A result dropped at once: its buffer waits for the batch to be
        // submitted before the upload below (written through the queue,
        // which runs before the batch's kernels) or a kernel's constants may
        // take it.
        let dropped = x.mul(k as f64).unwrap().add(1.0).unwrap();
        dropped.realize().unwrap();
        drop(dropped);
        let up = Tensor::from_vec(vec![k as f32; 64], &[64], Device::Cpu).unwrap().to_device(g).unwrap();
        let y = x.mul(k as f64 + 0.5).unwrap().add(&up).unwrap();
        y.realize().unwrap();
        kept.push((k, up, y));
    }
    let subs = stats(i).unwrap().submissions - before.submissions;
    assert!(subs < 40, "80 small realizations took {subs} submissions");
    for (k, up, y) in kept {
        assert_eq!(up.to_vec::<f32>().unwrap(), vec![k as f32; 64], "upload {k}");
        // A GPU may fuse the multiply-add: equal to a rounding.
        for (g, v) in y.to_vec::<f32>().unwrap().iter().zip(&xv) {
            let want = *v as f64 * (k as f64 + 0.5) + k as f64;
            assert!((*g as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "result {k}: {g} vs {want}");
        }
    }
}

#[test]
fn a_training_like_loop_does_not_grow_memory() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, i) = gpu();
    voltaic::manual_seed(3);
    let x = Tensor::randn(&[64, 32], DType::F32, g).unwrap();
    let mut w = Tensor::randn(&[32, 10], DType::F32, g).unwrap().mul(0.1).unwrap().contiguous().unwrap();
    let target = Tensor::arange(0.0, 64.0, 1.0, DType::I32, g).unwrap().rem(10).unwrap();
    let mut after_warmup = None;
    let mut groups_at_900 = 0;
    for step in 0..1000 {
        // Forward, a hand-written gradient of softmax cross-entropy, an SGD step.
        let logits = x.matmul(&w).unwrap();
        let p = logits.softmax(-1).unwrap();
        let grad_logits = p.sub(target.one_hot(10).unwrap().to_dtype(DType::F32).unwrap()).unwrap().div(64.0).unwrap();
        let grad_w = x.t().unwrap().matmul(&grad_logits).unwrap();
        w = w.sub(grad_w.mul(0.5).unwrap()).unwrap();
        w.realize().unwrap();
        if step == 50 {
            after_warmup = Some(stats(i).unwrap().memory);
        }
        if step == 900 {
            groups_at_900 = stats(i).unwrap().bind_groups;
        }
    }
    // The loop's own memory, before the evaluation below (another graph,
    // whose few small buffers may be new).
    let end = stats(i).unwrap().memory;
    // Steps bind the buffers of a step before: their bind groups are made.
    assert_eq!(stats(i).unwrap().bind_groups, groups_at_900, "bind groups created in the last 100 steps");
    let loss = x.matmul(&w).unwrap().cross_entropy(&target, 0.0, voltaic::Reduction::Mean).unwrap().item::<f32>().unwrap();
    assert!(loss.is_finite());
    let warm = after_warmup.unwrap();
    assert_eq!(end.allocations, warm.allocations, "no new buffers after warm-up: {warm:?} -> {end:?}");
    assert!(end.in_use + end.cached <= warm.in_use + warm.cached, "{warm:?} -> {end:?}");
    g.empty_cache().unwrap();
    assert_eq!(stats(i).unwrap().memory.cached, 0);
}

#[test]
fn tensors_larger_than_one_binding_work() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, _) = gpu();
    // 40M i32 = 160 MB (integers, so every value is exact): more than lavapipe's 128 MiB binding, and more than
    // 65,535 workgroups of 256 in one dimension.
    let n = 40_000_000usize;
    let x = Tensor::arange(0.0, n as f64, 1.0, DType::I32, g).unwrap();
    let y = x.mul(2).unwrap().add(1).unwrap();
    let probe = [0usize, 1, 33_554_431, 33_554_432, 33_554_433, n - 1];
    for &p in &probe {
        let v = y.narrow(0, p, 1).unwrap().item::<i32>().unwrap();
        assert_eq!(v, (2 * p + 1) as i32, "element {p}");
    }
    // A strided read across the chunk boundary, and a reduction over it all.
    let tail = y.slice(0, 33_554_400, 33_554_500, 7).unwrap().to_vec::<i32>().unwrap();
    let want: Vec<i32> = (33_554_400..33_554_500).step_by(7).map(|p| 2 * p + 1).collect();
    assert_eq!(tail, want);
    let m = y.max(&[0], false).unwrap().item::<i32>().unwrap();
    assert_eq!(m, (2 * (n - 1) + 1) as i32);
    let s = y.to_dtype(DType::F32).unwrap().sum(&[0], false).unwrap().item::<f32>().unwrap() as f64;
    let want_sum = (n as f64) * (n as f64);
    assert!((s - want_sum).abs() / want_sum < 1e-5, "{s} vs {want_sum}");
    let am = y.argmax(None, false).unwrap().item::<i32>().unwrap();
    assert_eq!(am as usize, n - 1);
}

#[test]
fn impossible_allocations_are_errors_and_the_device_stays_usable() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, _) = gpu();
    let huge = Tensor::zeros(&[1 << 36], DType::F32, g).unwrap().contiguous().unwrap();
    let e = huge.realize().map(|_| ()).expect_err("a 256 GiB buffer cannot exist");
    assert!(matches!(e, voltaic::Error::OutOfMemory(_)), "{e}");
    let ok = Tensor::ones(&[4], DType::F32, g).unwrap().add(1.0).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(ok, vec![2.0; 4]);
}

fn idx(v: &[i32], dims: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, Device::Cpu).unwrap()
}

#[test]
fn out_of_range_indices_are_errors_when_read() {
    // The device's index-error flag is shared, so this runs alone.
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (gpu, _) = gpu();
    let gpu = || gpu;
    let x = Tensor::randn(&[4, 3], DType::F32, gpu()).unwrap();
    let bad = idx(&[0, 4], &[2]).to_device(gpu()).unwrap();
    let r = x.index_select(0, &bad).unwrap();
    let e = r.to_vec::<f32>().expect_err("index 4 of 4 rows must fail");
    assert!(e.to_string().contains("index_select") && e.to_string().contains("index 4"), "{e}");
    // The flag was consumed: later work on the device runs normally.
    let ok = x.index_select(0, &idx(&[3, 0], &[2]).to_device(gpu()).unwrap()).unwrap();
    assert_eq!(ok.to_vec::<f32>().unwrap().len(), 6);
    let neg = idx(&[-1, 0, 0], &[1, 3]).to_device(gpu()).unwrap();
    let e = x.gather(0, &neg).unwrap().to_vec::<f32>().expect_err("negative index");
    assert!(e.to_string().contains("gather"), "{e}");
}

#[test]
fn an_out_of_range_u32_index_is_reported_as_unsigned() {
    // Serial: the device reports an index error at its next read, whichever test reads.
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, _) = gpu();
    let x = Tensor::zeros(&[4], DType::F32, g).unwrap();
    let idx = Tensor::from_vec(vec![u32::MAX], &[1], g).unwrap();
    let e = x.index_select(0, &idx).unwrap().to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("4294967295"), "{e}");
    let idx = Tensor::from_vec(vec![-3i32], &[1], g).unwrap();
    let e = x.index_select(0, &idx).unwrap().to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("index -3 "), "{e}");
}

#[test]
fn work_past_32_bit_indices_is_refused_with_a_clear_error() {
    // 2^36 elements summed (the zeros are fused, so no buffer is that
    // large): the kernel could not index them, and says so.
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, _) = gpu();
    let e = Tensor::zeros(&[1 << 20, 1 << 16], DType::F32, g).unwrap().sum_all().unwrap().item::<f32>().unwrap_err().to_string();
    assert!(e.contains("reduce") && e.contains("68719476736") && e.contains("32-bit"), "{e}");
    // The device keeps working.
    assert_eq!(Tensor::ones(&[5], DType::F32, g).unwrap().sum_all().unwrap().item::<f32>().unwrap(), 5.0);
}

/// Large uploads go through staging buffers that are kept mapped and
/// reused: the values arrive, in order with the work around them, when the
/// freed buffers of earlier uploads and kernels are handed out again.
#[test]
fn large_uploads_reuse_their_staging_and_stay_in_order() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (g, _) = gpu();
    let n = (1 << 19) + 3; // 2 MiB and a bit: the staged path
    let host = |k: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 + k * 13) % 101) as f32 - 50.0).collect() };
    let mut prev: Option<Tensor> = None;
    for k in 0..6 {
        let t = Tensor::from_vec(host(k), &[n], g).unwrap();
        // Work on the new upload and on the previous one, queued together
        // before anything is read; then a read of each.
        let doubled = t.mul(2.0).unwrap();
        let other = prev.as_ref().map(|p| p.add(&t).unwrap());
        assert_eq!(doubled.to_vec::<f32>().unwrap(), host(k).iter().map(|x| x * 2.0).collect::<Vec<_>>(), "step {k}");
        if let Some(o) = other {
            let want: Vec<f32> = host(k - 1).iter().zip(&host(k)).map(|(a, b)| a + b).collect();
            assert_eq!(o.to_vec::<f32>().unwrap(), want, "step {k}");
        }
        prev = Some(t);
    }
    // Several uploads with no read in between, then one read of their sum.
    let hosts: Vec<Vec<f32>> = (0..4).map(|k| host(k + 10)).collect();
    let parts: Vec<Tensor> = hosts.iter().map(|h| Tensor::from_vec(h.clone(), &[n], g).unwrap()).collect();
    let sum = parts.iter().skip(1).fold(parts[0].clone(), |a, b| a.add(b).unwrap());
    let want: Vec<f32> = (0..n).map(|i| hosts.iter().map(|h| h[i]).sum()).collect();
    assert_eq!(sum.to_vec::<f32>().unwrap(), want);
}
