//! The GPU suite: each row checked against a host reference (on an output
//! buffer poisoned first) before it is timed, and PyTorch's timings for the
//! same work on the same GPU.

use super::check;
use anyhow::{bail, ensure, Context};
use std::process::Command;
use std::time::Instant;
use voltaic::{Conv2dOpts, DType, Device, Tensor};

/// Rows of issue 3 first, then the shapes issue 5 adds.
pub const CASES: &[&str] = &[
    "matmul_f32_4096",
    "add_f32_256m",
    "chain10_f32_16m",
    "softmax_rows_8192",
    "sum_f32_256m",
    "conv2d_resnet_block",
    "launch_1000_small",
    "realize_small_graph",
    "cold_start_demo",
    "matmul_f32_4096x4096x4100",
    "bmm_f32_attention",
    "linear_f32_b128",
    "gemv_f32_4096",
    "matmul_f16_4096",
    "layernorm_rows_8192",
    "matmul_bf16_4096",
    "linear_f32_8192x384x384",
    "linear_f32_8192x384x1152",
    "linear_f32_8192x384x1536",
    "linear_f32_8192x1536x384",
];

const TORCH_PEER: &str = include_str!("torch_peer.py");

/// Run the PyTorch side.
pub fn torch_peer(cases: &[&str], runs: usize) -> anyhow::Result<super::Peer> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(TORCH_PEER)
        .arg(cases.join(","))
        .arg(runs.to_string())
        .output()
        .context("starting python3 for the PyTorch peer")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No module named 'torch'") {
            bail!("PyTorch is not installed: the GPU suite's peer needs torch with CUDA (or pass --no-peer)");
        }
        bail!("the PyTorch peer failed: {err}");
    }
    super::Peer::parse(&out.stdout, "torch")
}

/// Median wall time of `f` in ms, as a user sees it: after at least 300 ms
/// of warm-up (GPU clocks drop whenever the device idles), several runs of
/// back-to-back calls, each run ended by a full wait on the device.
pub fn gpu_median_ms(dev: Device, runs: usize, per_call_wait: bool, f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    gpu_median_ms_over(dev, runs, per_call_wait, 0.02, 1000, f)
}

/// As [`gpu_median_ms`], each run lasting about `run_seconds` (at most
/// `max_reps` calls): the train suite's step rows run 0.3 s of steps back
/// to back, as their PyTorch peer does, so that a step longer than 20 ms is
/// not timed alone with the host's recording and the device's work in series.
pub fn gpu_median_ms_over(
    dev: Device,
    runs: usize,
    per_call_wait: bool,
    run_seconds: f64,
    max_reps: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let mut n = 0usize;
    while t0.elapsed().as_secs_f64() < 0.3 || n < 3 {
        f()?;
        if per_call_wait {
            dev.synchronize()?;
        }
        n += 1;
    }
    dev.synchronize()?;
    let per = t0.elapsed().as_secs_f64() / n as f64;
    // Time the kernels the autotuner chose, not the heuristic that served while it measured.
    voltaic::backend::finish_tuning();
    f()?;
    dev.synchronize()?;
    let reps = if per_call_wait { 1 } else { ((run_seconds / per.max(1e-7)) as usize).clamp(1, max_reps) };
    let mut ts = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let s = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        dev.synchronize()?;
        ts.push(s.elapsed().as_secs_f64() * 1e3 / reps as f64);
    }
    ts.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    Ok(ts[ts.len() / 2])
}

/// Fill the pool's buffers for `numel` f32 elements with NaN, so that an
/// output that is not written shows up in the check.
fn poison(dev: Device, numel: usize) -> anyhow::Result<()> {
    let t = Tensor::full(&[numel], f64::NAN, DType::F32, dev)?.contiguous()?;
    t.realize()?;
    dev.synchronize()?;
    Ok(())
}

fn as_f32(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.to_vec::<f32>()?)
}

fn matmul_case(dev: Device, runs: usize, batch: &[usize], m: usize, k: usize, n: usize, dt: DType) -> anyhow::Result<(f64, String)> {
    let mut db = batch.to_vec();
    db.extend([k, n]);
    product_case(dev, runs, batch, m, k, n, Tensor::randn(&db, dt, dev)?)
}

/// `x @ W^T` as a Linear layer runs it: `W` `[n, k]` stored row by row, so
/// the product reads `b` with k contiguous (the shapes of MiniLM's
/// encoder, hidden 384 and feed-forward 1536, for a batch of 64 sequences
/// of 128 tokens).
fn linear_case(dev: Device, runs: usize, m: usize, k: usize, n: usize) -> anyhow::Result<(f64, String)> {
    let w = Tensor::randn(&[n, k], DType::F32, dev)?;
    product_case(dev, runs, &[], m, k, n, w.t()?)
}

fn product_case(dev: Device, runs: usize, batch: &[usize], m: usize, k: usize, n: usize, b: Tensor) -> anyhow::Result<(f64, String)> {
    let (bsz, dt): (usize, DType) = (batch.iter().product(), b.dtype());
    let mut da = batch.to_vec();
    da.extend([m, k]);
    let a = Tensor::randn(&da, dt, dev)?;
    poison(dev, bsz * m * n)?;
    let c = a.matmul(&b)?;
    let tol = if dt == DType::F16 { 2e-2 } else { 1e-4 };
    check::matmul(&as_f32(&a)?, &as_f32(&b)?, &as_f32(&c)?, bsz, m, k, n, tol)?;
    let ms = gpu_median_ms(dev, runs, false, || {
        a.matmul(&b)?.realize()?;
        Ok(())
    })?;
    let tflops = 2.0 * (bsz * m * k * n) as f64 / (ms * 1e9);
    Ok((ms, format!("{tflops:.2} TFLOP/s")))
}

/// bf16 `[n, n] @ [n, n]` with f32 accumulation, on inputs whose rows of A
/// and columns of B span 2^-50..2^50 (far outside f16's range, as bf16
/// values may be): checked against f64 within bf16 rounding.
fn matmul_bf16_case(dev: Device, runs: usize, n: usize) -> anyhow::Result<(f64, String)> {
    let exps = |len: usize| Tensor::from_vec((0..len).map(|i| 2f32.powi((i * 101 / len) as i32 - 50)).collect::<Vec<_>>(), &[len], Device::Cpu);
    let a = Tensor::randn(&[n, n], DType::F32, Device::Cpu)?.mul(&exps(n)?.reshape(&[n as isize, 1])?)?.to_dtype(DType::BF16)?.to_device(dev)?;
    let b = Tensor::randn(&[n, n], DType::F32, Device::Cpu)?.mul(&exps(n)?.reshape(&[1, n as isize])?)?.to_dtype(DType::BF16)?.to_device(dev)?;
    poison(dev, n * n)?;
    let c = a.matmul(&b)?;
    ensure!(c.dtype() == DType::BF16, "bf16 matmul gave {}", c.dtype());
    // Each check point is relative to its own row and column scale.
    check::matmul(&as_f32(&a)?, &as_f32(&b)?, &as_f32(&c)?, 1, n, n, n, 1e-2)?;
    let ms = gpu_median_ms(dev, runs, false, || {
        a.matmul(&b)?.realize()?;
        Ok(())
    })?;
    let tflops = 2.0 * (n * n * n) as f64 / (ms * 1e9);
    Ok((ms, format!("{tflops:.2} TFLOP/s, inputs over 2^-50..2^50")))
}

/// Check then time one case on `dev`; returns (median ms, note).
pub fn run_case(name: &str, dev: Device, runs: usize) -> anyhow::Result<(f64, String)> {
    voltaic::manual_seed(7);
    match name {
        "matmul_f32_4096" => matmul_case(dev, runs, &[], 4096, 4096, 4096, DType::F32),
        "matmul_f32_4096x4096x4100" => matmul_case(dev, runs, &[], 4096, 4100, 4096, DType::F32),
        "bmm_f32_attention" => matmul_case(dev, runs, &[64, 12], 128, 64, 128, DType::F32),
        "linear_f32_b128" => matmul_case(dev, runs, &[], 128, 784, 256, DType::F32),
        "gemv_f32_4096" => matmul_case(dev, runs, &[], 1, 4096, 4096, DType::F32),
        "matmul_f16_4096" => matmul_case(dev, runs, &[], 4096, 4096, 4096, DType::F16),
        "matmul_bf16_4096" => matmul_bf16_case(dev, runs, 4096),
        "linear_f32_8192x384x384" => linear_case(dev, runs, 8192, 384, 384),
        "linear_f32_8192x384x1152" => linear_case(dev, runs, 8192, 384, 1152),
        "linear_f32_8192x384x1536" => linear_case(dev, runs, 8192, 384, 1536),
        "linear_f32_8192x1536x384" => linear_case(dev, runs, 8192, 1536, 384),
        "add_f32_256m" => {
            let n = 1 << 28;
            let a = Tensor::randn(&[n], DType::F32, dev)?;
            let b = Tensor::randn(&[n], DType::F32, dev)?;
            poison(dev, n)?;
            let c = a.add(&b)?;
            for i in [0, 12345, n / 2 + 7, n - 1] {
                let (x, y, z) = (a.narrow(0, i, 1)?.item::<f32>()?, b.narrow(0, i, 1)?.item::<f32>()?, c.narrow(0, i, 1)?.item::<f32>()?);
                ensure!(z == x + y, "add check failed at {i}");
            }
            let ms = gpu_median_ms(dev, runs, false, || {
                a.add(&b)?.realize()?;
                Ok(())
            })?;
            Ok((ms, format!("{:.0} GB/s", 12.0 * n as f64 / (ms * 1e6))))
        }
        "chain10_f32_16m" => {
            let n = 1 << 24;
            let x = Tensor::randn(&[n], DType::F32, dev)?;
            let y = Tensor::randn(&[n], DType::F32, dev)?;
            let chain = check::chain10;
            poison(dev, n)?;
            let got = chain(&x, &y)?.to_vec::<f32>()?;
            check::chain10_values(&x.to_vec::<f32>()?, &y.to_vec::<f32>()?, &got)?;
            let kernels = voltaic::inspect(&[&chain(&x, &y)?]).len();
            let ms = gpu_median_ms(dev, runs, false, || {
                chain(&x, &y)?.realize()?;
                Ok(())
            })?;
            Ok((ms, format!("{kernels} kernel(s), {:.0} GB/s", 12.0 * n as f64 / (ms * 1e6))))
        }
        "softmax_rows_8192" | "layernorm_rows_8192" => {
            let n = 8192;
            let x = Tensor::randn(&[n, n], DType::F32, dev)?;
            let w = Tensor::randn(&[n], DType::F32, dev)?;
            let bias = Tensor::randn(&[n], DType::F32, dev)?;
            let soft = name.starts_with("softmax");
            let f = || if soft { x.softmax(-1) } else { x.layer_norm(&[n], Some(&w), Some(&bias), 1e-5) };
            poison(dev, n * n)?;
            let y = f()?;
            let (wv, bv) = (w.to_vec::<f32>()?, bias.to_vec::<f32>()?);
            for r in [0usize, 4097, n - 1] {
                let row: Vec<f64> = x.narrow(0, r, 1)?.to_vec::<f32>()?.iter().map(|&v| v as f64).collect();
                let got = y.narrow(0, r, 1)?.to_vec::<f32>()?;
                let want = if soft { check::softmax_row(&row) } else { check::layernorm_row(&row, &wv, &bv, 1e-5) };
                check::row_entries(name, r, &got, &want)?;
            }
            let kernels = voltaic::inspect(&[&f()?]).len();
            let ms = gpu_median_ms(dev, runs, false, || {
                f()?.realize()?;
                Ok(())
            })?;
            Ok((ms, format!("{kernels} kernels, {:.0} GB/s (one read, one write)", 8.0 * (n * n) as f64 / (ms * 1e6))))
        }
        "sum_f32_256m" => {
            let n = 1 << 28;
            let x = Tensor::rand(&[n], DType::F32, dev)?;
            let got = x.sum_all()?.item::<f32>()? as f64;
            let mut want = 0.0f64;
            for c in 0..16 {
                want += x.narrow(0, c * (n / 16), n / 16)?.to_vec::<f32>()?.iter().map(|&v| v as f64).sum::<f64>();
            }
            check::sum(got, want)?;
            let ms = gpu_median_ms(dev, runs, false, || {
                x.sum_all()?.realize()?;
                Ok(())
            })?;
            Ok((ms, format!("{:.0} GB/s", 4.0 * n as f64 / (ms * 1e6))))
        }
        "conv2d_resnet_block" => {
            let x = Tensor::randn(&[8, 64, 56, 56], DType::F32, dev)?;
            let w = Tensor::randn(&[64, 64, 3, 3], DType::F32, dev)?;
            let opts = Conv2dOpts { padding: [1, 1], ..Default::default() };
            poison(dev, 8 * 64 * 56 * 56)?;
            let y = x.conv2d(&w, None, opts)?.to_vec::<f32>()?;
            check::conv2d_resnet(&x.to_vec::<f32>()?, &w.to_vec::<f32>()?, &y)?;
            let ms = gpu_median_ms(dev, runs, false, || {
                x.conv2d(&w, None, opts)?.realize()?;
                Ok(())
            })?;
            let tflops = 2.0 * 8.0 * 64.0 * 64.0 * 9.0 * 56.0 * 56.0 / (ms * 1e9);
            Ok((ms, format!("{tflops:.2} TFLOP/s")))
        }
        "launch_1000_small" => {
            let x0 = Tensor::randn(&[1024], DType::F32, dev)?;
            let chain = || -> voltaic::Result<Vec<f32>> {
                let mut x = x0.clone();
                for _ in 0..500 {
                    x = x.mul(1.0001)?.sub(0.0001)?;
                }
                x.to_vec::<f32>()
            };
            let got = chain()?;
            let xv = x0.to_vec::<f32>()?;
            for i in [0usize, 511, 1023] {
                let mut v = xv[i];
                for _ in 0..500 {
                    v = v * 1.0001 - 0.0001;
                }
                ensure!(check::close(got[i] as f64, v as f64, 1e-5, 1e-3), "launch chain check failed at {i}");
            }
            let ms = gpu_median_ms(dev, runs, true, || {
                chain()?;
                Ok(())
            })?;
            Ok((ms, "1000 ops fused into 1 kernel, then one read".into()))
        }
        "cold_start_demo" => super::cold::demo(dev),
        "realize_small_graph" => {
            let a = Tensor::randn(&[1024], DType::F32, dev)?;
            let b = Tensor::randn(&[1024], DType::F32, dev)?;
            let got = a.add(&b)?.to_vec::<f32>()?;
            ensure!(got[5] == a.to_vec::<f32>()?[5] + b.to_vec::<f32>()?[5], "add check failed");
            let mut calls = 0usize;
            let before = voltaic::host_profile();
            let ms = gpu_median_ms(dev, runs, true, || {
                calls += 1;
                a.add(&b)?.to_vec::<f32>()?;
                Ok(())
            })?;
            let host = voltaic::host_profile().since(&before);
            let phases: Vec<String> =
                host.phases().iter().filter(|(_, us)| *us > 0.0).map(|(p, us)| format!("{p} {:.1}", us / calls as f64)).collect();
            Ok((ms, format!("{:.0} us to record, encode, submit, wait and read one kernel; host us: {}", ms * 1e3, phases.join(", "))))
        }
        _ => bail!("unknown case {name}"),
    }
}
