//! The scaling suite (`voltaic bench --suite scale`): data-parallel training
//! on 1, 2, 4 and 8 of this machine's GPUs (as many as it has) at a fixed
//! batch per GPU, against PyTorch's DistributedDataParallel over NCCL on
//! the same GPUs.
//!
//! Rows, for the MiniLM-sized encoder (AdamW, 32 x 128 tokens per GPU) and
//! the Fashion-MNIST CNN (Adam, 256 images per GPU):
//! - `scale_{encoder,cnn}_g1`: one GPU, no data parallelism (the baseline
//!   both libraries' efficiencies are measured against);
//! - `scale_{encoder,cnn}_gN`: an in-process device group of N GPUs;
//! - `scale_{encoder,cnn}_indepN`: N threads each training a model of its
//!   own on its own GPU, with no gradient exchange: the bound an in-process
//!   group could reach;
//! - `scale_{encoder,cnn}_mpiN`: N MPI ranks, one GPU each (the suite
//!   starts `mpirun -np N` itself when the binary has the `mpi` feature and
//!   `VOLTAIC_MPIRUN`, default `mpirun --bind-to none`, runs).
//!
//! The peer of each row is PyTorch on as many GPUs (one process per GPU
//! under `torch.distributed.run`, DDP with its default buckets; plain
//! PyTorch for one GPU). Every parallel row first checks 3 steps' losses
//! against one device computing the whole global batch. Efficiency is
//! samples/s over N times the one-GPU row's samples/s; `--plot` draws it.

use super::dist::{encoder, encoder_loss, Encoder};
use super::median_ms;
use anyhow::{bail, Context};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use voltaic::distributed::{Collective, DataParallel, DeviceGroup, LocalGroup};
use voltaic::nn::{Forward, Module, Sequential};
use voltaic::optim::{Adam, Optimizer};
use voltaic::{DType, Device, Reduction, Tensor};

const PEER: &str = include_str!("scale_peer.py");
const MODELS: [&str; 2] = ["encoder", "cnn"];

/// Examples per GPU: sequences of 128 tokens for the encoder, images for the CNN.
fn per_gpu(model: &str) -> usize {
    if model == "encoder" {
        32
    } else {
        256
    }
}

/// A fixed global batch of `n` examples on the host (the same on every rank).
fn batch(model: &str, n: usize) -> voltaic::Result<Vec<Tensor>> {
    voltaic::manual_seed(7);
    let y = Tensor::arange(0.0, n as f64, 1.0, DType::I32, Device::Cpu)?.rem(10)?;
    Ok(if model == "encoder" {
        let ids = Tensor::rand(&[n, 128], DType::F32, Device::Cpu)?.mul(30522.0)?.floor()?.to_dtype(DType::I32)?;
        vec![ids, Tensor::ones(&[n, 128], DType::I32, Device::Cpu)?, y]
    } else {
        vec![Tensor::randn(&[n, 1, 28, 28], DType::F32, Device::Cpu)?, y]
    })
}

fn cnn_loss(m: &Sequential, rows: &[Tensor]) -> voltaic::Result<Tensor> {
    m.forward(&rows[0])?.cross_entropy(&rows[1], 0.0, Reduction::Mean)
}

/// One row's measurement: median ms per step and a note.
type Measured = (f64, String);

/// Time `model` on `devices` (one device: a plain training step; several,
/// or an MPI collective: data-parallel steps).
fn measure(model: &str, devices: &[Device], comms: Vec<Arc<dyn Collective>>, runs: usize) -> anyhow::Result<Measured> {
    if model == "encoder" {
        time_model(model, devices, comms, runs, encoder, encoder_opt, encoder_loss)
    } else {
        time_model(model, devices, comms, runs, voltaic::models::classifier::cnn, cnn_opt, cnn_loss)
    }
}

fn encoder_opt(m: &Encoder) -> Box<dyn Optimizer + Send> {
    Box::new(Adam::adamw(m.parameters(), 1e-4))
}

fn cnn_opt(m: &Sequential) -> Box<dyn Optimizer + Send> {
    Box::new(Adam::new(m.parameters(), 1e-3))
}

/// The `indepN` rows: `model` trained on each of `devices` by a thread of
/// its own, all at once and with no gradient exchange. What an in-process
/// group could reach at best: where this falls short of one device's rate,
/// the replicas slow each other down on the host (locks, memory), not in
/// the all-reduce.
fn independent(model: &str, devices: &[Device], runs: usize) -> anyhow::Result<Measured> {
    if model == "encoder" {
        time_independent(model, devices, runs, encoder, encoder_opt, encoder_loss)
    } else {
        time_independent(model, devices, runs, voltaic::models::classifier::cnn, cnn_opt, cnn_loss)
    }
}

fn time_independent<M: Module>(
    model: &str,
    devices: &[Device],
    runs: usize,
    build: impl Fn(Device) -> voltaic::Result<M> + Sync,
    optimizer: impl Fn(&M) -> Box<dyn Optimizer + Send> + Sync,
    loss: impl Fn(&M, &[Tensor]) -> voltaic::Result<Tensor> + Sync,
) -> anyhow::Result<Measured> {
    let per = per_gpu(model);
    let rows = batch(model, per)?;
    let reps = if model == "encoder" { 5 } else { 50 };
    let barrier = std::sync::Barrier::new(devices.len());
    let per_thread: Vec<Vec<f64>> = std::thread::scope(|s| {
        let jobs: Vec<_> = devices
            .iter()
            .map(|&device| {
                let (rows, barrier, build, optimizer, loss) = (&rows, &barrier, &build, &optimizer, &loss);
                s.spawn(move || -> anyhow::Result<Vec<f64>> {
                    let m = build(device)?;
                    let mut opt = optimizer(&m);
                    let mut step = || -> anyhow::Result<()> {
                        let rows: Vec<Tensor> = rows.iter().map(|t| t.to_device(device)).collect::<voltaic::Result<_>>()?;
                        opt.zero_grad();
                        loss(&m, &rows)?.backward()?;
                        opt.step()?;
                        m.realize_state()?;
                        Ok(())
                    };
                    for _ in 0..reps {
                        step()?;
                    }
                    device.synchronize()?;
                    voltaic::backend::finish_tuning();
                    let mut ts = vec![];
                    for _ in 0..runs.max(1) {
                        barrier.wait();
                        let t = std::time::Instant::now();
                        for _ in 0..reps {
                            step()?;
                        }
                        device.synchronize()?;
                        ts.push(t.elapsed().as_secs_f64() * 1e3 / reps as f64);
                    }
                    Ok(ts)
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().map_err(|_| anyhow::anyhow!("a thread panicked"))?).collect::<anyhow::Result<Vec<_>>>()
    })?;
    // Each run lasts as long as its slowest thread.
    let mut slowest: Vec<f64> = (0..runs.max(1)).map(|r| per_thread.iter().map(|t| t[r]).fold(0.0, f64::max)).collect();
    slowest.sort_by(|a, b| a.total_cmp(b));
    let ms = slowest[slowest.len() / 2];
    let n = devices.len();
    Ok((ms, format!("{:.0} samples/s: {n} threads each training its own model on its own device (batch {per}), no gradient exchange", (per * n) as f64 / (ms / 1e3))))
}

/// Losses of `steps` optimizer steps of one device on the whole `rows`.
pub(super) fn one_device_losses<M: Module>(
    device: Device,
    rows: &[Tensor],
    steps: usize,
    build: impl Fn(Device) -> voltaic::Result<M>,
    optimizer: impl Fn(&M) -> Box<dyn Optimizer + Send>,
    loss: impl Fn(&M, &[Tensor]) -> voltaic::Result<Tensor>,
) -> anyhow::Result<Vec<f64>> {
    voltaic::manual_seed(0);
    let m = build(device)?;
    let mut opt = optimizer(&m);
    let rows: Vec<Tensor> = rows.iter().map(|t| t.to_device(device)).collect::<voltaic::Result<_>>()?;
    let mut out = vec![];
    for _ in 0..steps {
        opt.zero_grad();
        let l = loss(&m, &rows)?;
        l.backward()?;
        opt.step()?;
        m.realize_state()?;
        out.push(l.item::<f32>()? as f64);
    }
    Ok(out)
}

/// The largest relative difference between two loss curves.
pub(super) fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs()).fold(0.0, f64::max)
}

fn time_model<M: Module>(
    model: &str,
    devices: &[Device],
    comms: Vec<Arc<dyn Collective>>,
    runs: usize,
    build: impl Fn(Device) -> voltaic::Result<M> + Copy + Sync,
    optimizer: impl Fn(&M) -> Box<dyn Optimizer + Send> + Copy + Sync,
    loss: impl Fn(&M, &[Tensor]) -> voltaic::Result<Tensor> + Sync + Copy,
) -> anyhow::Result<Measured> {
    let world = comms[0].world_size();
    let per = per_gpu(model);
    if world == 1 {
        // The baseline: one device, no gradient synchronisation, steps
        // queued back to back as a training loop runs them (the batch comes
        // from the host every step, as it does for the replicas).
        let (ms, _) = time_independent(model, devices, runs, build, optimizer, loss)?;
        return Ok((ms, format!("{:.0} samples/s on {}, batch {per}, steps queued back to back", per as f64 / (ms / 1e3), devices[0])));
    }
    let global = batch(model, per * world)?;
    // Three steps against one device on the same global batch (rank 0 computes it).
    let want = if comms[0].rank() == 0 { one_device_losses(devices[0], &global, 3, build, optimizer, loss)? } else { vec![] };
    voltaic::manual_seed(0);
    let mut dp = DataParallel::with_collectives(devices, comms, build, optimizer)?;
    let refs: Vec<&Tensor> = global.iter().collect();
    let got: Vec<f64> = (0..3).map(|_| Ok(dp.step(&refs, loss)?.item::<f32>()? as f64)).collect::<voltaic::Result<_>>()?;
    let rel = if want.is_empty() { 0.0 } else { max_rel(&got, &want) };
    // Warm-up: the autotuner finishes with the kernels it chose.
    let warm = if model == "encoder" { 3 } else { 20 };
    for _ in 0..warm {
        dp.step(&refs, loss)?;
    }
    voltaic::backend::finish_tuning();
    let reps = if model == "encoder" { 3 } else { 20 };
    let ms = median_ms(1, runs, || {
        let mut last = None;
        for _ in 0..reps {
            last = Some(dp.step(&refs, loss)?);
        }
        // A step may return before its gradients are summed: the run ends
        // when the last loss is known and every device is done.
        if let Some(l) = last {
            l.item::<f32>()?;
        }
        for d in devices {
            d.synchronize()?;
        }
        Ok(())
    })? / reps as f64;
    let sync = dp.last_sync();
    let (buckets, mb) = (sync[0].buckets, sync[0].bytes as f64 / 1e6);
    let avg = |f: fn(&voltaic::distributed::SyncStats) -> f64| sync.iter().map(f).sum::<f64>() / sync.len() as f64 * 1e3;
    Ok((
        ms,
        format!(
            "{:.0} samples/s over {world} replicas of batch {per}; 3 losses vs one device on the global batch: max relative difference {rel:.1e}; \
             last sync (mean over this process's replicas): {buckets} buckets, {mb:.1} MB, {:.1} ms from backward to summed gradients, \
             {:.1} ms in the all-reduce, {:.1} ms waiting for the device's gradients, {:.1} ms recording backward, {:.1} ms realizing the buckets",
            (per * world) as f64 / (ms / 1e3),
            avg(|s| s.total_seconds),
            avg(|s| s.reduce_seconds),
            avg(|s| s.read_seconds),
            avg(|s| s.backward_seconds),
            avg(|s| s.realize_seconds),
        ),
    ))
}

/// The groups the suite runs on, one per GPU count (1, 2, 4, 8 up to what
/// there is), each opened once: over every hardware GPU, or with
/// `--device` over replicas of that one device (a software adapter or the
/// CPU included), so that the suite can be tried on a machine with one
/// adapter; and whether they are such replicas.
fn groups(args: &super::BenchArgs) -> anyhow::Result<(Vec<DeviceGroup>, bool)> {
    let (all, replicas) = match &args.device {
        Some(d) => (DeviceGroup::replicas(Device::parse(d)?, 2)?, true),
        None => (
            DeviceGroup::gpus().context("the scale suite needs hardware GPUs; pass --device gpu:N to try it with replicas of one adapter")?,
            false,
        ),
    };
    let groups = [1, 2, 4, 8].into_iter().filter(|&n| n <= all.len()).map(|n| DeviceGroup::new(&all.devices()[..n])).collect::<voltaic::Result<_>>()?;
    Ok((groups, replicas))
}

fn models(args: &super::BenchArgs) -> Vec<&'static str> {
    MODELS.iter().copied().filter(|m| args.filter.as_deref().is_none_or(|f| format!("scale_{m}").contains(f) || f.contains(m))).collect()
}

/// Run the suite. Under `mpirun` this process is one rank: it measures the
/// `mpiN` rows and rank 0 prints them as JSON lines.
pub fn run(args: &super::BenchArgs) -> anyhow::Result<()> {
    if crate::parallel::under_mpi() {
        return run_rank(args);
    }
    let (groups, replicas) = groups(args)?;
    let ns: Vec<usize> = groups.iter().map(DeviceGroup::len).collect();
    let models = models(args);
    let peer = if args.no_peer || replicas { HashMap::new() } else { torch_ddp(&models, &ns, args.runs).context("running the PyTorch DDP peer")? };
    let mut rows: Vec<(String, usize, Measured)> = vec![];
    for model in &models {
        for group in &groups {
            let n = group.len();
            let name = format!("scale_{model}_g{n}");
            let m = measure(model, group.devices(), LocalGroup::ranks(n), args.runs).with_context(|| format!("benchmark {name}"))?;
            rows.push((name, n, m));
        }
        for group in groups.iter().filter(|g| g.len() > 1) {
            let n = group.len();
            let name = format!("scale_{model}_indep{n}");
            rows.push((name.clone(), n, independent(model, group.devices(), args.runs).with_context(|| format!("benchmark {name}"))?));
        }
        for &n in ns.iter().filter(|&&n| n > 1 && !replicas) {
            let name = format!("scale_{model}_mpi{n}");
            match mpi_row(model, n, args.runs) {
                Ok(Some(m)) => rows.push((name, n, m)),
                Ok(None) => {}
                Err(e) => eprintln!("{name}: {e:#}"),
            }
        }
    }
    report(args, &rows, &peer)
}

/// One rank of an `mpirun` job: the `mpiN` rows.
fn run_rank(args: &super::BenchArgs) -> anyhow::Result<()> {
    let r = crate::parallel::mpi_rank(args.device.as_deref())?;
    let world = r.comms[0].world_size();
    let lead = r.comms[0].rank() == 0;
    for model in models(args) {
        let name = format!("scale_{model}_mpi{world}");
        let (ms, note) = measure(model, &r.devices, r.comms.clone(), args.runs).with_context(|| format!("benchmark {name} on {}", r.devices[0]))?;
        if lead {
            println!("{}", json!({"name": name, "voltaic_ms": ms, "note": note}));
        }
    }
    Ok(())
}

/// Start `mpirun -np n` on this binary for one model's row; `None` when
/// this build has no MPI or no launcher is found.
fn mpi_row(model: &str, n: usize, runs: usize) -> anyhow::Result<Option<Measured>> {
    if !cfg!(feature = "mpi") {
        return Ok(None);
    }
    // Open MPI binds each of two ranks to one core by default.
    let launcher = std::env::var("VOLTAIC_MPIRUN").unwrap_or_else(|_| "mpirun --bind-to none".into());
    let mut words = launcher.split_whitespace();
    let Some(program) = words.next() else { return Ok(None) };
    let exe = std::env::current_exe()?;
    let out = match std::process::Command::new(program)
        .args(words)
        .args(["-np", &n.to_string()])
        .arg(exe)
        .args(["bench", "--suite", "scale", "--json", "--runs", &runs.to_string(), "--filter", &format!("scale_{model}")])
        .output()
    {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("starting {launcher}")),
    };
    if !out.status.success() {
        bail!("{launcher} -np {n} failed: {}", String::from_utf8_lossy(&out.stderr).lines().rev().take(8).collect::<Vec<_>>().join(" | "));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines() {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
            if let (Some(ms), Some(note)) = (v["voltaic_ms"].as_f64(), v["note"].as_str()) {
                return Ok(Some((ms, note.to_string())));
            }
        }
    }
    bail!("{launcher} -np {n} printed no row: {text}")
}

/// PyTorch on 1..N GPUs: median ms per step, by row name (`scale_M_gN`).
fn torch_ddp(models: &[&str], ns: &[usize], runs: usize) -> anyhow::Result<HashMap<String, f64>> {
    let Some(py) = super::train::python_with_torch() else {
        bail!("no Python with PyTorch found, or pass --no-peer");
    };
    // The peer imports the train suite's models from the file beside it.
    let dir = std::env::temp_dir().join(format!("voltaic-scale-peer-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let script = dir.join("scale_peer.py");
    std::fs::write(&script, PEER)?;
    std::fs::write(dir.join("train_peer.py"), super::train::TORCH_PEER)?;
    let mut out = HashMap::new();
    for &n in ns {
        let mut cmd = std::process::Command::new(&py);
        if n > 1 {
            cmd.args(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", &n.to_string()]);
        }
        // NVLink multicast stays off on shared hosts (a program using it can
        // take the host's GPUs out of service).
        cmd.env("NCCL_NVLS_ENABLE", "0").env("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1").env("NVSHMEM_DISABLE_NVLS", "1");
        let o = cmd.arg(&script).arg(models.join(",")).arg(runs.to_string()).output().with_context(|| format!("starting {py}"))?;
        if !o.status.success() {
            bail!("the DDP peer on {n} GPUs failed: {}", String::from_utf8_lossy(&o.stderr));
        }
        out.extend(super::Peer::parse(&o.stdout, "torch")?.times);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}

/// Print the rows with samples/s and efficiency for both libraries, and
/// draw the efficiency curves when asked.
fn report(args: &super::BenchArgs, rows: &[(String, usize, Measured)], peer: &HashMap<String, f64>) -> anyhow::Result<()> {
    let base = |model: &str, times: &dyn Fn(&str) -> Option<f64>| times(&format!("scale_{model}_g1"));
    let ours = |n: &str| rows.iter().find(|r| r.0 == n).map(|r| r.2 .0);
    let theirs = |n: &str| peer.get(n).copied();
    let mut panels: Vec<crate::plot::Panel> = vec![];
    for model in MODELS {
        let mut series: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
        for (name, n, (ms, note)) in rows.iter().filter(|r| r.0.starts_with(&format!("scale_{model}_"))) {
            let per = per_gpu(model) as f64;
            let eff = |ms: f64, one: Option<f64>| one.map(|one| one / ms);
            let ours_eff = eff(*ms, base(model, &ours));
            // An MPI row's peer is PyTorch on as many GPUs.
            let peer_name = format!("scale_{model}_g{n}");
            let peer_ms = theirs(&peer_name);
            let peer_eff = peer_ms.and_then(|p| eff(p, base(model, &theirs)));
            let engine = if name.contains("_mpi") {
                "Voltaic, MPI ranks"
            } else if name.contains("_indep") {
                "Voltaic, no exchange (bound)"
            } else {
                "Voltaic, device group"
            };
            if let Some(e) = ours_eff {
                series.entry(engine).or_default().push((*n as f64, e));
                // One GPU is every engine's first point.
                for (kind, label) in [("mpi", "Voltaic, MPI ranks"), ("indep", "Voltaic, no exchange (bound)")] {
                    if *n == 1 && rows.iter().any(|r| r.0.starts_with(&format!("scale_{model}_{kind}"))) {
                        series.entry(label).or_default().push((1.0, e));
                    }
                }
            }
            if let (Some(e), true) = (peer_eff, name.contains("_g")) {
                series.entry("PyTorch DDP (NCCL)").or_default().push((*n as f64, e));
            }
            let sps = |ms: f64| *n as f64 * per / (ms / 1e3);
            if args.json {
                println!(
                    "{}",
                    json!({"name": name, "gpus": n, "voltaic_ms": round3(*ms), "samples_per_s": sps(*ms).round(), "efficiency": ours_eff.map(round3),
                           "peer": "torch DDP", "peer_ms": peer_ms.map(round3), "peer_samples_per_s": peer_ms.map(|p| sps(p).round()),
                           "peer_efficiency": peer_eff.map(round3), "efficiency_vs_peer": ours_eff.zip(peer_eff).map(|(a, b)| round3(a / b)),
                           "speedup": peer_ms.map(|p| round3(p / ms)), "note": note})
                );
            } else {
                println!(
                    "{name:<22} {n} GPU  voltaic {ms:>8.2} ms {:>8.0}/s eff {:>5}   ddp {:>8} ms {:>8}/s eff {:>5}   {note}",
                    sps(*ms),
                    ours_eff.map(|e| format!("{e:.2}")).unwrap_or("-".into()),
                    peer_ms.map(|p| format!("{p:.2}")).unwrap_or("-".into()),
                    peer_ms.map(|p| format!("{:.0}", sps(p))).unwrap_or("-".into()),
                    peer_eff.map(|e| format!("{e:.2}")).unwrap_or("-".into()),
                );
            }
        }
        if !series.is_empty() {
            let max_n = rows.iter().map(|r| r.1).max().unwrap_or(1) as f64;
            let mut s: Vec<crate::plot::Series> = series.into_iter().map(|(k, mut v)| {
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                crate::plot::Series { name: k.to_string(), points: v }
            }).collect();
            s.sort_by(|a, b| a.name.cmp(&b.name));
            s.push(crate::plot::Series { name: "ideal".into(), points: vec![(1.0, 1.0), (max_n, 1.0)] });
            panels.push(crate::plot::Panel {
                title: format!("{model}: scaling efficiency, {} per GPU", if model == "encoder" { "32 x 128 tokens" } else { "256 images" }),
                x_label: "GPUs".into(),
                y_label: "samples/s / (GPUs x one GPU's samples/s)".into(),
                series: s,
            });
        }
    }
    if let Some(path) = &args.plot {
        crate::plot::save_png(path, &panels)?;
    }
    Ok(())
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}
