//! The CPU suite: the rows of issue 2, each checked against a reference
//! before it is timed, and numpy's timings for the same work.

use super::median_ms;
use anyhow::{bail, ensure, Context};
use std::collections::HashMap;
use std::process::Command;
use voltaic::{Conv2dOpts, DType, Device, Tensor};

pub const CASES: &[&str] =
    &["matmul_f32_1024", "chain10_f32_16m", "softmax_rows_4096", "sum_f32_64m", "conv2d_resnet_block"];

const NUMPY_PEER: &str = include_str!("numpy_peer.py");

/// Run the numpy side: returns the peer's name and its median ms per case.
pub fn numpy_peer(cases: &[&str], runs: usize) -> anyhow::Result<(String, HashMap<String, f64>)> {
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(NUMPY_PEER).arg(cases.join(",")).arg(runs.to_string());
    // This workplace sets these for old OpenBLAS builds; they slow a current numpy down.
    cmd.env_remove("OPENBLAS_CORETYPE").env_remove("OPENBLAS_L2_SIZE");
    let out = cmd.output().context("starting python3 (install it, with `pip install numpy`)")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No module named 'numpy'") {
            bail!("numpy is not installed: run `python3 -m pip install numpy`, or pass --no-peer");
        }
        bail!("the numpy peer failed: {err}");
    }
    let peer = super::Peer::parse(&out.stdout, "numpy")?;
    Ok((peer.name, peer.times))
}

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * (1.0 + want.abs())
}

/// Check then time one case; returns (median ms, note).
pub fn run_case(name: &str, runs: usize) -> anyhow::Result<(f64, String)> {
    let dev = Device::Cpu;
    voltaic::manual_seed(7);
    match name {
        "matmul_f32_1024" => {
            let n = 1024;
            let a = Tensor::randn(&[n, n], DType::F32, dev)?;
            let b = Tensor::randn(&[n, n], DType::F32, dev)?;
            let c = a.matmul(&b)?.to_vec::<f32>()?;
            let (av, bv) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
            for &(i, j) in &[(0, 0), (17, 1000), (1023, 5), (511, 511)] {
                let want: f64 = (0..n).map(|k| av[i * n + k] as f64 * bv[k * n + j] as f64).sum();
                ensure!(close(c[i * n + j] as f64, want, 1e-4), "matmul check failed at ({i},{j})");
            }
            let ms = median_ms(2, runs, || {
                a.matmul(&b)?.realize()?;
                Ok(())
            })?;
            let gflops = 2.0 * (n as f64).powi(3) / (ms * 1e6);
            Ok((ms, format!("{gflops:.1} GFLOP/s")))
        }
        "chain10_f32_16m" => {
            let n = 1 << 24;
            let x = Tensor::randn(&[n], DType::F32, dev)?;
            let y = Tensor::randn(&[n], DType::F32, dev)?;
            let chain = |x: &Tensor, y: &Tensor| -> voltaic::Result<Tensor> {
                x.mul(2.0)?.add(1.0)?.relu()?.sub(y)?.abs()?.sqrt()?.mul(y)?.add(3.0)?.mul(0.5)?.sub(y)
            };
            let got = chain(&x, &y)?.to_vec::<f32>()?;
            let (xv, yv) = (x.to_vec::<f32>()?, y.to_vec::<f32>()?);
            for i in (0..n).step_by(9973) {
                let (x, y) = (xv[i], yv[i]);
                let want = ((((x * 2.0 + 1.0).max(0.0) - y).abs().sqrt() * y) + 3.0) * 0.5 - y;
                ensure!(close(got[i] as f64, want as f64, 1e-5), "chain check failed at {i}");
            }
            let kernels = voltaic::inspect(&[&chain(&x, &y)?]).len();
            let ms = median_ms(2, runs, || {
                chain(&x, &y)?.realize()?;
                Ok(())
            })?;
            Ok((ms, format!("{kernels} kernel(s), {:.1} GB/s", 3.0 * 4.0 * n as f64 / (ms * 1e6))))
        }
        "softmax_rows_4096" => {
            let n = 4096;
            let x = Tensor::randn(&[n, n], DType::F32, dev)?;
            let s = x.softmax(-1)?;
            let got = s.to_vec::<f32>()?;
            let xv = x.to_vec::<f32>()?;
            for &r in &[0usize, 1234, 4095] {
                let row = &xv[r * n..(r + 1) * n];
                let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
                let z: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
                for c in [0usize, 77, 4095] {
                    ensure!(close(got[r * n + c] as f64, (row[c] as f64 - m).exp() / z, 1e-4), "softmax check failed");
                }
            }
            let kernels = voltaic::inspect(&[&x.softmax(-1)?]).len();
            let ms = median_ms(2, runs, || {
                x.softmax(-1)?.realize()?;
                Ok(())
            })?;
            Ok((ms, format!("{kernels} kernels")))
        }
        "sum_f32_64m" => {
            let n = 1 << 26;
            let x = Tensor::rand(&[n], DType::F32, dev)?;
            let got = x.sum_all()?.item::<f32>()? as f64;
            let want: f64 = x.to_vec::<f32>()?.iter().map(|&v| v as f64).sum();
            ensure!(close(got, want, 1e-5), "sum check failed: {got} vs {want}");
            let ms = median_ms(2, runs, || {
                x.sum_all()?.realize()?;
                Ok(())
            })?;
            Ok((ms, format!("{:.1} GB/s", 4.0 * n as f64 / (ms * 1e6))))
        }
        "conv2d_resnet_block" => {
            let x = Tensor::randn(&[8, 64, 56, 56], DType::F32, dev)?;
            let w = Tensor::randn(&[64, 64, 3, 3], DType::F32, dev)?;
            let opts = Conv2dOpts { padding: [1, 1], ..Default::default() };
            let y = x.conv2d(&w, None, opts)?.to_vec::<f32>()?;
            let (xv, wv) = (x.to_vec::<f32>()?, w.to_vec::<f32>()?);
            for &(n, co, i, j) in &[(0usize, 0usize, 0usize, 0usize), (7, 63, 55, 55), (3, 17, 20, 31)] {
                let mut want = 0.0f64;
                for ci in 0..64 {
                    for ki in 0..3 {
                        for kj in 0..3 {
                            let (yy, xx) = (i as isize + ki as isize - 1, j as isize + kj as isize - 1);
                            if (0..56).contains(&yy) && (0..56).contains(&xx) {
                                want += xv[((n * 64 + ci) * 56 + yy as usize) * 56 + xx as usize] as f64
                                    * wv[((co * 64 + ci) * 3 + ki) * 3 + kj] as f64;
                            }
                        }
                    }
                }
                ensure!(close(y[((n * 64 + co) * 56 + i) * 56 + j] as f64, want, 1e-4), "conv2d check failed");
            }
            let ms = median_ms(1, runs, || {
                x.conv2d(&w, None, opts)?.realize()?;
                Ok(())
            })?;
            let gflops = 2.0 * 8.0 * 64.0 * 64.0 * 9.0 * 56.0 * 56.0 / (ms * 1e6);
            Ok((ms, format!("{gflops:.1} GFLOP/s")))
        }
        _ => bail!("unknown case {name}"),
    }
}
