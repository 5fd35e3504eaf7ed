//! The data-parallel suite (`voltaic bench --suite dist`): the pieces that
//! decide how training scales over GPUs that meet through the host.
//!
//! - `stage_h2d_256mb`, `stage_d2h_256mb`: host-to-device and
//!   device-to-host copies through wgpu's mapped staging buffers, against
//!   PyTorch's pinned-memory `.to()` on the same GPU.
//! - `allreduce_encoder_local2` (two threads) and `allreduce_encoder_mpi`
//!   (the ranks of `mpirun`, built with `--features mpi`): one host
//!   all-reduce of the MiniLM-sized encoder's gradients.
//! - `encoder_step_1`, `encoder_step_group2`, `encoder_step_group2_onebucket`,
//!   `encoder_step_mpi`: AdamW steps of the encoder (6 layers, d 384, 32 x
//!   128 tokens per device) on one device, on two devices opened on the
//!   same adapter, with every gradient in one bucket (no overlap), and
//!   over MPI ranks; each parallel row first checks 5 steps' losses against
//!   one device on the same global batch.

use super::gpu::gpu_median_ms;
use super::median_ms;
use super::scale::max_rel;
use anyhow::{bail, Context};
use serde_json::json;
use std::sync::Arc;
use voltaic::distributed::{Collective, DataParallel, DeviceGroup, LocalGroup};
use voltaic::models::bert::{BertConfig, BertModel};
use voltaic::nn::{Forward, Linear, Module};
use voltaic::optim::{Adam, Optimizer};
use voltaic::{DType, Device, Reduction, Tensor};

pub const CASES: &[&str] = &[
    "stage_h2d_32mb",
    "stage_d2h_32mb",
    "stage_h2d_256mb",
    "stage_d2h_256mb",
    "allreduce_encoder_local2",
    "encoder_step_1",
    "encoder_step_group2",
    "encoder_step_group2_onebucket",
    "allreduce_encoder_mpi",
    "encoder_step_mpi",
];

const PEER: &str = include_str!("dist_peer.py");

/// The MiniLM-sized encoder with a 10-class head on its first token (also
/// the train suite's `encoder_*` rows).
#[derive(Module)]
pub(super) struct Encoder {
    pub bert: BertModel,
    pub head: Linear,
}

/// A randomly initialised [`Encoder`] (the encoder first, then the head).
pub(super) fn encoder(device: Device) -> voltaic::Result<Encoder> {
    let config = BertConfig {
        vocab_size: 30522,
        hidden_size: 384,
        num_hidden_layers: 6,
        num_attention_heads: 12,
        intermediate_size: 1536,
        max_position_embeddings: 512,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_act: "gelu".into(),
    };
    Ok(Encoder { bert: BertModel::new(config, device)?, head: Linear::new(384, 10, true, device)? })
}

pub(super) fn encoder_loss(m: &Encoder, rows: &[Tensor]) -> voltaic::Result<Tensor> {
    let h = m.bert.forward(&rows[0], &rows[1])?;
    m.head.forward(&h.narrow(1, 0, 1)?.squeeze(1)?)?.cross_entropy(&rows[2], 0.0, Reduction::Mean)
}

/// A fixed batch of `n` sequences of 128 random tokens, on the host.
fn batch(n: usize) -> voltaic::Result<Vec<Tensor>> {
    voltaic::manual_seed(7);
    let ids = Tensor::rand(&[n, 128], DType::F32, Device::Cpu)?.mul(30522.0)?.floor()?.to_dtype(DType::I32)?;
    let mask = Tensor::ones(&[n, 128], DType::I32, Device::Cpu)?;
    let y = Tensor::arange(0.0, n as f64, 1.0, DType::I32, Device::Cpu)?.rem(10)?;
    Ok(vec![ids, mask, y])
}

fn adamw(m: &Encoder) -> Box<dyn Optimizer + Send> {
    Box::new(Adam::adamw(m.parameters(), 1e-4))
}

/// Losses of `steps` AdamW steps of one device on the whole `batch`.
fn one_device_losses(device: Device, batch: &[Tensor], steps: usize) -> anyhow::Result<Vec<f64>> {
    super::scale::one_device_losses(device, batch, steps, encoder, adamw, encoder_loss)
}

/// The gradient count of the encoder (what one all-reduce moves).
fn encoder_numel() -> anyhow::Result<usize> {
    let _g = voltaic::NoGradGuard::new();
    Ok(encoder(Device::Cpu)?.parameters().iter().map(|p| p.value().numel()).sum())
}

/// Run the suite: rows as the other suites print them. Under `mpirun` (a
/// build with `--features mpi`) only the `*_mpi` rows run, and rank 0 prints.
pub fn run(args: &super::BenchArgs) -> anyhow::Result<()> {
    let under_mpi = crate::parallel::under_mpi();
    let cases: Vec<&str> = CASES
        .iter()
        .copied()
        .filter(|c| c.ends_with("_mpi") == under_mpi)
        .filter(|c| args.filter.as_deref().is_none_or(|f| c.contains(f)))
        .collect();
    // Under mpirun, each rank's device as `voltaic train --distributed`
    // picks it (the GPU of its local rank).
    let (device, mpi) = if under_mpi {
        let r = crate::parallel::mpi_rank(args.device.as_deref())?;
        (r.devices[0], r.comms.into_iter().next())
    } else {
        (args.device.as_deref().map(Device::parse).transpose()?.unwrap_or_else(Device::best), None)
    };
    if args.device.is_none() && device == Device::Cpu {
        bail!("no hardware GPU found for the dist suite; pass --device gpu:N to use a software adapter");
    }
    let lead = mpi.as_ref().is_none_or(|c| c.rank() == 0);
    let peer = if args.no_peer || !cases.iter().any(|c| c.starts_with("stage_")) { None } else { Some(torch_peer(args.runs).context("running the PyTorch peer")?) };
    for c in &cases {
        let (ms, note) = run_case(c, device, args.runs, mpi.as_ref()).with_context(|| format!("benchmark {c}"))?;
        if !lead {
            continue;
        }
        let peer_ms = peer.as_ref().and_then(|p| p.get(*c)).and_then(|v| v.as_f64());
        let speedup = peer_ms.map(|p| p / ms);
        if args.json {
            println!(
                "{}",
                json!({"name": c, "voltaic_ms": (ms * 1e3).round() / 1e3, "peer": if peer_ms.is_some() { "torch" } else { "none" },
                       "peer_ms": peer_ms, "speedup": speedup, "note": note, "device": device.to_string(),
                       "adapter": adapter_name(device)})
            );
        } else {
            println!(
                "{c:<30} voltaic {ms:>9.3} ms   torch {:>9} ms   speedup {:>6}   {note}",
                peer_ms.map(|p| format!("{p:.3}")).unwrap_or("-".into()),
                speedup.map(|s| format!("{s:.2}x")).unwrap_or("-".into())
            );
        }
    }
    Ok(())
}

fn adapter_name(device: Device) -> String {
    match device {
        Device::Gpu(i) => voltaic::backend::adapters().into_iter().find(|a| a.index == i).map(|a| a.name).unwrap_or_default(),
        Device::Cpu => "cpu".into(),
    }
}

fn torch_peer(runs: usize) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    let Some(py) = super::train::python_with_torch() else {
        bail!("no Python with PyTorch found, or pass --no-peer");
    };
    let out = std::process::Command::new(&py).arg("-c").arg(PEER).arg(runs.to_string()).output()?;
    if !out.status.success() {
        bail!("the PyTorch peer failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("the peer's output")?;
    Ok(v.as_object().cloned().unwrap_or_default())
}

fn run_case(name: &str, device: Device, runs: usize, mpi: Option<&Arc<dyn Collective>>) -> anyhow::Result<(f64, String)> {
    let mb: usize = name.strip_prefix("stage_").and_then(|r| r[4..].strip_suffix("mb")).and_then(|n| n.parse().ok()).unwrap_or(0);
    let bytes = mb << 20;
    match name {
        n if n.starts_with("stage_h2d") => {
            let host: Vec<f32> = (0..bytes / 4).map(|i| i as f32).collect();
            let ms = median_ms(2, runs, || {
                let t = Tensor::from_vec(host.clone(), &[bytes / 4], device)?;
                t.realize()?;
                device.synchronize()?;
                Ok(())
            })?;
            // The clone of the host vector is inside the timing: measure it alone.
            let copy = median_ms(2, runs, || {
                std::hint::black_box(host.clone());
                Ok(())
            })?;
            let ms = (ms - copy).max(1e-6);
            Ok((ms, format!("{:.1} GB/s (queue.write_buffer through wgpu's staging; a host copy of {copy:.1} ms subtracted)", bytes as f64 / ms / 1e6)))
        }
        n if n.starts_with("stage_d2h") => {
            let t = Tensor::rand(&[bytes / 4], DType::F32, device)?;
            t.realize()?;
            device.synchronize()?;
            let ms = median_ms(2, runs, || {
                std::hint::black_box(t.to_vec::<f32>()?);
                Ok(())
            })?;
            Ok((ms, format!("{:.1} GB/s (copy to a mapped buffer, map, copy out to a Vec)", bytes as f64 / ms / 1e6)))
        }
        "allreduce_encoder_local2" => {
            let n = encoder_numel()?;
            let comms = LocalGroup::ranks(2);
            // The buffers live across runs, as the gradients of a training loop do.
            let data: Vec<std::sync::Mutex<Vec<f32>>> = (0..2).map(|r| std::sync::Mutex::new((0..n).map(|i| (i % 97) as f32 * 1e-6 + r as f32).collect())).collect();
            let ms = median_ms(1, runs, || {
                std::thread::scope(|s| {
                    let hs: Vec<_> = comms
                        .iter()
                        .zip(&data)
                        .map(|(c, d)| {
                            s.spawn(move || {
                                let mut v = d.lock().expect("not poisoned");
                                c.all_reduce_sum(&mut v).map(|_| v.len())
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().expect("no panic")).collect::<voltaic::Result<Vec<_>>>()
                })?;
                Ok(())
            })?;
            Ok((ms, format!("{n} f32 ({:.1} MB) summed in place over 2 threads", n as f64 * 4e-6)))
        }
        "allreduce_encoder_mpi" => {
            let c = mpi.context("not under mpirun")?;
            let n = encoder_numel()?;
            let mut v: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 1e-3).collect();
            let ms = median_ms(1, runs, || {
                c.all_reduce_sum(&mut v)?;
                Ok(())
            })?;
            let how = if std::env::var("VOLTAIC_MPI_SHARED").is_ok_and(|v| v == "0") { "MPI_Allreduce" } else { "the collective (shared memory when every rank is on this machine)" };
            Ok((ms, format!("{n} f32 ({:.1} MB) with {how} over {} ranks", n as f64 * 4e-6, c.world_size())))
        }
        "encoder_step_1" => {
            voltaic::manual_seed(0);
            let m = encoder(device)?;
            let mut opt = adamw(&m);
            let rows: Vec<Tensor> = batch(32)?.iter().map(|t| t.to_device(device)).collect::<voltaic::Result<_>>()?;
            let ms = gpu_median_ms(device, runs, false, &mut || {
                opt.zero_grad();
                encoder_loss(&m, &rows)?.backward()?;
                opt.step()?;
                m.realize_state()?;
                Ok(())
            })?;
            Ok((ms, format!("{:.0} sequences/s on one device (batch 32 x 128 tokens, AdamW)", 32.0 / (ms / 1e3))))
        }
        "encoder_step_group2" | "encoder_step_group2_onebucket" | "encoder_step_mpi" => {
            let (devices, comms) = match mpi {
                Some(c) => (vec![device], vec![c.clone()]),
                None => {
                    let g = DeviceGroup::replicas(device, 2)?;
                    (g.devices().to_vec(), LocalGroup::ranks(2))
                }
            };
            let world = comms[0].world_size();
            let global = batch(32 * world)?;
            // Five steps against one device on the same global batch (rank 0 computes it).
            let want = if comms[0].rank() == 0 { one_device_losses(device, &global, 5)? } else { vec![] };
            voltaic::manual_seed(0);
            let mut dp = DataParallel::with_collectives(&devices, comms, encoder, adamw)?;
            if name.ends_with("onebucket") {
                dp.set_bucket_bytes(usize::MAX / 4, usize::MAX / 4);
            }
            let refs: Vec<&Tensor> = global.iter().collect();
            let mut got = vec![];
            for _ in 0..5 {
                got.push(dp.step(&refs, encoder_loss)?.item::<f32>()? as f64);
            }
            let rel = if want.is_empty() { 0.0 } else { max_rel(&got, &want) };
            let ms = median_ms(2, runs, || {
                // The loss is known once the step's gradients are summed.
                dp.step(&refs, encoder_loss)?.item::<f32>()?;
                Ok(())
            })?;
            let s = dp.last_sync()[0];
            Ok((
                ms,
                format!(
                    "{:.0} sequences/s over {world} replicas of batch 32 ({}); 5 losses vs one device on the global batch: max relative difference {rel:.1e} \
                     ({:.4} -> {:.4}); last sync: {} buckets, {:.1} MB, {:.1} ms for backward and the gradient sum (recording, computing, reading back, reducing), \
                     of which {:.1} ms in the all-reduce and {:.1} ms waiting for the device's gradients",
                    (32 * world) as f64 / (ms / 1e3),
                    devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","),
                    got[0],
                    got[4],
                    s.buckets,
                    s.bytes as f64 / 1e6,
                    s.total_seconds * 1e3,
                    s.reduce_seconds * 1e3,
                    s.read_seconds * 1e3
                ),
            ))
        }
        c => bail!("unknown dist case {c}"),
    }
}
