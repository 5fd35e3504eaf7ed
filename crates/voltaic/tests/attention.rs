//! `scaled_dot_product_attention`: the one-kernel form against f64 loops on
//! the CPU, the GPU against the CPU on the same inputs (key counts around
//! the kernel's chunks of 64 and 256, several output elements per thread, masks
//! with -inf and broadcast, strided views, f16), the differentiable form
//! against the fused one and finite differences, and bad input.

mod common;

use common::Rng;
use voltaic::{DType, Device, Tensor};

fn gpu() -> Device {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)");
    Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0))
}

fn tensor(v: &[f64], dims: &[usize], dev: Device) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().to_device(dev).unwrap()
}

/// One case: batch `b`, queries `m`, keys `n`, widths `d` and `e`, and a
/// mask `[m, n]` (shared by the batch) with some -inf entries, or none.
struct Case {
    b: usize,
    m: usize,
    n: usize,
    d: usize,
    e: usize,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    mask: Option<Vec<f64>>,
}

impl Case {
    fn new(rng: &mut Rng, (b, m, n, d, e): (usize, usize, usize, usize, usize), masked: bool) -> Case {
        let mask = masked.then(|| {
            // Every row keeps its first key, so no row is masked entirely.
            (0..m * n).map(|i| if i % n != 0 && rng.uniform() < 0.3 { f64::NEG_INFINITY } else { rng.range(-2.0, 2.0) }).collect()
        });
        Case { b, m, n, d, e, q: rng.normals(b * m * d), k: rng.normals(b * n * d), v: rng.normals(b * n * e), mask }
    }

    /// f64 loops.
    fn reference(&self, scale: f64) -> Vec<f64> {
        let (b, m, n, d, e) = (self.b, self.m, self.n, self.d, self.e);
        let mut out = vec![0.0; b * m * e];
        for bi in 0..b {
            for i in 0..m {
                let s: Vec<f64> = (0..n)
                    .map(|j| (0..d).map(|c| self.q[(bi * m + i) * d + c] * self.k[(bi * n + j) * d + c]).sum::<f64>() * scale + self.mask.as_ref().map_or(0.0, |mk| mk[i * n + j]))
                    .collect();
                let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let total: f64 = w.iter().sum();
                for c in 0..e {
                    out[(bi * m + i) * e + c] = (0..n).map(|j| w[j] * self.v[(bi * n + j) * e + c]).sum::<f64>() / total;
                }
            }
        }
        out
    }

    /// The op on `dev`; the queries as a transposed view when `strided`.
    fn run(&self, dev: Device, dt: DType, scale: Option<f64>, strided: bool) -> Tensor {
        let (b, m, n, d, e) = (self.b, self.m, self.n, self.d, self.e);
        let q = if strided {
            // The same values, stored [b, d, m] and seen through a transpose.
            let t: Vec<f64> = (0..b * d * m).map(|x| self.q[(x / (d * m) * m + x % m) * d + x / m % d]).collect();
            tensor(&t, &[b, d, m], dev).transpose(1, 2).unwrap()
        } else {
            tensor(&self.q, &[b, m, d], dev)
        };
        let (k, v) = (tensor(&self.k, &[b, n, d], dev), tensor(&self.v, &[b, n, e], dev));
        let mask = self.mask.as_ref().map(|mk| tensor(mk, &[m, n], dev).to_dtype(dt).unwrap());
        let (q, k, v) = (q.to_dtype(dt).unwrap(), k.to_dtype(dt).unwrap(), v.to_dtype(dt).unwrap());
        let out = q.scaled_dot_product_attention(&k, &v, mask.as_ref(), scale).unwrap();
        assert_eq!(out.dims(), [b, m, e]);
        assert_eq!(out.dtype(), dt);
        out
    }
}

fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: element {i} is {g}, expected {w}");
    }
}

/// The last shape is past the CPU kernel's serial threshold (2^21
/// multiply-adds), so both of its paths run.
const SHAPES: [(usize, usize, usize, usize, usize); 10] =
    [(1, 1, 1, 8, 4), (2, 3, 63, 16, 8), (3, 1, 64, 64, 64), (2, 5, 65, 8, 70), (1, 4, 130, 32, 16), (4, 9, 7, 64, 64), (1, 2, 200, 5, 129), (2, 40, 300, 64, 72), (1, 3, 256, 16, 8), (2, 2, 257, 8, 65)];

#[test]
fn one_kernel_attention_matches_f64_loops_and_the_cpu() {
    let mut rng = Rng::new(7);
    for (ci, &shape) in SHAPES.iter().enumerate() {
        let masked = ci % 2 == 1;
        let c = Case::new(&mut rng, shape, masked);
        let scale = if ci % 3 == 0 { None } else { Some(rng.range(0.05, 0.5)) };
        let want = c.reference(scale.unwrap_or(1.0 / (shape.3 as f64).sqrt()));
        let what = format!("{shape:?} masked {masked} scale {scale:?}");
        let cpu = c.run(Device::Cpu, DType::F32, scale, ci % 2 == 0).to_f64_vec().unwrap();
        close(&cpu, &want, 1e-5, &format!("cpu {what}"));
        for strided in [false, true] {
            let g = c.run(gpu(), DType::F32, scale, strided).to_f64_vec().unwrap();
            close(&g, &want, 1e-4, &format!("gpu {what} strided {strided}"));
        }
        let h = c.run(gpu(), DType::F16, scale, false).to_f64_vec().unwrap();
        let hc = c.run(Device::Cpu, DType::F16, scale, false).to_f64_vec().unwrap();
        close(&h, &hc, 2e-2, &format!("gpu f16 vs cpu f16 {what}"));
    }
}

/// Scores spread far past exp's range (queries and keys scaled by 30): a
/// kernel whose running maximum missed any key of a chunk (the maximum is
/// only a stabilizer, invisible at ordinary scores) overflows to inf/NaN.
/// Shapes with the decode step's few rows (their keys split over
/// workgroups) and with many rows, keys past one chunk.
#[test]
fn scores_past_exps_range_take_every_keys_maximum() {
    let mut rng = Rng::new(21);
    for &shape in &[(1, 9, 257, 64, 64), (2, 40, 300, 16, 8), (3, 3, 256, 64, 64)] {
        let mut c = Case::new(&mut rng, shape, false);
        for x in c.q.iter_mut().chain(c.k.iter_mut()) {
            *x *= 30.0;
        }
        let want = c.reference(1.0 / (shape.3 as f64).sqrt());
        for dev in [Device::Cpu, gpu()] {
            let got = c.run(dev, DType::F32, None, false).to_f64_vec().unwrap();
            close(&got, &want, 1e-4, &format!("{dev} {shape:?}, scores beyond exp's range"));
        }
    }
}

/// Leading dims and a mask broadcast over them (`[1, 1, M, N]` against
/// `[2, 3, M, N]` scores), as grouped-query attention uses it; and none.
#[test]
fn leading_dims_and_broadcast_masks() {
    let mut rng = Rng::new(9);
    let (m, n, d) = (3, 20, 8);
    for dev in [Device::Cpu, gpu()] {
        let q = tensor(&rng.normals(6 * m * d), &[2, 3, m, d], dev);
        let k = tensor(&rng.normals(6 * n * d), &[2, 3, n, d], dev);
        let v = tensor(&rng.normals(6 * n * d), &[2, 3, n, d], dev);
        let mask = tensor(&(0..m * n).map(|i| if i % n > i / n + 10 { -1e30 } else { 0.0 }).collect::<Vec<_>>(), &[1, 1, m, n], dev);
        let got = q.scaled_dot_product_attention(&k, &v, Some(&mask), None).unwrap();
        let manual = q.matmul(&k.transpose(-1, -2).unwrap()).unwrap().mul(1.0 / (d as f64).sqrt()).unwrap().add(&mask).unwrap().softmax(-1).unwrap().matmul(&v).unwrap();
        assert_eq!(got.dims(), [2, 3, m, d]);
        close(&got.to_f64_vec().unwrap(), &manual.to_f64_vec().unwrap(), 1e-5, &format!("{dev}"));
        // Empty queries give an empty result.
        let none = q.narrow(2, 0, 0).unwrap().scaled_dot_product_attention(&k, &v, None, None).unwrap();
        assert_eq!(none.dims(), [2, 3, 0, d]);
        // No leading dims at all: one head [M, D], a mask [M, N].
        let (q2, k2, v2) = (tensor(&rng.normals(m * d), &[m, d], dev), tensor(&rng.normals(n * d), &[n, d], dev), tensor(&rng.normals(n * d), &[n, d], dev));
        let mask2 = mask.reshape_dims(&[m, n]).unwrap();
        let got = q2.scaled_dot_product_attention(&k2, &v2, Some(&mask2), None).unwrap();
        let manual = q2.matmul(&k2.t().unwrap()).unwrap().mul(1.0 / (d as f64).sqrt()).unwrap().add(&mask2).unwrap().softmax(-1).unwrap().matmul(&v2).unwrap();
        assert_eq!(got.dims(), [m, d]);
        close(&got.to_f64_vec().unwrap(), &manual.to_f64_vec().unwrap(), 1e-5, &format!("{dev}: no leading dims"));
    }
}

/// Rows masked everywhere with f32::MIN average the values (as PyTorch's
/// f32 softmax does); a first chunk of keys (64 on a software adapter, 256
/// on others) masked with -inf leaves the rest to the softmax; no keys at
/// all gives zeros.
#[test]
fn masked_chunks_and_no_keys() {
    let mut rng = Rng::new(13);
    let (m, n, d, e) = (3, 300, 8, 5);
    let c = Case::new(&mut rng, (1, m, n, d, e), false);
    let mut mask = vec![0.0; m * n];
    for j in 0..n {
        mask[j] = f32::MIN as f64; // row 0: everything
        mask[n + j] = if j < 64 { f64::NEG_INFINITY } else { 0.0 }; // row 1: the first chunk
        mask[2 * n + j] = if j < 256 { f64::NEG_INFINITY } else { 0.0 }; // row 2: the first (hardware) chunk
    }
    let mean: Vec<f64> = (0..e).map(|x| (0..n).map(|j| c.v[j * e + x]).sum::<f64>() / n as f64).collect();
    let masked = Case { mask: Some(mask.clone()), ..c };
    let want = masked.reference(0.3);
    for dev in [Device::Cpu, gpu()] {
        let got = masked.run(dev, DType::F32, Some(0.3), false).to_f64_vec().unwrap();
        close(&got[..e], &mean, 1e-5, &format!("{dev}: a row masked with f32::MIN"));
        close(&got[e..], &want[e..], 1e-4, &format!("{dev}: rows after a masked chunk"));
        let q = tensor(&rng.normals(2 * d), &[1, 2, d], dev);
        let empty = Tensor::zeros(&[1, 0, d], DType::F32, dev).unwrap();
        let none = q.scaled_dot_product_attention(&empty, &Tensor::zeros(&[1, 0, e], DType::F32, dev).unwrap(), None, None).unwrap();
        assert_eq!(none.to_f64_vec().unwrap(), vec![0.0; 2 * e], "{dev}: no keys");
    }
}

/// BERT's layout: heads split from a `[B, T, heads * d]` projection (leading
/// dims that do not flatten into one), a padding mask `[B, 1, 1, T]`
/// broadcast over heads and queries, on the GPU and the CPU, against f64
/// loops.
#[test]
fn heads_of_a_projection_with_a_padding_mask() {
    let mut rng = Rng::new(23);
    let (b, t, heads, d) = (16, 40, 8, 8);
    let h = heads * d;
    let (pq, pk, pv) = (rng.normals(b * t * h), rng.normals(b * t * h), rng.normals(b * t * h));
    let lens: Vec<usize> = (0..b).map(|i| 1 + (i * 7) % t).collect();
    let bias: Vec<f64> = (0..b * t).map(|x| if x % t < lens[x / t] { 0.0 } else { -1e9 }).collect();
    let mut want = vec![0.0; b * heads * t * d];
    for bi in 0..b {
        for hi in 0..heads {
            for i in 0..t {
                let at = |p: &[f64], j: usize, c: usize| p[(bi * t + j) * h + hi * d + c];
                let s: Vec<f64> = (0..t).map(|j| (0..d).map(|c| at(&pq, i, c) * at(&pk, j, c)).sum::<f64>() * 0.25 + bias[bi * t + j]).collect();
                let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let total: f64 = w.iter().sum();
                for c in 0..d {
                    want[((bi * heads + hi) * t + i) * d + c] = (0..t).map(|j| w[j] * at(&pv, j, c)).sum::<f64>() / total;
                }
            }
        }
    }
    for dev in [Device::Cpu, gpu()] {
        let split = |p: &[f64]| tensor(p, &[b, t, h], dev).reshape_dims(&[b, t, heads, d]).unwrap().permute(&[0, 2, 1, 3]).unwrap();
        let mask = tensor(&bias, &[b, 1, 1, t], dev);
        let got = split(&pq).scaled_dot_product_attention(&split(&pk), &split(&pv), Some(&mask), Some(0.25)).unwrap();
        assert_eq!(got.dims(), [b, heads, t, d]);
        close(&got.to_f64_vec().unwrap(), &want, 1e-4, &format!("{dev}"));
    }
}

/// Tracked inputs take the differentiable form: the same values, and
/// gradients that match finite differences.
#[test]
fn tracked_inputs_differentiate() {
    let mut rng = Rng::new(11);
    let (m, n, d) = (2, 5, 3);
    let (qv, kv, vv) = (rng.normals(m * d), rng.normals(n * d), rng.normals(n * d));
    let f = |q: &[f64]| -> f64 {
        let c = Case { b: 1, m, n, d, e: d, q: q.to_vec(), k: kv.clone(), v: vv.clone(), mask: None };
        c.reference(0.7).iter().enumerate().map(|(i, x)| x * (i as f64 + 1.0)).sum()
    };
    let dev = Device::Cpu;
    let q = tensor(&qv, &[1, m, d], dev).to_dtype(DType::F64).unwrap().requires_grad().unwrap();
    let (k, v) = (tensor(&kv, &[1, n, d], dev).to_dtype(DType::F64).unwrap(), tensor(&vv, &[1, n, d], dev).to_dtype(DType::F64).unwrap());
    let out = q.scaled_dot_product_attention(&k, &v, None, Some(0.7)).unwrap();
    let fused = q.detach().scaled_dot_product_attention(&k, &v, None, Some(0.7)).unwrap();
    // f64 takes the unfused form too (the kernel computes in f32): equal.
    close(&out.to_f64_vec().unwrap(), &fused.to_f64_vec().unwrap(), 1e-12, "tracked vs untracked f64");
    let weights = Tensor::arange(1.0, (m * d) as f64 + 1.0, 1.0, DType::F64, dev).unwrap().reshape_dims(&[1, m, d]).unwrap();
    out.mul(&weights).unwrap().sum_all().unwrap().backward().unwrap();
    let g = q.grad().unwrap().to_f64_vec().unwrap();
    for i in 0..m * d {
        let (mut up, mut down) = (qv.clone(), qv.clone());
        up[i] += 1e-6;
        down[i] -= 1e-6;
        let fd = (f(&up) - f(&down)) / 2e-6;
        assert!((g[i] - fd).abs() < 1e-5 * (1.0 + fd.abs()), "d/dq[{i}]: {} vs finite difference {fd}", g[i]);
    }
}

#[test]
fn bad_input_is_an_error_naming_the_op() {
    let dev = Device::Cpu;
    let t = |dims: &[usize]| Tensor::ones(dims, DType::F32, dev).unwrap();
    let cases = [
        (t(&[2, 3, 4]), t(&[2, 5, 3]), t(&[2, 5, 4]), None, "shape"),
        (t(&[2, 3, 4]), t(&[1, 5, 4]), t(&[1, 5, 4]), None, "leading"),
        (t(&[2, 3, 4]), t(&[2, 5, 4]), t(&[2, 6, 4]), None, "N"),
        (t(&[2, 3, 4]), t(&[2, 5, 4]), t(&[2, 5, 4]), Some(t(&[3, 4])), "broadcast"),
        (t(&[4]), t(&[4]), t(&[4]), None, "rank"),
    ];
    for (q, k, v, mask, what) in cases {
        let e = q.scaled_dot_product_attention(&k, &v, mask.as_ref(), None).unwrap_err().to_string();
        assert!(e.contains("scaled_dot_product_attention"), "{what}: {e}");
    }
    let e = t(&[2, 3, 4]).to_dtype(DType::I32).unwrap().scaled_dot_product_attention(&t(&[2, 5, 4]), &t(&[2, 5, 4]), None, None).unwrap_err().to_string();
    assert!(e.contains("float"), "{e}");
    let e = t(&[2, 3, 4]).scaled_dot_product_attention(&t(&[2, 5, 4]), &t(&[2, 5, 4]), None, Some(f64::NAN)).unwrap_err().to_string();
    assert!(e.contains("finite"), "{e}");
}

/// Elementwise work whose result only the attention kernel reads as its
/// queries (a decoder's RoPE) runs in the kernel's query loads where the
/// executor takes prologues (hardware adapters; `VOLTAIC_KERNELS=hardware`
/// or `VOLTAIC_PROLOGUES=1` on a software one): one kernel, the f64
/// result. A query the caller keeps stays a kernel of its own.
#[test]
fn work_before_the_queries_runs_in_their_loads() {
    let mut rng = Rng::new(21);
    let (b, m, n, d) = (3, 2, 37, 16);
    let (x, bias) = (rng.normals(b * m * d), rng.normals(d));
    let (k, v) = (rng.normals(b * n * d), rng.normals(b * n * d));
    // q = x * 0.5 + bias.
    let q: Vec<f64> = (0..b * m * d).map(|i| x[i] * 0.5 + bias[i % d]).collect();
    let want = Case { b, m, n, d, e: d, q, k: k.clone(), v: v.clone(), mask: None }.reference(0.25);
    let prologues = match std::env::var("VOLTAIC_PROLOGUES") {
        Ok(v) => v != "0",
        Err(_) => voltaic::backend::adapters()[0].device_type != "Cpu" || std::env::var("VOLTAIC_KERNELS").is_ok_and(|v| v == "hardware"),
    };
    for dev in [Device::Cpu, gpu()] {
        let (kt, vt) = (tensor(&k, &[b, n, d], dev), tensor(&v, &[b, n, d], dev));
        let (xt, bt) = (tensor(&x, &[b, m, d], dev), tensor(&bias, &[d], dev));
        // A mask of zeros, realized: no kernel of its own in the graph.
        let mask = tensor(&vec![0.0; m * n], &[m, n], dev);
        Tensor::realize_all(&[&kt, &vt, &xt, &bt, &mask]).unwrap();
        let q = xt.mul(0.5).unwrap().add(&bt).unwrap();
        let out = q.scaled_dot_product_attention(&kt, &vt, Some(&mask), Some(0.25)).unwrap();
        drop(q);
        if dev.is_gpu() {
            let kinds: Vec<&str> = voltaic::inspect(&[&out]).into_iter().map(|k| k.kind).collect();
            let want_kinds: Vec<&str> = if prologues { vec!["attention"] } else { vec!["elementwise", "attention"] };
            assert_eq!(kinds, want_kinds, "{dev}");
        }
        close(&out.to_f64_vec().unwrap(), &want, 1e-5, &format!("{dev}: queries computed in the kernel's loads"));
        // Kept by the caller, the queries are stored: two kernels.
        let q = xt.mul(0.5).unwrap().add(&bt).unwrap();
        let out = q.scaled_dot_product_attention(&kt, &vt, Some(&mask), Some(0.25)).unwrap();
        if dev.is_gpu() {
            assert_eq!(voltaic::inspect(&[&out]).len(), 2, "{dev}: a kept query");
        }
        close(&out.to_f64_vec().unwrap(), &want, 1e-5, &format!("{dev}: kept queries"));
    }
}

/// A KV cache's write of the new token (a `where` over the slots, as a
/// decoder writes it), which the caller keeps, is computed in the attention
/// kernel's loads as well where the executor takes prologues: the attention
/// reads its keys and values from the old caches and the new token, and
/// the written caches are stored too. Both give the f64 results, with the
/// keys' write rotating the new key in pairs as RoPE does, and a key width
/// of 6 (its loads cannot walk whole rows in slices of four).
#[test]
fn cache_writes_the_caller_keeps_run_in_the_attention_loads_too() {
    let mut rng = Rng::new(23);
    let prologues = match std::env::var("VOLTAIC_PROLOGUES") {
        Ok(v) => v != "0",
        Err(_) => voltaic::backend::adapters()[0].device_type != "Cpu" || std::env::var("VOLTAIC_KERNELS").is_ok_and(|v| v == "hardware"),
    };
    for (b, m, n, d, slot) in [(3, 3, 37, 16, 11), (2, 1, 9, 6, 8), (1, 2, 300, 64, 0)] {
        let q = rng.normals(b * m * d);
        let (kc, vc) = (rng.normals(b * n * d), rng.normals(b * n * d));
        let (kn, vn) = (rng.normals(b * d), rng.normals(b * d));
        let (cos, sin) = (rng.normals(d / 2), rng.normals(d / 2));
        // The new key rotated in pairs (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos).
        let rot = |bi: usize, j: usize| {
            let (x0, x1) = (kn[bi * d + j / 2 * 2], kn[bi * d + j / 2 * 2 + 1]);
            let (c, s) = (cos[j / 2], sin[j / 2]);
            if j.is_multiple_of(2) { x0 * c - x1 * s } else { x0 * s + x1 * c }
        };
        let kw: Vec<f64> = (0..b * n * d).map(|i| if (i / d) % n == slot { rot(i / (n * d), i % d) } else { kc[i] }).collect();
        let vw: Vec<f64> = (0..b * n * d).map(|i| if (i / d) % n == slot { vn[i / (n * d) * d + i % d] + 1.0 } else { vc[i] }).collect();
        let want = Case { b, m, n, d, e: d, q: q.clone(), k: kw.clone(), v: vw.clone(), mask: None }.reference(0.25);
        for dev in [Device::Cpu, gpu()] {
            let (qt, kct, vct) = (tensor(&q, &[b, m, d], dev), tensor(&kc, &[b, n, d], dev), tensor(&vc, &[b, n, d], dev));
            let (knt, vnt) = (tensor(&kn, &[b, 1, d / 2, 2], dev), tensor(&vn, &[b, 1, d], dev));
            // Each element's weights of its pair's first and second elements.
            let w0: Vec<f64> = (0..d).map(|j| if j.is_multiple_of(2) { cos[j / 2] } else { sin[j / 2] }).collect();
            let w1: Vec<f64> = (0..d).map(|j| if j.is_multiple_of(2) { -sin[j / 2] } else { cos[j / 2] }).collect();
            let (w0, w1) = (tensor(&w0, &[1, 1, d / 2, 2], dev), tensor(&w1, &[1, 1, d / 2, 2], dev));
            let mask = tensor(&vec![0.0; m * n], &[m, n], dev);
            let slots = Tensor::arange(0.0, n as f64, 1.0, DType::I32, dev).unwrap();
            Tensor::realize_all(&[&qt, &kct, &vct, &knt, &vnt, &w0, &w1, &mask]).unwrap();
            let (kw_t, vw_t) = {
                let keep = slots.eq(slot as f64).unwrap().reshape_dims(&[1, n, 1]).unwrap();
                // The rotation of the new key broadcast over the slots, in
                // the pairs' shape, as the LLaMA model writes it.
                let wide = knt.broadcast_to(&[b, n, d / 2, 2]).unwrap();
                let half = |i| wide.narrow(3, i, 1).unwrap().broadcast_to(&[b, n, d / 2, 2]).unwrap();
                let rotated = half(0).mul(&w0).unwrap().add(half(1).mul(&w1).unwrap()).unwrap().reshape_dims(&[b, n, d]).unwrap();
                let kw_t = keep.broadcast_to(&[b, n, d]).unwrap().where_cond(&rotated, &kct).unwrap();
                let vw_t = keep.broadcast_to(&[b, n, d]).unwrap().where_cond(vnt.add(1.0).unwrap().broadcast_to(&[b, n, d]).unwrap(), &vct).unwrap();
                (kw_t, vw_t)
            };
            let out = qt.scaled_dot_product_attention(&kw_t, &vw_t, Some(&mask), Some(0.25)).unwrap();
            if dev.is_gpu() {
                let att = voltaic::inspect(&[&out, &kw_t, &vw_t]).into_iter().find(|k| k.kind == "attention").expect("an attention kernel");
                // Its own keys and values, or the old caches, the new token, its rotation's tables and the slots' flags.
                assert_eq!(att.inputs > 4, prologues, "{dev}: the attention reads {} buffers", att.inputs);
            }
            let what = format!("{dev}: b {b} m {m} n {n} d {d}, slot {slot}");
            close(&out.to_f64_vec().unwrap(), &want, 1e-5, &format!("{what}: attention"));
            close(&kw_t.to_f64_vec().unwrap(), &kw, 1e-5, &format!("{what}: written keys"));
            close(&vw_t.to_f64_vec().unwrap(), &vw, 1e-5, &format!("{what}: written values"));
        }
    }
}
