//! Captured steps (`voltaic::Capture`): after two calls through the graph a
//! step is replayed from its plans; replays must equal an independent f64
//! reference on fresh inputs, on the CPU and on the GPU, and whatever a
//! replay could not see (constants and host data that change per call)
//! must be an error, never a stale result.

use std::cell::Cell;
use std::sync::Mutex;
use voltaic::{host_profile, Capture, DType, Device, Generator, Tensor};

/// The GPU under test; panics (fails the test) when there is none.
fn gpu() -> Device {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)");
    Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0))
}

/// Tests count graph nodes process-wide.
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 + 1e-4 * w.abs(), "{what}: element {i} is {g}, expected {w}");
    }
}

/// `h = relu(x @ w + b)` realized mid-step, then `(h * scale).sum(1)` with
/// `scale` = 1..=n uploaded inside the step each call, `x.t()` and `w`:
/// several realizations, a table rebuilt per call with the same values, an
/// output that is a view of an input and one that is a weight.
fn step_matches_reference(dev: Device) {
    let _l = lock();
    let (k, n) = (7, 5);
    let mut g = Generator::new(3);
    let w = Tensor::randn_with(&mut g, &[k, n], DType::F32, dev).unwrap();
    let b = Tensor::randn_with(&mut g, &[n], DType::F32, dev).unwrap();
    let (wv, bv) = (w.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    let mut step = Capture::new(|x: &[Tensor]| {
        let h = x[0].matmul(&w)?.add(&b)?.relu()?;
        h.realize()?;
        let scale = Tensor::arange(1.0, n as f64 + 1.0, 1.0, DType::F32, dev)?;
        Ok(vec![h.mul(&scale)?.sum(&[1], false)?, x[0].t()?, w.clone(), h])
    });
    let rows = 3;
    for call in 0..6 {
        let x = Tensor::randn_with(&mut g, &[rows, k], DType::F32, dev).unwrap();
        let xv = x.to_f64_vec().unwrap();
        let nodes = host_profile().nodes;
        let out = step.call(&[&x]).unwrap();
        if call >= 2 {
            // Only the two outputs it computes get (realized) nodes.
            assert_eq!(host_profile().nodes, nodes + 2, "call {call}: a replay records no graph");
        }
        let h: Vec<f64> = (0..rows * n).map(|e| (bv[e % n] + (0..k).map(|p| xv[e / n * k + p] * wv[p * n + e % n]).sum::<f64>()).max(0.0)).collect();
        let s: Vec<f64> = (0..rows).map(|i| (0..n).map(|j| h[i * n + j] * (j + 1) as f64).sum()).collect();
        let xt: Vec<f64> = (0..k * rows).map(|e| xv[(e % rows) * k + e / rows]).collect();
        assert_eq!(out[0].dims(), [rows]);
        assert_close(&out[0].to_f64_vec().unwrap(), &s, &format!("{dev} call {call}: sums"));
        assert_eq!(out[1].dims(), [k, rows]);
        assert!(out[1].same_storage(&x), "call {call}: the transposed input is a view of it");
        assert_close(&out[1].to_f64_vec().unwrap(), &xt, &format!("{dev} call {call}: x.t()"));
        assert!(out[2].same_storage(&w), "call {call}: the weight comes back as itself");
        assert_close(&out[3].to_f64_vec().unwrap(), &h, &format!("{dev} call {call}: h"));
        assert!(out.iter().all(|t| t.is_realized()), "call {call}: outputs come back realized");
    }
    let st = step.stats();
    assert_eq!((st.eager_calls, st.captures, st.replays, st.mismatches), (2, 1, 4, 0), "{st:?}");
}

#[test]
fn cpu_replays_match_the_reference() {
    step_matches_reference(Device::Cpu);
}

#[test]
fn gpu_replays_match_the_reference() {
    step_matches_reference(gpu());
}

fn check<F: FnMut(&[Tensor]) -> voltaic::Result<Vec<Tensor>>>(step: &mut Capture<F>, a: &Tensor, b: &Tensor) {
    let out = step.call(&[a, b]).unwrap();
    let want: Vec<f64> = a.to_f64_vec().unwrap().iter().zip(b.to_f64_vec().unwrap()).map(|(x, y)| x * y + 1.0).collect();
    assert_close(&out[0].to_f64_vec().unwrap(), &want, &format!("{} {:?}", a.device(), a.dims()));
}

/// Each kind of inputs (shape, dtype, layout, aliasing) has its own capture,
/// and an earlier kind replays again without tracing.
fn kinds_of_inputs_capture_apart(dev: Device) {
    let _l = lock();
    let mut g = Generator::new(5);
    let mut step = Capture::new(|x: &[Tensor]| Ok(vec![x[0].mul(&x[1])?.add(1.0)?]));
    let fresh = |g: &mut Generator, dims: &[usize]| Tensor::randn_with(g, dims, DType::F32, dev).unwrap();
    for _ in 0..3 {
        let (a, b) = (fresh(&mut g, &[4, 3]), fresh(&mut g, &[4, 3]));
        check(&mut step, &a, &b);
    }
    for _ in 0..3 {
        let (a, b) = (fresh(&mut g, &[2, 9]), fresh(&mut g, &[9, 2]));
        check(&mut step, &a, &b.t().unwrap());
    }
    // The same tensor twice is another kind (the plan binds it once).
    for _ in 0..3 {
        let a = fresh(&mut g, &[4, 3]);
        check(&mut step, &a, &a);
    }
    let (a, b) = (fresh(&mut g, &[4, 3]), fresh(&mut g, &[4, 3]));
    check(&mut step, &a, &b);
    let st = step.stats();
    assert_eq!((st.eager_calls, st.captures, st.replays), (6, 3, 4), "{st:?}");
}

#[test]
fn cpu_kinds_of_inputs_capture_apart() {
    kinds_of_inputs_capture_apart(Device::Cpu);
}

#[test]
fn gpu_kinds_of_inputs_capture_apart() {
    kinds_of_inputs_capture_apart(gpu());
}

/// What a replay cannot see is an error at capture, never a stale value.
fn changing_host_values_are_errors(dev: Device) {
    let _l = lock();
    // A new input tensor each call (the same one twice is never captured).
    let x = || Tensor::ones(&[3], DType::F32, dev).unwrap();
    // A Rust number folded into the graph.
    let calls = Cell::new(0);
    let mut step = Capture::new(|x: &[Tensor]| {
        calls.set(calls.get() + 1);
        // 2, 3, ...: a factor of 1 would be no op at all.
        Ok(vec![x[0].mul(calls.get() as f64 + 1.0)?])
    });
    step.call(&[&x()]).unwrap();
    let e = step.call(&[&x()]).unwrap_err().to_string();
    assert!(e.contains("capture") && e.contains("constant") && e.contains("tensor input"), "{e}");
    // Host data uploaded inside the step with new values each call.
    let calls = Cell::new(0);
    let mut step = Capture::new(|x: &[Tensor]| {
        calls.set(calls.get() + 1);
        let t = Tensor::from_vec(vec![calls.get() as f32; 3], &[3], dev)?;
        Ok(vec![x[0].add(&t)?])
    });
    step.call(&[&x()]).unwrap();
    let e = step.call(&[&x()]).unwrap_err().to_string();
    assert!(e.contains("capture") && e.contains("changed between calls") && e.contains("pass it as an input"), "{e}");
    // State the step reads but does not take as an input.
    let zeros = Tensor::zeros(&[3], DType::F32, dev).unwrap();
    zeros.realize().unwrap();
    let state = std::cell::RefCell::new(zeros);
    let mut step = Capture::new(|x: &[Tensor]| {
        let next = state.borrow().add(&x[0])?;
        next.realize()?;
        *state.borrow_mut() = next.clone();
        Ok(vec![next.mul(2.0)?])
    });
    // The first two calls may differ in the order they bind buffers (a
    // mismatch, traced again); the third cannot pass.
    let e = (0..3).find_map(|_| step.call(&[&x()]).err()).expect("reading changing state is an error").to_string();
    assert!(e.contains("changed between calls"), "{e}");
    assert_eq!(step.stats().replays, 0);
}

#[test]
fn cpu_changing_host_values_are_errors() {
    changing_host_values_are_errors(Device::Cpu);
}

#[test]
fn gpu_changing_host_values_are_errors() {
    changing_host_values_are_errors(gpu());
}

/// An input that is the same tensor on both traced calls could be a tensor
/// the step holds itself: never captured, always right. Two outputs of a
/// replay over one buffer are one input twice, whatever their nodes.
fn same_inputs_are_not_captured(dev: Device) {
    let _l = lock();
    let w = Tensor::full(&[3], 2.0, DType::F32, dev).unwrap();
    w.realize().unwrap();
    let mut step = Capture::new(|x: &[Tensor]| Ok(vec![x[0].mul(&w)?.add(&x[1])?]));
    for i in 0..4 {
        let x = Tensor::full(&[3], i as f64, DType::F32, dev).unwrap();
        // The weight itself as the first input: a replay must not mistake it for `w`.
        let out = step.call(&[&w, &x]).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![4.0 + i as f32; 3]);
    }
    assert_eq!(step.stats().replays, 0);
    let mut dup = Capture::new(|x: &[Tensor]| {
        let s = x[0].add(1.0)?;
        Ok(vec![s.clone(), s])
    });
    let mut add = Capture::new(|x: &[Tensor]| Ok(vec![x[0].add(&x[1])?]));
    for i in 0..4 {
        let x = Tensor::full(&[2], i as f64, DType::F32, dev).unwrap();
        let pair = dup.call(&[&x]).unwrap();
        let out = add.call(&[&pair[0], &pair[1]]).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![2.0 * (i as f32 + 1.0); 2], "call {i}");
        // Then two different tensors of the same shape.
        let y = Tensor::full(&[2], 10.0, DType::F32, dev).unwrap();
        let out = add.call(&[&pair[0], &y]).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![i as f32 + 11.0; 2], "call {i}");
    }
    assert!(dup.stats().replays >= 2);
}

#[test]
fn cpu_same_inputs_are_not_captured() {
    same_inputs_are_not_captured(Device::Cpu);
}

#[test]
fn gpu_same_inputs_are_not_captured() {
    same_inputs_are_not_captured(gpu());
}

/// Two calls that realize different graphs keep nothing; the step is
/// captured once two consecutive calls agree.
#[test]
fn different_graphs_are_traced_again() {
    let _l = lock();
    let dev = Device::Cpu;
    let first = Cell::new(true);
    let mut step = Capture::new(|x: &[Tensor]| {
        let y = x[0].exp()?;
        if first.replace(false) {
            y.realize()?;
        }
        Ok(vec![y.add(1.0)?])
    });
    for i in 0..5 {
        let x = Tensor::full(&[2], i as f64 * 0.5, DType::F32, dev).unwrap();
        let out = step.call(&[&x]).unwrap();
        assert_close(&out[0].to_f64_vec().unwrap(), &[(i as f64 * 0.5).exp() + 1.0; 2], &format!("call {i}"));
    }
    let st = step.stats();
    assert_eq!((st.eager_calls, st.mismatches, st.captures, st.replays), (3, 1, 1, 2), "{st:?}");
}

/// An error inside the step leaves no capture open: the next one starts cleanly.
#[test]
fn an_error_inside_the_step_closes_the_capture() {
    let _l = lock();
    let x = Tensor::ones(&[2, 3], DType::F32, Device::Cpu).unwrap();
    let mut bad = Capture::new(|x: &[Tensor]| Ok(vec![x[0].matmul(&x[0])?]));
    let e = bad.call(&[&x]).unwrap_err().to_string();
    assert!(e.contains("matmul"), "{e}");
    let mut good = Capture::new(|x: &[Tensor]| Ok(vec![x[0].sum(&[1], false)?]));
    for _ in 0..3 {
        assert_eq!(good.call(&[&x]).unwrap()[0].to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
    }
    // A capture inside a captured step is refused.
    let mut outer = Capture::new(|x: &[Tensor]| {
        let mut inner = Capture::new(|y: &[Tensor]| Ok(vec![y[0].neg()?]));
        inner.call(&[&x[0]])
    });
    let e = outer.call(&[&x]).unwrap_err().to_string();
    assert!(e.contains("do not nest"), "{e}");
}
