//! The CPU suite: the rows of issue 2, each checked against a reference
//! before it is timed, and numpy's timings for the same work.

use super::{check, median_ms};
use anyhow::{bail, Context};
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
            check::matmul(&a.to_vec::<f32>()?, &b.to_vec::<f32>()?, &c, 1, n, n, n, 1e-4)?;
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
            let chain = check::chain10;
            let got = chain(&x, &y)?.to_vec::<f32>()?;
            check::chain10_values(&x.to_vec::<f32>()?, &y.to_vec::<f32>()?, &got)?;
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
                let row: Vec<f64> = xv[r * n..(r + 1) * n].iter().map(|&v| v as f64).collect();
                check::row_entries("softmax", r, &got[r * n..(r + 1) * n], &check::softmax_row(&row))?;
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
            check::sum(got, x.to_vec::<f32>()?.iter().map(|&v| v as f64).sum())?;
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
            check::conv2d_resnet(&x.to_vec::<f32>()?, &w.to_vec::<f32>()?, &y)?;
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
