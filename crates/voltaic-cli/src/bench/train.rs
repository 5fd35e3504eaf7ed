//! The training suite, against PyTorch on the same device: Adam steps of
//! the Fashion-MNIST models on a fixed batch (`train_*`, with the host's
//! microseconds per phase of one step), and whole epochs through the loop
//! of `voltaic train` (`epoch_*`) against two PyTorch loops, the idiomatic
//! DataLoader one and the GPU-resident one an expert writes.

use super::gpu::gpu_median_ms_over;
use anyhow::{bail, Context};
use std::collections::HashMap;
use std::process::Command;
use voltaic::nn::{Forward, Module};
use voltaic::optim::{Adam, Optimizer};
use voltaic::{DType, Device, Reduction, Tensor};

pub const CASES: &[&str] = &[
    "train_mlp_b64",
    "train_cnn_b64",
    "train_mlp_b256",
    "train_cnn_b256",
    "epoch_mlp_b64",
    "epoch_cnn_b64",
    "epoch_mlp_b256",
    "epoch_cnn_b256",
    "cold_epoch_cnn_b64",
    "cold_epoch_cnn_b256",
    "encoder_f32",
    "encoder_f16",
    "encoder_bf16",
];

pub(super) const TORCH_PEER: &str = include_str!("train_peer.py");
const EPOCH_PEER: &str = include_str!("epoch_peer.py");

/// A Python with PyTorch: `python3`, else Debian's `/usr/bin/python3` (whose
/// python3-torch is the CPU build that works on these machines).
pub fn python_with_torch() -> Option<String> {
    ["python3", "/usr/bin/python3"].into_iter().map(String::from).find(|p| {
        Command::new(p).args(["-c", "import torch"]).output().map(|o| o.status.success()).unwrap_or(false)
    })
}

/// Run the PyTorch side: median ms per step (`train_*`) or per epoch
/// (`epoch_*`, with the resident loop's time as an extra field).
pub fn torch_peer(cases: &[&str], runs: usize, device: Device) -> anyhow::Result<super::Peer> {
    let threads = rayon::current_num_threads().to_string();
    let (epochs, steps): (Vec<&str>, Vec<&str>) = cases.iter().filter(|c| !c.starts_with("cold_")).partition(|c| c.starts_with("epoch_"));
    let mut peer = super::Peer { name: "torch".into(), times: HashMap::new(), extra: HashMap::new(), info: serde_json::Value::Null };
    if !steps.is_empty() {
        let p = run_torch_peer(TORCH_PEER, &[steps.join(","), runs.to_string(), device.to_string(), threads.clone()])?;
        peer.name = p.name;
        peer.times.extend(p.times);
    }
    if !epochs.is_empty() {
        let data = crate::train::locate_data(None, true)?;
        let p = run_torch_peer(EPOCH_PEER, &[epochs.join(","), epoch_runs(runs).to_string(), device.to_string(), threads, data.display().to_string()])?;
        peer.name = p.name;
        peer.times.extend(p.times);
        peer.extra.extend(p.extra);
    }
    Ok(peer)
}

/// Timed epochs per `epoch_*` row (after one warm-up epoch): at most 3.
fn epoch_runs(runs: usize) -> usize {
    runs.clamp(1, 3)
}

fn run_torch_peer(script: &str, args: &[String]) -> anyhow::Result<super::Peer> {
    let Some(py) = python_with_torch() else {
        bail!("no Python with PyTorch found (on Debian: apt-get install python3-torch), or pass --no-peer");
    };
    let out = Command::new(&py).arg("-c").arg(script).args(args).output().with_context(|| format!("starting {py}"))?;
    if !out.status.success() {
        bail!("the PyTorch peer failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    super::Peer::parse(&out.stdout, "torch")
}

/// Run a PyTorch peer script with the Python that has torch; its name and
/// median ms per case.
pub fn run_torch_script(script: &str, args: &[String]) -> anyhow::Result<(String, HashMap<String, f64>)> {
    let p = run_torch_peer(script, args)?;
    Ok((p.name, p.times))
}

/// Time one case: median ms per step or per epoch, and a note.
pub fn run_case(name: &str, device: Device, runs: usize) -> anyhow::Result<(f64, String)> {
    if name.starts_with("epoch_") {
        return epoch_case(name, device, runs);
    }
    if name.starts_with("cold_epoch_") {
        return super::cold::epoch(name, device);
    }
    if let Some(precision) = name.strip_prefix("encoder_") {
        return encoder_case(precision, device, runs);
    }
    step_case(name, device, runs)
}

/// One epoch of Fashion-MNIST through `voltaic train`'s loop (the dataset
/// on the device when `--data-on-device auto` would keep it there), after a
/// warm-up epoch; evaluation excluded. The note gives the first epoch too.
fn epoch_case(name: &str, device: Device, runs: usize) -> anyhow::Result<(f64, String)> {
    use clap::Parser;
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: crate::train::TrainArgs,
    }
    let batch = name.rsplit("_b").next().context("case name ends in _bN")?;
    let model = if name.starts_with("epoch_mlp") { "mlp" } else { "cnn" };
    let epochs = 1 + epoch_runs(runs);
    let argv = ["train", "--model", model, "--batch-size", batch, "--epochs", &epochs.to_string(), "--quiet", "--device", &device.to_string()];
    let args = Wrap::try_parse_from(argv)?.args;
    let dir = crate::train::locate_data(None, true)?;
    let (train, _) = voltaic::data::fashion_mnist(&dir)?;
    let resident = crate::train::Split::keep_on_device(&args.data_on_device, device, voltaic::data::DeviceDataset::bytes(&train));
    let train = crate::train::Split::new(train, device, resident)?;
    voltaic::manual_seed(0);
    let m = crate::train::build_model(model, device)?;
    let mut opt = crate::train::build_optimizer(&args, &m);
    let progress = crate::train::train_loop(&args, device, &m, opt.as_mut(), &train, None, Default::default(), |_, _| Ok(()))?;
    let secs: Vec<f64> = progress.history.iter().map(|h| h.train_seconds).collect();
    let mut warm = secs[1..].to_vec();
    warm.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let ms = warm[warm.len() / 2] * 1e3;
    let last = progress.history.last().context("an epoch ran")?;
    anyhow::ensure!(last.train_acc > 0.5, "{name}: training accuracy {:.3} after {epochs} epochs", last.train_acc);
    let n = train.len() as f64;
    let place = if resident { "data on the device" } else { "host loader" };
    Ok((ms, format!("{:.0} samples/s, first epoch {:.2} s, {place}", n / (ms / 1e3), secs[0])))
}

/// Median ms of `step`, then the realizations and host microseconds per
/// phase of one step, counted over a few more steps (the timing itself also
/// waits for the autotuner, which the counters would include).
fn time_steps(device: Device, runs: usize, step: &mut dyn FnMut() -> anyhow::Result<()>) -> anyhow::Result<(f64, f64, String)> {
    // As the peer (train_peer.py): runs of about 0.3 s of steps, at most 200.
    let ms = gpu_median_ms_over(device, runs, false, 0.3, 200, &mut *step)?;
    let steps = 3;
    let before = voltaic::host_profile();
    for _ in 0..steps {
        step()?;
    }
    device.synchronize()?;
    let host = voltaic::host_profile().since(&before);
    let phases: Vec<String> =
        host.phases().iter().filter(|(_, us)| *us > 0.0).map(|(p, us)| format!("{p} {:.0}", us / steps as f64)).collect();
    Ok((ms, host.realizations as f64 / steps as f64, phases.join(", ")))
}

/// Time Adam steps on a fixed batch: median ms per step, and the host's
/// microseconds per phase of one step.
fn step_case(name: &str, device: Device, runs: usize) -> anyhow::Result<(f64, String)> {
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
    let (ms, per, phases) = time_steps(device, runs, &mut step)?;
    Ok((ms, format!("{:.0} samples/s; host us/step ({per:.0} realizations): {phases}", batch as f64 / (ms / 1e3))))
}

/// One AdamW step of a MiniLM-sized encoder (6 layers, width 384, 12 heads,
/// feed-forward 1536, BERT's vocabulary) on 32 sequences of 128 random
/// tokens, classifying each by its first token, in f32 or under autocast to
/// f16 (with a GradScaler, which decides on the device whether to step;
/// PyTorch's reads one value back per step) or bf16.
fn encoder_case(precision: &str, device: Device, runs: usize) -> anyhow::Result<(f64, String)> {
    use voltaic::optim::GradScaler;
    let low = crate::train::autocast_type(precision);
    voltaic::manual_seed(0);
    let (batch, seq) = (32usize, 128usize);
    let enc = super::dist::encoder(device)?;
    let (model, head) = (&enc.bert, &enc.head);
    let mut opt = Adam::adamw(enc.parameters(), 1e-4);
    let mut scaler = (low == Some(DType::F16)).then(GradScaler::new);
    let ids = Tensor::rand(&[batch, seq], DType::F32, device)?.mul(30522.0)?.floor()?.to_dtype(DType::I32)?;
    let mask = Tensor::ones(&[batch, seq], DType::I32, device)?;
    let y = Tensor::arange(0.0, batch as f64, 1.0, DType::I32, device)?.rem(10)?;
    let loss_of = || -> voltaic::Result<Tensor> {
        let _a = voltaic::AutocastGuard::new(low);
        let h = model.forward(&ids, &mask)?;
        head.forward(&h.narrow(1, 0, 1)?.squeeze(1)?)?.cross_entropy(&y, 0.0, Reduction::Mean)
    };
    let mut step = || -> anyhow::Result<()> {
        let loss = loss_of()?;
        opt.zero_grad();
        match &mut scaler {
            Some(s) => {
                s.scale(&loss)?.backward()?;
                s.step(&mut opt)?;
                s.update()?;
            }
            None => {
                loss.backward()?;
                opt.step()?;
            }
        }
        model.realize_state()?;
        Ok(())
    };
    // The loss must go down on a fixed batch: the step really trains.
    let first = loss_of()?.to_dtype(DType::F32)?.item::<f32>()?;
    for _ in 0..5 {
        step()?;
    }
    let later = loss_of()?.to_dtype(DType::F32)?.item::<f32>()?;
    anyhow::ensure!(later < first, "encoder_{precision}: the loss did not decrease ({first} -> {later})");
    let (ms, per, phases) = time_steps(device, runs, &mut step)?;
    Ok((ms, format!("{:.0} sequences/s, loss {first:.3} -> {later:.3} in 5 steps; host us/step ({per:.0} realizations): {phases}", batch as f64 / (ms / 1e3))))
}
