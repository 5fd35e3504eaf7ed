//! `voltaic train --devices A,B,..` (several devices of this process) and
//! `voltaic train --distributed` (one rank of an MPI job): data-parallel
//! training with the same data order, model and optimizer as one device.

use crate::train::{args_lr, evaluate, finish, locate_data, plural, write_checkpoint, EpochStats, Progress, Split, TrainArgs, MEAN, STD};
use anyhow::{bail, Context};
use std::sync::Arc;
use std::time::Instant;
use voltaic::data::{fashion_mnist, DataLoader, LoaderOpts};
use voltaic::distributed::{Collective, DataParallel, DeviceGroup, LocalGroup};
use voltaic::nn::{Forward, Module, Sequential};
use voltaic::optim::{CosineLr, LrSchedule};
use voltaic::{Device, Reduction, Tensor};

/// This process's devices and the collective each speaks through.
pub(crate) struct Replicas {
    pub devices: Vec<Device>,
    pub comms: Vec<Arc<dyn Collective>>,
}

/// `--devices`: a group in this process.
fn local(list: &[String]) -> anyhow::Result<Replicas> {
    let named: Vec<Device> = list.iter().map(|s| Device::parse(s)).collect::<voltaic::Result<_>>()?;
    let group = DeviceGroup::new(&named)?;
    Ok(Replicas { devices: group.devices().to_vec(), comms: LocalGroup::ranks(group.len()) })
}

/// Whether this process was started by `mpirun` (Open MPI or MPICH).
pub(crate) fn under_mpi() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
}

/// `--distributed`: this MPI rank and its device (`--device`, else the
/// hardware GPU of its local rank, else the CPU).
#[cfg(feature = "mpi")]
pub(crate) fn mpi_rank(device: Option<&str>) -> anyhow::Result<Replicas> {
    let comm = Arc::new(voltaic::distributed::MpiCollective::world()?);
    let hardware: Vec<usize> = voltaic::backend::adapters().iter().filter(|a| !a.is_software()).map(|a| a.index).collect();
    let device = match device {
        Some("gpu") | Some("cuda") if !hardware.is_empty() => Device::Gpu(hardware[comm.local_rank() % hardware.len()]),
        None if !hardware.is_empty() => Device::Gpu(hardware[comm.local_rank() % hardware.len()]),
        None => Device::Cpu,
        Some(s) => crate::parse_device(Some(s))?,
    };
    device.stats()?;
    Ok(Replicas { devices: vec![device], comms: vec![comm] })
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn mpi_rank(_device: Option<&str>) -> anyhow::Result<Replicas> {
    bail!(
        "--distributed needs a voltaic built with MPI: install Open MPI (`apt-get install libopenmpi-dev openmpi-bin clang`) and build with \
         `cargo build --release -p voltaic-cli --features mpi`, then run `mpirun -np N target/release/voltaic train --distributed ...`"
    )
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    if args.precision == "f16" {
        bail!("--precision f16 needs dynamic loss scaling, which data-parallel training does not offer yet: use --precision bf16 (or f32)");
    }
    let reps = match &args.devices {
        Some(list) => local(list)?,
        None => mpi_rank(args.device.as_deref())?,
    };
    let comm = reps.comms[0].clone();
    let result = train(&args, reps);
    if let Err(e) = &result {
        if args.distributed && comm.world_size() > 1 {
            // Not leaving the other ranks waiting in a collective.
            comm.abort(&format!("{e:#}"));
        }
    }
    result
}

fn train(args: &TrainArgs, reps: Replicas) -> anyhow::Result<()> {
    let (rank, world) = (reps.comms[0].rank(), reps.comms[0].world_size());
    let lead = rank == 0;
    let quiet = args.quiet || !lead;
    // Rank 0 finds (and, as root, installs) the data before the others
    // look: ranks on one machine would otherwise race for apt's lock.
    // (MPI only: an in-process group is one process.)
    let ranks_apart = args.distributed && world > 1;
    if ranks_apart && !lead {
        reps.comms[0].all_gather(&[0])?;
    }
    let dir = locate_data(args.data.as_deref(), quiet)?;
    if ranks_apart && lead {
        reps.comms[0].all_gather(&[0])?;
    }
    let (mut train, test) = fashion_mnist(&dir).with_context(|| format!("loading Fashion-MNIST from {}", dir.display()))?;
    if let Some(n) = args.limit {
        train = train.take(n);
    }
    let train = Arc::new(train);
    let devices = reps.devices.clone();
    voltaic::manual_seed(args.seed);
    let build = |d: Device| -> voltaic::Result<Sequential> {
        match args.model.as_str() {
            "cnn" => voltaic::models::classifier::cnn(d),
            _ => voltaic::models::classifier::mlp(d),
        }
    };
    let mut dp = DataParallel::with_collectives(&devices, reps.comms, build, |m| crate::train::build_optimizer(args, m))?;
    let where_ = if args.distributed {
        format!("{world} MPI ranks (rank 0 on {})", devices[0])
    } else {
        devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",")
    };
    if lead {
        std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
        voltaic::io::remove_stale_temp_files(&args.out).with_context(|| format!("cleaning {}", args.out.display()))?;
    }
    if !quiet {
        let params: usize = dp.module().parameters().iter().map(|p| p.value().numel()).sum();
        eprintln!(
            "Training {} ({params} parameters) on {} Fashion-MNIST images, data-parallel over {where_}, {}, global batch {}, {} lr {}, {}",
            args.model,
            train.len(),
            plural(args.epochs, "epoch"),
            args.batch_size,
            args.optimizer,
            dp.optimizer().lr(),
            args.precision
        );
    }
    // Only rank 0 evaluates.
    let test = if lead { Some(Split::new(test, devices[0], false)?) } else { None };
    let opts = LoaderOpts { batch_size: args.batch_size, shuffle: true, seed: args.seed, mean: MEAN, std: STD, drop_last: false, device: Device::Cpu };
    let steps_per_epoch = train.len().div_ceil(args.batch_size);
    let schedule = CosineLr { t_max: steps_per_epoch * args.epochs, min_lr: 0.0 };
    let base_lr = args_lr(args);
    let low = crate::train::autocast_type(&args.precision);
    let mut progress = Progress::default();
    for epoch in 1..=args.epochs {
        for i in 0..devices.len() {
            dp.replica(i).expect("a replica per device").train();
        }
        let pb = crate::train::epoch_bar(quiet, steps_per_epoch, epoch, args.epochs);
        let t0 = Instant::now();
        let (mut loss_sum, mut seen) = (0.0, 0usize);
        let (mut window, mut window_seen) = (0.0, 0usize);
        let mut unread: Vec<(Tensor, usize)> = Vec::new();
        for b in DataLoader::new(train.clone(), &opts, epoch as u64)? {
            let b = b?;
            let bs = b.y.numel();
            if args.schedule == "cosine" {
                dp.set_lr(schedule.lr(base_lr, progress.step));
            }
            let loss = {
                let _a = voltaic::AutocastGuard::new(low);
                dp.step(&[&b.x, &b.y], |m, rows| m.forward(&rows[0])?.cross_entropy(&rows[1], 0.0, Reduction::Mean))?
            };
            // Losses are read once per log interval: a read waits for the
            // step's gradients, which the GPU path sums while the next
            // step is recorded.
            unread.push((loss, bs));
            progress.step += 1;
            pb.inc(1);
            if progress.step.is_multiple_of(50) {
                // A failed gradient sum is its own error, not a NaN loss.
                dp.synchronize()?;
                for (loss, bs) in read_losses(&mut unread, progress.step)? {
                    if args.loss_log.is_some() {
                        progress.every_step.push(loss);
                    }
                    loss_sum += loss * bs as f64;
                    window += loss * bs as f64;
                    seen += bs;
                    window_seen += bs;
                }
                let avg = window / window_seen as f64;
                progress.step_losses.push((progress.step as f64 / steps_per_epoch as f64, avg));
                pb.set_message(format!("loss {avg:.4} {:.0} samples/s", seen as f64 / t0.elapsed().as_secs_f64()));
                (window, window_seen) = (0.0, 0);
            }
        }
        dp.synchronize()?;
        for (loss, bs) in read_losses(&mut unread, progress.step)? {
            if args.loss_log.is_some() {
                progress.every_step.push(loss);
            }
            loss_sum += loss * bs as f64;
            seen += bs;
        }
        let secs = t0.elapsed().as_secs_f64();
        pb.finish_and_clear();
        // Every replica holds the same weights: the first one is evaluated.
        let (test_loss, test_acc) = match &test {
            Some(t) => evaluate(dp.module(), t, devices[0], &args.precision)?,
            None => (f64::NAN, f64::NAN),
        };
        progress.epoch = epoch;
        progress.history.push(EpochStats {
            epoch,
            train_loss: loss_sum / seen as f64,
            // Counting correct predictions would need one more reduction per step.
            train_acc: f64::NAN,
            test_loss,
            test_acc,
            train_seconds: secs,
            samples_per_second: seen as f64 / secs,
        });
        if lead {
            if !quiet {
                eprintln!(
                    "epoch {epoch:>2}: train loss {:.4} | test loss {test_loss:.4} acc {:.2}% | {secs:.1} s, {:.0} samples/s",
                    loss_sum / seen as f64,
                    100.0 * test_acc,
                    seen as f64 / secs
                );
            }
            write_checkpoint(&args.out, args, dp.module(), dp.optimizer(), &progress)?;
        }
    }
    if !lead {
        return Ok(());
    }
    if args.json && !args.quiet {
        let sync = dp.last_sync();
        eprintln!(
            "last gradient synchronisation: {} buckets, {:.2} MB, {:.2} ms in all ({:.2} ms reducing, {:.2} ms waiting for the device)",
            sync[0].buckets,
            sync[0].bytes as f64 / 1e6,
            sync[0].total_seconds * 1e3,
            sync[0].reduce_seconds * 1e3,
            sync[0].read_seconds * 1e3
        );
    }
    finish(args, &progress, &where_, devices[0])
}

/// Read the losses of the steps since the last read (one read for all of
/// them), each with its batch size; `step` is the number of the last one.
/// A loss that is not finite is an error naming its step.
fn read_losses(unread: &mut Vec<(Tensor, usize)>, step: usize) -> anyhow::Result<Vec<(f64, usize)>> {
    if unread.is_empty() {
        return Ok(Vec::new());
    }
    let losses: Vec<(Tensor, usize)> = std::mem::take(unread);
    let refs: Vec<&Tensor> = losses.iter().map(|(l, _)| l).collect();
    let values = Tensor::stack(&refs, 0)?.to_f64_vec()?;
    let first = step + 1 - losses.len();
    let mut out = Vec::with_capacity(values.len());
    for (i, (v, (_, bs))) in values.into_iter().zip(&losses).enumerate() {
        if !v.is_finite() {
            bail!("the training loss became {v} at step {}: lower --lr", first + i);
        }
        out.push((v, *bs));
    }
    Ok(out)
}
