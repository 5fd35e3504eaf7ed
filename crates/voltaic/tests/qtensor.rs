//! Quantized matrices: the quantized matmul (GEMV and tiled kernels, with
//! epilogues), the dequantizing row gather, and gradients through them,
//! against f64 loops over the host dequantizer, on the CPU and the GPU.

mod common;

use common::Rng;
use voltaic::quant::{dequantize, quantize, GgmlType};
use voltaic::{DType, Device, QTensor, Tensor};

const TYPES: [GgmlType; 5] = [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K];

/// Random blocks of `q`: random bytes, with the f16 scales set to modest
/// values (random bits would give infinities and NaNs).
fn random_blocks(rng: &mut Rng, q: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let (per, bytes) = q.block();
    let blocks = rows * cols / per;
    let mut out = Vec::with_capacity(blocks * bytes);
    for _ in 0..blocks {
        let mut b: Vec<u8> = (0..bytes).map(|_| rng.below(256) as u8).collect();
        let mut half = |at: usize, scale: f64| {
            let v = half::f16::from_f64(rng.range(-1.0, 1.0) * scale);
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        };
        match q {
            GgmlType::Q8_0 | GgmlType::Q4_0 => half(0, 0.05),
            GgmlType::Q4_1 => {
                half(0, 0.05);
                half(2, 0.5);
            }
            GgmlType::Q4K => {
                half(0, 0.01);
                half(2, 0.01);
            }
            GgmlType::Q6K => half(208, 0.002),
            _ => unreachable!(),
        }
        out.extend(b);
    }
    out
}

fn host_dequantized(q: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Vec<f64> {
    let mut w = vec![0f32; rows * cols];
    dequantize(q, bytes, &mut w).unwrap();
    w.into_iter().map(f64::from).collect()
}

/// What the CPU computes for `x [m, k] @ w.t()` when it takes its integer
/// path (at most 16 rows of a Q4_0, Q4_1 or Q8_0 weight): each block of 32
/// activations rounded to 16 bits (scale: the block's largest magnitude
/// over 32767), multiplied by the weights less their block's offset (Q4_1:
/// `m + 8d`, the 4-bit values centred), the offset times the exact sum of
/// the activations added back. Written from that description in f64, it
/// checks the kernel at the usual tolerance; elsewhere the exact product.
fn cpu_reference(q: GgmlType, bytes: &[u8], w: &[f64], x: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    let exact = |i: usize, j: usize| (0..k).map(|e| x[i * k + e] * w[j * k + e]).sum::<f64>();
    let integer = m <= 16 && matches!(q, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0);
    let block_bytes = q.block().1;
    let half = |at: usize| half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f64();
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            if !integer {
                out[i * n + j] = exact(i, j);
                continue;
            }
            let mut s = 0.0;
            for b in 0..k / 32 {
                let xs: Vec<f64> = (0..32).map(|e| x[i * k + b * 32 + e] as f32 as f64).collect();
                let amax = xs.iter().fold(0f64, |a, v| a.max(v.abs())) as f32;
                let d = amax / 32767.0;
                let rounded: Vec<f64> = xs.iter().map(|&v| if d > 0.0 { (v as f32 * (1.0 / d)).round() as f64 * d as f64 } else { 0.0 }).collect();
                let at = (j * k / 32 + b) * block_bytes;
                let offset = if q == GgmlType::Q4_1 { half(at + 2) + 8.0 * half(at) } else { 0.0 };
                for e in 0..32 {
                    s += (w[j * k + b * 32 + e] - offset) * rounded[e];
                }
                s += offset * xs.iter().sum::<f64>();
            }
            out[i * n + j] = s;
        }
    }
    out
}

/// One test at a time on the GPU: an out-of-range index is flagged on the
/// device and reported by its next read, which must be this test's.
static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn devices() -> Vec<Device> {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    vec![Device::Cpu, Device::Gpu(0)]
}

/// f64 values as an f32 tensor of `dims` on `dev`.
fn f32_on(v: Vec<f64>, dims: &[usize], dev: Device) -> Tensor {
    Tensor::from_vec(v, dims, Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().to_device(dev).unwrap()
}

fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * scale, "{what}: element {i}: got {g}, want {w} (scale {scale})");
    }
}

#[test]
fn quantized_matmul_matches_f64_loops_for_every_type_shape_and_device() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(17);
    // 37 outputs, and 4,099: over 4,096 a GEMV takes its own shape (8
    // threads a row on hardware adapters, see `VOLTAIC_KERNELS=hardware`),
    // and 4,099 rows end in a partial workgroup.
    for (q, n) in TYPES.into_iter().flat_map(|q| [(q, 37), (q, 4099)]) {
        let per = q.block().0;
        let k = per * if per == 32 { 5 } else { 2 };
        let bytes = random_blocks(&mut rng, q, n, k);
        let w = host_dequantized(q, &bytes, n, k);
        // 1 row and 3 (GEMV), 10 and 70 (tiled, a partial tile and several).
        for lead in [vec![1], vec![3], vec![2, 5], vec![70]] {
            let m: usize = lead.iter().product();
            let x = rng.normals(m * k);
            let cpu_want = cpu_reference(q, &bytes, &w, &x, m, n, k);
            let mut want = vec![0f64; m * n];
            for i in 0..m {
                for j in 0..n {
                    want[i * n + j] = (0..k).map(|e| x[i * k + e] * w[j * k + e]).sum();
                }
            }
            let mut xdims = lead.clone();
            xdims.push(k);
            for dev in devices() {
                let wq = QTensor::from_blocks(&bytes, q, &[n, k], dev).unwrap();
                let xt = f32_on(x.clone(), &xdims, dev);
                let y = xt.matmul(&wq.t()).unwrap();
                let mut ydims = lead.clone();
                ydims.push(n);
                assert_eq!(y.dims(), &ydims[..]);
                let got = y.to_f64_vec().unwrap();
                close(&got, if dev.is_gpu() { &want } else { &cpu_want }, 1e-5, &format!("{} {xdims:?} @ [{n}, {k}].t() on {dev}", q.name()));
                // The integer path stays near the exact product too.
                close(&got, &want, 1e-4, &format!("{} {xdims:?} on {dev}, against the exact product", q.name()));
            }
        }
    }
}

#[test]
fn the_matmul_takes_strided_rows_and_fuses_its_epilogue() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(3);
    let q = GgmlType::Q4_1;
    let (n, k) = (40, 64);
    let bytes = random_blocks(&mut rng, q, n, k);
    let w = host_dequantized(q, &bytes, n, k);
    let bias = rng.normals(n);
    for m in [2, 20] {
        // x is the transpose of a [k, m] tensor: rows with stride 1, columns with stride m.
        let xt_data = rng.normals(k * m);
        let rows: Vec<f64> = (0..m * k).map(|o| xt_data[o % k * m + o / k]).collect();
        let mut want = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|e| xt_data[e * m + i] * w[j * k + e]).sum();
                want[i * n + j] = (s + bias[j]).max(0.0);
            }
        }
        let cpu_want: Vec<f64> = cpu_reference(q, &bytes, &w, &rows, m, n, k).iter().enumerate().map(|(o, s)| (s + bias[o % n]).max(0.0)).collect();
        for dev in devices() {
            let wq = QTensor::from_blocks(&bytes, q, &[n, k], dev).unwrap();
            let x = f32_on(xt_data.clone(), &[k, m], dev).t().unwrap();
            let b = f32_on(bias.clone(), &[n], dev);
            let y = x.matmul(&wq.t()).unwrap().add(&b).unwrap().relu().unwrap();
            if dev.is_gpu() {
                // A few rows: the quantized GEMV; a prompt's rows: the weight
                // dequantized, then the dense matmul. Either way bias and
                // relu run in the matmul's stores.
                let kinds: Vec<&str> = voltaic::inspect(&[&y]).into_iter().map(|k| k.kind).collect();
                let want = if m <= 8 { vec!["matmul"] } else { vec!["dequantize", "matmul"] };
                assert_eq!(kinds, want, "m {m}: bias and relu run in the matmul's stores");
            }
            close(&y.to_f64_vec().unwrap(), if dev.is_gpu() { &want } else { &cpu_want }, 1e-5, &format!("relu(x @ w.t() + b), m {m}, on {dev}"));
        }
    }
}

#[test]
fn dequantize_and_embedding_give_the_host_dequantizer_rows() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(5);
    for q in TYPES {
        let per = q.block().0;
        let (n, k) = (9, per * 2);
        let bytes = random_blocks(&mut rng, q, n, k);
        let w = host_dequantized(q, &bytes, n, k);
        for dev in devices() {
            let wq = QTensor::from_blocks(&bytes, q, &[n, k], dev).unwrap();
            let all = wq.dequantize().unwrap();
            assert_eq!(all.dims(), &[n, k]);
            // The same f32 arithmetic in the same order: exact on the CPU; a
            // GPU compiler may fuse a multiply-add.
            let tol = if dev.is_gpu() { 1e-6 } else { 0.0 };
            close(&all.to_f64_vec().unwrap(), &w, tol, &format!("{} dequantize on {dev}", q.name()));
            close(&wq.t().dequantize().unwrap().t().unwrap().to_f64_vec().unwrap(), &w, tol, "dequantize of the transpose");
            let ids = Tensor::from_vec(vec![8i32, 0, 3, 3, 8, 1], &[2, 3], dev).unwrap();
            let e = wq.embedding(&ids).unwrap();
            assert_eq!(e.dims(), &[2, 3, k]);
            let want: Vec<f64> = [8, 0, 3, 3, 8, 1].iter().flat_map(|&r| w[r * k..(r + 1) * k].to_vec()).collect();
            close(&e.to_f64_vec().unwrap(), &want, tol, &format!("{} embedding on {dev}", q.name()));
            let bad = Tensor::from_vec(vec![2i32, 9], &[2], dev).unwrap();
            let err = wq.embedding(&bad).and_then(|t| t.to_f64_vec()).unwrap_err().to_string();
            assert!(err.contains("embedding") && err.contains('9') && err.contains("size 9"), "{err}");
            // The device still works after the reported error.
            close(&wq.embedding(&ids).unwrap().to_f64_vec().unwrap(), &want, tol, "after an error");
        }
    }
}

#[test]
fn quantizers_round_trip_within_their_step() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(11);
    let x: Vec<f32> = rng.normals(64 * 3).into_iter().map(|v| v as f32).collect();
    for (q, step) in [(GgmlType::Q8_0, 1.0 / 127.0), (GgmlType::Q4_0, 1.0 / 8.0), (GgmlType::Q4_1, 1.0 / 15.0)] {
        let bytes = quantize(q, &x).unwrap();
        assert_eq!(bytes.len(), x.len() / 32 * q.block().1);
        let mut back = vec![0f32; x.len()];
        dequantize(q, &bytes, &mut back).unwrap();
        for b in 0..x.len() / 32 {
            let blk = &x[b * 32..(b + 1) * 32];
            let range = blk.iter().fold(0f32, |m, v| m.max(v.abs())) * 2.0;
            for i in 0..32 {
                let e = (back[b * 32 + i] - blk[i]).abs();
                assert!(e <= range * step as f32 * 0.51 + 1e-3, "{} block {b} element {i}: {} -> {}", q.name(), blk[i], back[b * 32 + i]);
            }
        }
    }
    assert!(quantize(GgmlType::Q4K, &x).unwrap_err().to_string().contains("Q4_K"));
    assert!(quantize(GgmlType::Q8_0, &x[..33]).unwrap_err().to_string().contains("33"));
}

#[test]
fn the_input_gradient_flows_through_a_quantized_weight() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(8);
    let q = GgmlType::Q8_0;
    // 20 rows: the CPU's exact (dequantize + gemm) path, so that both
    // gradients see the same forward values (the integer path's rounding,
    // 1e-5, would reach the gradient through tanh').
    let (n, k, m) = (6, 32, 20);
    let bytes = random_blocks(&mut rng, q, n, k);
    for dev in devices() {
        let wq = QTensor::from_blocks(&bytes, q, &[n, k], dev).unwrap();
        let wd = wq.dequantize().unwrap();
        let x0 = f32_on(rng.normals(m * k), &[m, k], dev);
        let x = x0.requires_grad().unwrap();
        x.matmul(&wq.t()).unwrap().tanh().unwrap().sum_all().unwrap().backward().unwrap();
        let g = x.grad().unwrap().to_f64_vec().unwrap();
        let xd = x0.requires_grad().unwrap();
        xd.matmul(&wd.t().unwrap()).unwrap().tanh().unwrap().sum_all().unwrap().backward().unwrap();
        let gd = xd.grad().unwrap().to_f64_vec().unwrap();
        close(&g, &gd, 1e-5, &format!("gradient on {dev}"));
    }
}

#[test]
fn bad_quantized_input_is_an_error_naming_what_is_wrong() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let d = Device::Cpu;
    let e = QTensor::from_blocks(&[0u8; 33], GgmlType::Q8_0, &[1, 32], d).unwrap_err().to_string();
    assert!(e.contains("33 bytes"), "{e}");
    let e = QTensor::from_blocks(&[0u8; 34], GgmlType::Q8_0, &[1, 33], d).unwrap_err().to_string();
    assert!(e.contains("33 elements"), "{e}");
    let e = QTensor::from_blocks(&[0u8; 34], GgmlType::F16, &[1, 17], d).unwrap_err().to_string();
    assert!(e.contains("F16"), "{e}");
    let wq = QTensor::from_blocks(&[0u8; 34], GgmlType::Q8_0, &[1, 32], d).unwrap();
    let x = Tensor::ones(&[2, 32], DType::F32, d).unwrap();
    let e = x.matmul(&wq).unwrap_err().to_string();
    assert!(e.contains("w.t()"), "{e}");
    let e = Tensor::ones(&[2, 31], DType::F32, d).unwrap().matmul(&wq.t()).unwrap_err().to_string();
    assert!(e.contains("[2, 31]") && e.contains("[32, 1]"), "{e}");
    let e = Tensor::ones(&[2, 32], DType::I32, d).unwrap().matmul(&wq.t()).unwrap_err().to_string();
    assert!(e.contains("float"), "{e}");
}

/// Stacked rows multiply as the separate matrices do, for every type, on
/// every device; mismatched types and widths are errors.
#[test]
fn stacked_rows_multiply_as_the_separate_matrices() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(21);
    let k = 256;
    for q in TYPES {
        let rows = [5usize, 3, 7];
        let blocks: Vec<Vec<u8>> = rows.iter().map(|&n| random_blocks(&mut rng, q, n, k)).collect();
        let x = rng.normals(k);
        // The reference: each part dequantized on the host, f64 dot products.
        let mut want = vec![];
        for (b, &n) in blocks.iter().zip(&rows) {
            let mut w = vec![0f32; n * k];
            dequantize(q, b, &mut w).unwrap();
            want.extend((0..n).map(|r| (0..k).map(|c| w[r * k + c] as f64 * x[c]).sum::<f64>()));
        }
        for dev in devices() {
            let parts: Vec<QTensor> = blocks.iter().zip(&rows).map(|(b, &n)| QTensor::from_blocks(b, q, &[n, k], dev).unwrap()).collect();
            let stacked = QTensor::cat_rows(&parts.iter().collect::<Vec<_>>()).unwrap();
            assert_eq!(stacked.dims(), [15, k]);
            assert_eq!(stacked.size_in_bytes(), parts.iter().map(|p| p.size_in_bytes()).sum::<usize>());
            let y = f32_on(x.clone(), &[1, k], dev).matmul(&stacked.t()).unwrap().to_f64_vec().unwrap();
            close(&y, &want, 2e-3, &format!("{} stacked on {dev}", q.name()));
        }
    }
    let d = Device::Cpu;
    let a = QTensor::from_blocks(&random_blocks(&mut rng, GgmlType::Q8_0, 2, 32), GgmlType::Q8_0, &[2, 32], d).unwrap();
    let b = QTensor::from_blocks(&random_blocks(&mut rng, GgmlType::Q4_0, 2, 32), GgmlType::Q4_0, &[2, 32], d).unwrap();
    let c = QTensor::from_blocks(&random_blocks(&mut rng, GgmlType::Q8_0, 2, 64), GgmlType::Q8_0, &[2, 64], d).unwrap();
    for bad in [QTensor::cat_rows(&[&a, &b]), QTensor::cat_rows(&[&a, &c]), QTensor::cat_rows(&[&a.t()]), QTensor::cat_rows(&[])] {
        let e = bad.unwrap_err().to_string();
        assert!(e.contains("cat_rows"), "{e}");
    }
}

/// Whether GEMVs take prologues on `gpu:0`: on hardware adapters, and on a
/// software one only under `VOLTAIC_PROLOGUES=1` or with a hardware
/// adapter's kernels (`VOLTAIC_KERNELS=hardware`; scripts/test.sh runs
/// these tests all three ways on lavapipe).
fn prologues_on_gpu() -> bool {
    match std::env::var("VOLTAIC_PROLOGUES") {
        Ok(v) => v != "0",
        Err(_) => voltaic::backend::adapters()[0].device_type != "Cpu" || std::env::var("VOLTAIC_KERNELS").is_ok_and(|v| v == "hardware"),
    }
}

/// A prologue's constants and its epilogue's are each the kernel's own:
/// `rms_norm(x, eps) @ w.t() * scale` with two (eps, scale) pairs,
/// the second realized from the cached plan of the first with its
/// constants replaced, against f64.
#[test]
fn a_gemv_with_constants_before_and_after_takes_new_values_from_the_plan_cache() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(31);
    let (q, m, n, k) = (GgmlType::Q8_0, 2, 24, 96);
    let bytes = random_blocks(&mut rng, q, n, k);
    let w = host_dequantized(q, &bytes, n, k);
    let (x, g) = (rng.normals(m * k), rng.normals(k));
    for dev in devices() {
        let wq = QTensor::from_blocks(&bytes, q, &[n, k], dev).unwrap();
        for (eps, scale) in [(1e-5, 0.5), (0.3, 2.0)] {
            let mut want = vec![0f64; m * n];
            for i in 0..m {
                let r = &x[i * k..(i + 1) * k];
                let s = (r.iter().map(|v| v * v).sum::<f64>() / k as f64 + eps).sqrt();
                for j in 0..n {
                    want[i * n + j] = (0..k).map(|e| r[e] / s * g[e] * w[j * k + e]).sum::<f64>() * scale;
                }
            }
            let xt = f32_on(x.clone(), &[m, k], dev);
            let normed = xt.mul(xt.sqr().unwrap().mean(&[-1], true).unwrap().add(eps).unwrap().rsqrt().unwrap()).unwrap().mul(f32_on(g.clone(), &[k], dev)).unwrap();
            // (No residual: lavapipe binds three inputs a kernel, and x, g and w take them.
            // `normed` is dropped: a tensor the caller still holds is stored, not fused.)
            let y = normed.matmul(&wq.t()).unwrap().mul(scale).unwrap();
            drop(normed);
            if dev.is_gpu() && prologues_on_gpu() {
                let kinds: Vec<&str> = voltaic::inspect(&[&y]).into_iter().map(|k| k.kind).collect();
                assert_eq!(kinds, vec!["matmul"]);
            }
            let tol = if dev.is_gpu() { 2e-5 } else { 1e-4 };
            close(&y.to_f64_vec().unwrap(), &want, tol, &format!("eps {eps}, scale {scale} on {dev}"));
        }
    }
}

/// Row-wise and elementwise work before a GEMV (an RMS norm, a layer norm,
/// a softmax, SwiGLU's `silu(gate) * up`) runs in the GEMV's loads on the
/// GPU, one kernel with the residual add after it; on every device the
/// result is the f64 product of the f64 prologue. Rows of 160 elements
/// (fewer than a workgroup's threads) and 512 (two strides), 1 to 8 rows,
/// and 20 rows, which take the dense path without a prologue.
#[test]
fn work_before_a_gemv_runs_in_its_loads() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng::new(29);
    type Prologue = fn(&Tensor, &Tensor) -> voltaic::Result<Tensor>;
    // Each case: its name, the operand from `x` [m, width] and `g` [k], and its f64 row.
    let rms: Prologue = |x, g| x.mul(&x.sqr()?.mean(&[-1], true)?.add(1e-5)?.rsqrt()?)?.mul(g);
    let layer: Prologue = |x, g| {
        let c = x.sub(&x.mean(&[-1], true)?)?;
        c.div(&c.sqr()?.mean(&[-1], true)?.add(1e-5)?.sqrt()?)?.mul(g)
    };
    let softmax: Prologue = |x, g| x.softmax(-1)?.mul(g);
    let swiglu: Prologue = |x, _| {
        let k = x.dims()[1] / 2;
        x.narrow(1, 0, k)?.silu()?.mul(&x.narrow(1, k, k)?)
    };
    let f64_rms = |r: &[f64], g: &[f64]| -> Vec<f64> {
        let s = (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64 + 1e-5).sqrt();
        r.iter().zip(g).map(|(v, g)| v / s * g).collect()
    };
    let f64_layer = |r: &[f64], g: &[f64]| -> Vec<f64> {
        let mean = r.iter().sum::<f64>() / r.len() as f64;
        let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / r.len() as f64;
        r.iter().zip(g).map(|(v, g)| (v - mean) / (var + 1e-5).sqrt() * g).collect()
    };
    let f64_softmax = |r: &[f64], g: &[f64]| -> Vec<f64> {
        let mx = r.iter().fold(f64::MIN, |a, &v| a.max(v));
        let s: f64 = r.iter().map(|v| (v - mx).exp()).sum();
        r.iter().zip(g).map(|(v, g)| (v - mx).exp() / s * g).collect()
    };
    let f64_swiglu = |r: &[f64], _: &[f64]| -> Vec<f64> {
        let k = r.len() / 2;
        (0..k).map(|c| r[c] / (1.0 + (-r[c]).exp()) * r[k + c]).collect()
    };
    type Reference = dyn Fn(&[f64], &[f64]) -> Vec<f64>;
    // The layer norm's centred rows are read twice (for the variance and
    // the output), so the kernel that computes them stays; the last rows
    // kernel is the prologue.
    let one: &[&str] = &["matmul"];
    let cases: [(&str, Prologue, &Reference, usize, &[&str]); 4] = [
        ("rms norm", rms, &f64_rms, 1, one),
        ("layer norm", layer, &f64_layer, 1, &["rows", "matmul"]),
        ("softmax", softmax, &f64_softmax, 1, one),
        ("swiglu", swiglu, &f64_swiglu, 2, one),
    ];
    for (q, k) in [(GgmlType::Q4_1, 160), (GgmlType::Q6K, 512)] {
        let n = 24;
        let bytes = random_blocks(&mut rng, q, n, k);
        let w = host_dequantized(q, &bytes, n, k);
        for (name, f, reference, widen, kernels) in &cases {
            for m in [1, 3, 8, 20] {
                let x = rng.normals(m * k * widen);
                let g: Vec<f64> = (0..k).map(|_| rng.range(0.5, 1.5)).collect();
                let res = rng.normals(m * n);
                let mut want = vec![0f64; m * n];
                for i in 0..m {
                    let a = reference(&x[i * k * widen..(i + 1) * k * widen], &g);
                    for j in 0..n {
                        want[i * n + j] = (0..k).map(|e| a[e] * w[j * k + e]).sum::<f64>() + res[i * n + j];
                    }
                }
                for dev in devices() {
                    let wq = QTensor::from_blocks(&bytes, q, &[n, k], dev).unwrap();
                    let xt = f32_on(x.clone(), &[m, k * widen], dev);
                    let y = f(&xt, &f32_on(g.clone(), &[k], dev)).unwrap().matmul(&wq.t()).unwrap().add(f32_on(res.clone(), &[m, n], dev)).unwrap();
                    if dev.is_gpu() && m <= 8 {
                        let kinds: Vec<&str> = voltaic::inspect(&[&y]).into_iter().map(|k| k.kind).collect();
                        if prologues_on_gpu() {
                            assert_eq!(&kinds, kernels, "{name} before a GEMV of {m} rows");
                        } else {
                            assert_eq!((kinds.len(), kinds.last()), (kernels.len() + 1, Some(&"matmul")), "{name} before a GEMV of {m} rows, no prologue: {kinds:?}");
                        }
                    }
                    // The CPU's integer path rounds the activations to 16 bits (see `cpu_reference`).
                    let tol = if dev.is_gpu() { 2e-5 } else { 1e-4 };
                    close(&y.to_f64_vec().unwrap(), &want, tol, &format!("{name} then {} [{m}, {k}] @ [{n}, {k}].t() on {dev}", q.name()));
                }
            }
        }
    }
}
