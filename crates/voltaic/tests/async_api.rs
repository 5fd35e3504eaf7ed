//! The async API (`to_vec_async`, `item_async`, `realize_async`,
//! `Device::gpu_async`, `synchronize_async`) against the blocking one and
//! against f64 loops, on the CPU and the GPU. The futures are driven by a
//! small executor that re-polls only when woken, so a future that forgets
//! to wake (and would hang a browser) fails here instead of spinning.

mod common;
use common::*;
use std::future::Future;
use std::sync::mpsc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;
use voltaic::{DType, Device, Tensor};

struct Signal(mpsc::Sender<()>);
impl Wake for Signal {
    fn wake(self: std::sync::Arc<Self>) {
        let _ = self.0.send(());
    }
}

/// Run `fut` to the end, polling only after a wake; how many polls it took.
fn run<F: Future>(fut: F) -> (F::Output, usize) {
    let (tx, rx) = mpsc::channel();
    let waker = Waker::from(std::sync::Arc::new(Signal(tx)));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    let mut polls = 0;
    loop {
        polls += 1;
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return (v, polls);
        }
        rx.recv_timeout(Duration::from_secs(60)).expect("a pending future was never woken");
    }
}

/// An index error is reported to the next read from its device, from
/// whichever thread reads first (as a CUDA device-side assert reaches the
/// next CUDA call): the test that provokes one must not share the GPU with
/// the others, so the GPU tests take turns.
static GPU_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    GPU_TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn gpu() -> Device {
    assert!(
        !voltaic::backend::adapters().is_empty(),
        "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)"
    );
    let i = std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    run(Device::gpu_async(i)).0.expect("gpu_async opens the test adapter")
}

/// A broadcast, a reduction and a matmul on random inputs: async and
/// blocking reads agree with each other and with f64 loops.
fn check_reads(device: Device) {
    let mut rng = Rng::new(7);
    let (m, k, n) = (13, 29, 7);
    let a: Vec<f64> = rng.normals(m * k);
    let b: Vec<f64> = rng.normals(k * n);
    let c: Vec<f64> = rng.normals(n);
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let ta = Tensor::from_vec(f32s(&a), &[m, k], device).unwrap();
    let tb = Tensor::from_vec(f32s(&b), &[k, n], device).unwrap();
    let tc = Tensor::from_vec(f32s(&c), &[n], device).unwrap();
    let y = ta.matmul(&tb).unwrap().add(&tc).unwrap().relu().unwrap();
    let mut want = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|p| round_f32(a[i * k + p]) * round_f32(b[p * n + j])).sum();
            want[i * n + j] = (dot + round_f32(c[j])).max(0.0);
        }
    }
    let (got, _) = run(y.to_vec_async::<f32>());
    let got: Vec<f64> = got.unwrap().into_iter().map(f64::from).collect();
    assert_close(&got, &want, 1e-5, 1e-5, "to_vec_async");
    let blocking: Vec<f64> = y.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect();
    assert_same(&got, &blocking, "to_vec_async against to_vec");

    // A strided view (a transpose) read without blocking.
    let (t, _) = run(y.t().unwrap().to_f64_vec_async());
    let want_t: Vec<f64> = (0..n * m).map(|i| want[(i % m) * n + i / m]).collect();
    assert_close(&t.unwrap(), &want_t, 1e-5, 1e-5, "to_f64_vec_async of a transpose");

    let s = y.sum_all().unwrap();
    let (item, _) = run(s.item_async::<f32>());
    let total: f64 = want.iter().sum();
    assert_close(&[item.unwrap() as f64], &[total], 1e-5, 1e-4, "item_async");
    assert_err_mentions(run(y.item_async::<f32>()).0, &["item_async", "one element", "13, 7"]);
    assert_err_mentions(run(y.to_vec_async::<i32>()).0, &["to_vec_async", "f32", "i32"]);

    // realize_async resolves once the values exist; an empty tensor too.
    let z = ta.exp().unwrap().mul(&ta).unwrap();
    assert!(!z.is_realized());
    let (r, _) = run(z.realize_async());
    assert!(r.unwrap().is_realized());
    let e = Tensor::zeros(&[0, 3], DType::F32, device).unwrap().add(Tensor::ones(&[3], DType::F32, device).unwrap()).unwrap();
    assert_eq!(run(e.to_vec_async::<f32>()).0.unwrap(), Vec::<f32>::new());
    run(device.synchronize_async()).0.unwrap();
}

#[test]
fn async_reads_match_blocking_reads_and_f64_on_the_cpu() {
    check_reads(Device::Cpu);
    // The CPU has nothing in flight: its futures are ready at the first poll.
    let x = Tensor::randn(&[5], DType::F32, Device::Cpu).unwrap().exp().unwrap();
    assert_eq!(run(x.to_vec_async::<f32>()).1, 1);
}

#[test]
fn async_reads_match_blocking_reads_and_f64_on_the_gpu() {
    let _turn = turn();
    check_reads(gpu());
}

#[test]
fn gpu_async_opens_the_device_the_blocking_path_finds() {
    let _turn = turn();
    let g = gpu();
    let Device::Gpu(i) = g else { panic!("gpu_async gave {g:?}") };
    assert!(i < voltaic::backend::adapters().len());
    assert_eq!(run(voltaic::backend::adapters_async()).0.len(), voltaic::backend::adapters().len());
    let n = voltaic::backend::adapters().len();
    assert_err_mentions(run(Device::gpu_async(n + 3)).0, &["gpu:", "not available"]);
    // best_async gives a device that computes.
    let d = run(Device::best_async()).0;
    let v = run(Tensor::ones(&[3], DType::F32, d).unwrap().sum_all().unwrap().item_async::<f32>()).0.unwrap();
    assert_eq!(v, 3.0);
}

#[test]
fn an_index_error_reaches_the_async_reader() {
    let _turn = turn();
    for device in [Device::Cpu, gpu()] {
        let x = Tensor::randn(&[4, 3], DType::F32, device).unwrap();
        let idx = idx_tensor(&[0, 9], &[2]).to_device(device).unwrap();
        let r = x.index_select(0, &idx).and_then(|y| run(y.to_vec_async::<f32>()).0);
        assert_err_mentions(r, &["index_select", "9", "4"]);
        // The device keeps working after it.
        let ok = run(x.sum_all().unwrap().item_async::<f32>()).0.unwrap();
        let want: f32 = x.to_vec::<f32>().unwrap().iter().sum();
        assert!((ok - want).abs() < 1e-5, "{ok} vs {want}");
    }
}

#[test]
fn a_pending_gpu_read_wakes_its_task() {
    // Work big enough (on lavapipe) that the first poll finds it unfinished:
    // the future must then arrange its own wake-up.
    let _turn = turn();
    let g = gpu();
    let a = Tensor::randn(&[192, 192], DType::F32, g).unwrap();
    let mut y = a.clone();
    for _ in 0..6 {
        y = y.matmul(&a).unwrap().tanh().unwrap();
    }
    let (v, polls) = run(y.sum_all().unwrap().item_async::<f32>());
    assert!(v.unwrap().is_finite());
    let want = y.sum_all().unwrap().item::<f32>().unwrap();
    assert_eq!(run(y.sum_all().unwrap().item_async::<f32>()).0.unwrap(), want);
    eprintln!("the first read took {polls} polls");
}
