//! The training suite: Adam steps of the Fashion-MNIST models on a fixed
//! batch, in samples per second, against PyTorch on the same device.

use super::gpu::gpu_median_ms;
use anyhow::{bail, Context};
use std::collections::HashMap;
use std::process::Command;
use voltaic::nn::{Forward, Module};
use voltaic::optim::{Adam, Optimizer};
use voltaic::{DType, Device, Reduction, Tensor};

pub const CASES: &[&str] = &["train_mlp_b64", "train_cnn_b64", "train_mlp_b256", "train_cnn_b256"];

const TORCH_PEER: &str = include_str!("train_peer.py");

/// A Python with PyTorch: `python3`, else Debian's `/usr/bin/python3` (whose
/// python3-torch is the CPU build that works on these machines).
pub fn python_with_torch() -> Option<String> {
    ["python3", "/usr/bin/python3"].into_iter().map(String::from).find(|p| {
        Command::new(p).args(["-c", "import torch"]).output().map(|o| o.status.success()).unwrap_or(false)
    })
}

/// Run the PyTorch side: its name and median ms per step, per case.
pub fn torch_peer(cases: &[&str], runs: usize, device: Device) -> anyhow::Result<(String, HashMap<String, f64>)> {
    run_torch_script(TORCH_PEER, &[cases.join(","), runs.to_string(), device.to_string(), rayon::current_num_threads().to_string()])
}

/// Run a PyTorch peer script with the Python that has torch; its name and
/// median ms per case.
pub fn run_torch_script(script: &str, args: &[String]) -> anyhow::Result<(String, HashMap<String, f64>)> {
    let Some(py) = python_with_torch() else {
        bail!("no Python with PyTorch found (on Debian: apt-get install python3-torch), or pass --no-peer");
    };
    let out = Command::new(&py).arg("-c").arg(script).args(args).output().with_context(|| format!("starting {py}"))?;
    if !out.status.success() {
        bail!("the PyTorch peer failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let peer = super::Peer::parse(&out.stdout, "torch")?;
    Ok((peer.name, peer.times))
}

/// Time Adam steps of one case; returns (median ms per step, note).
pub fn run_case(name: &str, device: Device, runs: usize) -> anyhow::Result<(f64, String)> {
    let batch: usize = name.rsplit("_b").next().and_then(|b| b.parse().ok()).context("case name ends in _bN")?;
    voltaic::manual_seed(0);
    let model = if name.starts_with("train_mlp") {
        voltaic::models::classifier::mlp(device)?
    } else {
        voltaic::models::classifier::cnn(device)?
    };
    let mut opt = Adam::new(model.parameters(), 1e-3);
    let x = Tensor::randn(&[batch, 1, 28, 28], DType::F32, device)?;
    let y = Tensor::arange(0.0, batch as f64, 1.0, DType::I32, device)?.rem(10)?;
    let mut step = || -> anyhow::Result<()> {
        let loss = model.forward(&x)?.cross_entropy(&y, 0.0, Reduction::Mean)?;
        opt.zero_grad();
        loss.backward()?;
        opt.step()?;
        Ok(())
    };
    // The loss must go down on a fixed batch: the step really trains.
    let first = model.forward(&x)?.cross_entropy(&y, 0.0, Reduction::Mean)?.item::<f32>()?;
    for _ in 0..5 {
        step()?;
    }
    let later = model.forward(&x)?.cross_entropy(&y, 0.0, Reduction::Mean)?.item::<f32>()?;
    anyhow::ensure!(later < first, "{name}: the loss did not decrease ({first} -> {later})");
    let ms = gpu_median_ms(device, runs, false, step)?;
    Ok((ms, format!("{:.0} samples/s", batch as f64 / (ms / 1e3))))
}
