//! Data-parallel training in one process (`distributed::DataParallel` over
//! a `DeviceGroup`) against one device on the same global batches: per-step
//! losses equal to 1e-5 relative for 50 steps of Fashion-MNIST, on the CPU
//! and on two wgpu devices opened on one adapter; uneven splits, bucket
//! sizes, model disagreement and failing replicas.

use std::sync::Arc;
use std::time::{Duration, Instant};
use voltaic::data::{fashion_mnist, DataLoader, Dataset, LoaderOpts, FASHION_MNIST_DIR, FASHION_MNIST_MEAN, FASHION_MNIST_STD};
use voltaic::distributed::{Collective, DataParallel, DeviceGroup, DistributedDataParallel, LocalGroup};
use voltaic::models::classifier::{cnn, mlp};
use voltaic::nn::{Forward, Module, Sequential};
use voltaic::optim::{Adam, Optimizer, Sgd};
use voltaic::{DType, Device, Error, Reduction, Result, Tensor};

/// The tests seed and draw from the one process-wide generator (model
/// initialisation): they take turns, or their draws would interleave.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn gpu_index() -> usize {
    std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0)
}

fn gpu() -> Device {
    assert!(
        !voltaic::backend::adapters().is_empty(),
        "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)"
    );
    Device::Gpu(gpu_index())
}

fn data(n: usize) -> Arc<Dataset> {
    let (train, _) = fashion_mnist(FASHION_MNIST_DIR).expect("Fashion-MNIST (apt-get install dataset-fashion-mnist)");
    Arc::new(train.take(n))
}

/// The first `steps` shuffled batches of `batch` examples, on the host.
fn batches(train: &Arc<Dataset>, batch: usize, steps: usize) -> Vec<(Tensor, Tensor)> {
    let opts = LoaderOpts { batch_size: batch, shuffle: true, seed: 5, mean: FASHION_MNIST_MEAN, std: FASHION_MNIST_STD, drop_last: false, device: Device::Cpu };
    DataLoader::new(train.clone(), &opts, 1).unwrap().take(steps).map(|b| b.map(|b| (b.x, b.y)).unwrap()).collect()
}

type Build = fn(Device) -> Result<Sequential>;

fn ce(m: &Sequential, rows: &[Tensor]) -> Result<Tensor> {
    m.forward(&rows[0])?.cross_entropy(&rows[1], 0.0, Reduction::Mean)
}

/// Per-step losses of one device on the whole batches.
fn one_device(build: Build, device: Device, batches: &[(Tensor, Tensor)], adam: bool) -> Vec<f64> {
    voltaic::manual_seed(11);
    let m = build(device).unwrap();
    let mut opt: Box<dyn Optimizer> = if adam { Box::new(Adam::new(m.parameters(), 1e-3)) } else { Box::new(Sgd::new(m.parameters(), 0.05).with_momentum(0.9, false)) };
    batches
        .iter()
        .map(|(x, y)| {
            opt.zero_grad();
            let loss = ce(&m, &[x.to_device(device).unwrap(), y.to_device(device).unwrap()]).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            loss.item::<f32>().unwrap() as f64
        })
        .collect()
}

fn data_parallel(build: Build, group: &DeviceGroup, adam: bool) -> DataParallel<Sequential> {
    voltaic::manual_seed(11);
    DataParallel::new(group, build, |m| -> Box<dyn Optimizer + Send> {
        if adam {
            Box::new(Adam::new(m.parameters(), 1e-3))
        } else {
            Box::new(Sgd::new(m.parameters(), 0.05).with_momentum(0.9, false))
        }
    })
    .unwrap()
}

fn parallel_losses(dp: &mut DataParallel<Sequential>, batches: &[(Tensor, Tensor)]) -> Vec<f64> {
    batches.iter().map(|(x, y)| dp.step(&[x, y], ce).unwrap().item::<f32>().unwrap() as f64).collect()
}

fn assert_same_losses(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g - w).abs() / w.abs().max(1e-12);
        assert!(rel <= 1e-5, "{what}: step {} loss {g} against one device's {w} (relative {rel:.2e})", i + 1);
    }
    // Training happened: the losses moved.
    assert!(want.last().unwrap() < &(want[0] * 0.8), "{what}: the loss did not fall ({} -> {})", want[0], want.last().unwrap());
}

/// Every replica ends with the same weights as each other.
fn assert_replicas_agree(dp: &DataParallel<Sequential>, n: usize) {
    let first: Vec<Vec<f32>> = dp.module().parameters().iter().map(|p| p.value().to_device(Device::Cpu).unwrap().to_vec::<f32>().unwrap()).collect();
    for i in 1..n {
        let other: Vec<Vec<f32>> = dp.replica(i).unwrap().parameters().iter().map(|p| p.value().to_device(Device::Cpu).unwrap().to_vec::<f32>().unwrap()).collect();
        assert_eq!(first, other, "replica {i} differs from replica 0");
    }
}

#[test]
fn two_cpu_replicas_match_one_cpu_for_50_steps() {
    let _turn = turn();
    let train = data(64 * 50);
    let b = batches(&train, 64, 50);
    for (build, adam, name) in [(mlp as Build, true, "mlp, adam"), (cnn as Build, false, "cnn, sgd")] {
        let b = if name.starts_with("cnn") { &b[..20] } else { &b[..] };
        let want = one_device(build, Device::Cpu, b, adam);
        let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu]).unwrap();
        let mut dp = data_parallel(build, &group, adam);
        assert_same_losses(&parallel_losses(&mut dp, b), &want, name);
        assert_replicas_agree(&dp, 2);
    }
}

#[test]
fn two_devices_on_one_gpu_adapter_match_one_device_for_50_steps() {
    let _turn = turn();
    let g = gpu();
    let group = DeviceGroup::replicas(g, 2).unwrap();
    assert_eq!(group.devices()[0], g);
    assert_ne!(group.devices()[1], g, "the second replica is a device of its own");
    let train = data(64 * 50);
    let b = batches(&train, 64, 50);
    let want = one_device(mlp, g, &b, true);
    let mut dp = data_parallel(mlp, &group, true);
    assert_same_losses(&parallel_losses(&mut dp, &b), &want, "mlp on two devices of one adapter");
    dp.synchronize().unwrap();
    assert_replicas_agree(&dp, 2);
    // Each replica computed on its own device.
    for (i, d) in group.devices().iter().enumerate() {
        assert_eq!(dp.replica(i).unwrap().parameters()[0].value().device(), *d);
        assert!(d.stats().unwrap().dispatches > 0, "{d} ran nothing");
    }
}

/// Two replicas given the same wgpu device (through `with_collectives`,
/// which does not open a device per replica) share its command batches:
/// they sum on their own threads (one's held-back work would hold the
/// other's reads) and still train as one device does.
#[test]
fn two_replicas_on_one_wgpu_device_train_without_stalling() {
    let _turn = turn();
    let g = gpu();
    let train = data(64 * 6);
    let b = batches(&train, 64, 6);
    let want = one_device(mlp, g, &b, true);
    voltaic::manual_seed(11);
    let mut dp = DataParallel::with_collectives(&[g, g], LocalGroup::ranks(2), mlp, |m| -> Box<dyn Optimizer + Send> { Box::new(Adam::new(m.parameters(), 1e-3)) }).unwrap();
    let start = Instant::now();
    assert_same_losses(&parallel_losses(&mut dp, &b), &want, "mlp, two replicas on one wgpu device");
    dp.synchronize().unwrap();
    assert!(start.elapsed() < Duration::from_secs(60), "{:?}", start.elapsed());
}

/// On two devices of a GPU adapter: small buckets send the large
/// gradients in pieces (read back, summed and uploaded one after another,
/// then joined), with the same losses as whole buckets.
#[test]
fn gradients_in_pieces_on_a_gpu_match_whole_buckets() {
    let _turn = turn();
    let group = DeviceGroup::replicas(gpu(), 2).unwrap();
    let train = data(64 * 6);
    let b = batches(&train, 64, 6);
    let mut whole = data_parallel(mlp, &group, true);
    let want = parallel_losses(&mut whole, &b);
    let mut cut = data_parallel(mlp, &group, true);
    // Pieces of at most 16,384 values: 784x256 in 13, 256x128 in 2.
    cut.set_bucket_bytes(64 << 10, 128 << 10);
    let got = parallel_losses(&mut cut, &b);
    assert_eq!(cut.last_sync()[0].buckets, 13 + 2 + 2, "{:?}", cut.last_sync()[0]);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-6 * w.abs(), "step {}: {g} in pieces against {w} whole", i + 1);
    }
    assert!(want[5] < want[0], "the loss did not fall: {want:?}");
    assert_replicas_agree(&cut, 2);
}

#[test]
fn uneven_splits_and_a_replica_with_no_rows_still_match() {
    let _turn = turn();
    // 50 examples over 3 replicas (17, 17, 16) and a last batch of 2 over 3
    // (one replica gets no rows, yet takes part in the reduction).
    let train = data(52);
    let b = batches(&train, 50, 2);
    assert_eq!(b[1].0.dims()[0], 2);
    let want = one_device(mlp, Device::Cpu, &b, true);
    let group = DeviceGroup::replicas(Device::Cpu, 3).unwrap();
    let mut dp = data_parallel(mlp, &group, true);
    let got = parallel_losses(&mut dp, &b);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * w.abs(), "{g} vs {w}");
    }
    assert_replicas_agree(&dp, 3);
}

#[test]
fn bucket_sizes_do_not_change_the_sums() {
    let _turn = turn();
    // One bucket per tensor and one bucket for everything reduce the same
    // numbers element by element: the results are equal to the bit.
    let train = data(32 * 6);
    let b = batches(&train, 32, 6);
    let run = |first: usize, rest: usize| -> (Vec<f64>, Vec<usize>) {
        voltaic::manual_seed(3);
        let comms = LocalGroup::ranks(2);
        let models: Vec<Sequential> = (0..2).map(|_| mlp(Device::Cpu).unwrap()).collect();
        let ddps: Vec<DistributedDataParallel<Sequential>> = std::thread::scope(|s| {
            let hs: Vec<_> = models.into_iter().zip(comms).map(|(m, c)| s.spawn(move || DistributedDataParallel::new(m, c).unwrap().with_bucket_bytes(first, rest))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut opts: Vec<Adam> = ddps.iter().map(|d| Adam::new(d.module().parameters(), 1e-3)).collect();
        let mut losses = vec![];
        for (x, y) in &b {
            let out: Vec<f64> = std::thread::scope(|s| {
                let hs: Vec<_> = ddps
                    .iter()
                    .zip(opts.iter_mut())
                    .enumerate()
                    .map(|(r, (d, o))| {
                        s.spawn(move || {
                            o.zero_grad();
                            let rows = [x.narrow(0, r * 16, 16).unwrap(), y.narrow(0, r * 16, 16).unwrap()];
                            let l = d.backward(&ce(d.module(), &rows).unwrap(), 0.5).unwrap();
                            o.step().unwrap();
                            l.item::<f32>().unwrap() as f64
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(out[0].to_bits(), out[1].to_bits());
            losses.push(out[0]);
        }
        (losses, vec![ddps[0].last_sync().buckets])
    };
    let (one, nb1) = run(usize::MAX / 4, usize::MAX / 4);
    let (many, nb2) = run(4, 4);
    assert_eq!(nb1, vec![1]);
    // 6 parameter tensors, one bucket each; those above 1,024 values in
    // pieces of 1,024: 784x256 in 196, 256x128 in 32, 128x10 in 2.
    assert_eq!(nb2, vec![196 + 1 + 32 + 1 + 2 + 1], "mlp's tensors, the large ones in pieces");
    assert_eq!(one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), many.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
}

#[test]
fn replicas_start_from_the_first_ones_parameters() {
    let _turn = turn();
    let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu, Device::Cpu]).unwrap();
    voltaic::manual_seed(1);
    let dp = DataParallel::new(&group, mlp, |m| Box::new(Sgd::new(m.parameters(), 0.1))).unwrap();
    voltaic::manual_seed(1);
    let alone = mlp(Device::Cpu).unwrap();
    for i in 0..3 {
        for (p, q) in dp.replica(i).unwrap().parameters().iter().zip(alone.parameters()) {
            assert_eq!(p.value().to_vec::<f32>().unwrap(), q.value().to_vec::<f32>().unwrap());
        }
    }
}

#[test]
fn replicas_that_disagree_on_the_model_are_refused() {
    let _turn = turn();
    let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu]).unwrap();
    let which = std::sync::atomic::AtomicUsize::new(0);
    let r = DataParallel::new(
        &group,
        |d| if which.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 { mlp(d) } else { cnn(d) },
        |m| Box::new(Sgd::new(m.parameters(), 0.1)),
    );
    let e = r.err().expect("different models must be refused").to_string();
    assert!(e.contains("ranks disagree on the model") && e.contains("rank 1"), "{e}");
}

#[test]
fn bad_batches_are_clear_errors() {
    let _turn = turn();
    let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu]).unwrap();
    let mut dp = DataParallel::new(&group, mlp, |m| Box::new(Sgd::new(m.parameters(), 0.1))).unwrap();
    let x = Tensor::zeros(&[4, 1, 28, 28], DType::F32, Device::Cpu).unwrap();
    let y = Tensor::zeros(&[5], DType::I32, Device::Cpu).unwrap();
    let e = dp.step(&[&x, &y], ce).unwrap_err().to_string();
    assert!(e.contains("DataParallel::step") && e.contains("[5]") && e.contains("4"), "{e}");
    assert!(dp.step(&[], ce).unwrap_err().to_string().contains("at least one batch tensor"));
    assert!(DeviceGroup::new(&[]).unwrap_err().to_string().contains("at least one device"));
    // An empty batch would still move the weights: refused.
    let x0 = Tensor::zeros(&[0, 1, 28, 28], DType::F32, Device::Cpu).unwrap();
    let y0 = Tensor::zeros(&[0], DType::I32, Device::Cpu).unwrap();
    assert!(dp.step(&[&x0, &y0], ce).unwrap_err().to_string().contains("empty"));
    // f64 models would be rounded by the f32 collectives: refused, by name.
    #[derive(Module)]
    struct Wide {
        weight: voltaic::nn::Parameter,
    }
    let e = DataParallel::new(&group, |d| Ok(Wide { weight: voltaic::nn::Parameter::new(Tensor::zeros(&[3], DType::F64, d)?)? }), |m| Box::new(Sgd::new(m.parameters(), 0.1)));
    let e = e.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("f64") && e.contains("weight"), "{e}");
    // The group still trains after refused input.
    let y = Tensor::zeros(&[4], DType::I32, Device::Cpu).unwrap();
    assert!(dp.step(&[&x, &y], ce).unwrap().item::<f32>().unwrap().is_finite());
}

/// A replica that fails makes the step an error at once on every replica,
/// the others do not hang, and later steps are refused; a checkpoint
/// written before stays as it was.
fn check_failure(group: DeviceGroup, fail: impl Fn(Device) -> Result<()> + Sync, expect: &[&str]) {
    let dir = std::env::temp_dir().join(format!("voltaic-dp-fault-{}-{}", std::process::id(), group.devices()[1]));
    std::fs::create_dir_all(&dir).unwrap();
    let ckpt = dir.join("model.safetensors");
    let train = data(64 * 4);
    let b = batches(&train, 64, 4);
    let mut dp = data_parallel(mlp, &group, true);
    dp.step(&[&b[0].0, &b[0].1], ce).unwrap();
    voltaic::nn::save(dp.module(), &ckpt).unwrap();
    let before = std::fs::read(&ckpt).unwrap();
    let bad = group.devices()[1];
    let start = Instant::now();
    let r = dp.step(&[&b[1].0, &b[1].1], |m, rows| {
        let d = rows[0].device();
        if d == bad {
            fail(d)?;
        }
        ce(m, rows)
    });
    let took = start.elapsed();
    let e = r.expect_err("a failing replica fails the step").to_string();
    eprintln!("the step failed with: {e}");
    for want in expect {
        assert!(e.contains(want), "the error names {want:?}: {e}");
    }
    if bad.is_gpu() {
        assert!(e.contains(&format!("{bad}:")) || e.contains(&format!("{bad} ")), "the error names the failing device {bad}: {e}");
    }
    assert!(took < Duration::from_secs(20), "the failure took {took:?} to reach the step");
    let later = dp.step(&[&b[2].0, &b[2].1], ce).unwrap_err().to_string();
    assert!(later.contains("an earlier step failed") && later.contains("checkpoint"), "{later}");
    assert_eq!(std::fs::read(&ckpt).unwrap(), before, "the checkpoint on disk changed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_cpu_replica_is_an_error_from_the_step() {
    let _turn = turn();
    let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu]).unwrap();
    // Both replicas are the CPU: the first to get here fails.
    let n = std::sync::atomic::AtomicUsize::new(0);
    check_failure(
        group,
        |_| if n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 { Err(Error::Backend("simulated device loss".into())) } else { Ok(()) },
        &["simulated device loss"],
    );
}

#[test]
fn a_gpu_replica_out_of_memory_is_an_error_from_the_step() {
    let _turn = turn();
    let group = DeviceGroup::replicas(gpu(), 2).unwrap();
    // Real allocations the second device cannot satisfy: buffers past the
    // adapter's largest (lavapipe: 2 GiB), kept until the memory runs out
    // where the largest buffer is large.
    let max = voltaic::backend::adapters()[gpu_index()].limits.iter().find(|(n, _)| *n == "max_buffer_size").unwrap().1;
    let n = (max / 4 + 1).min(u32::MAX as u64) as usize;
    check_failure(
        group,
        |d| {
            let mut keep = vec![];
            for _ in 0..64 {
                let t = Tensor::zeros(&[n], DType::F32, d)?.add(1.0)?;
                t.realize()?;
                keep.push(t);
            }
            Ok(())
        },
        &["out of memory"],
    );
}

#[test]
fn a_panicking_replica_does_not_hang_the_others() {
    let _turn = turn();
    let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu]).unwrap();
    let mut dp = data_parallel(mlp, &group, false);
    let x = Tensor::randn(&[6, 1, 28, 28], DType::F32, Device::Cpu).unwrap();
    let y = Tensor::zeros(&[6], DType::I32, Device::Cpu).unwrap();
    let first = std::sync::atomic::AtomicBool::new(true);
    let start = Instant::now();
    let e = dp
        .step(&[&x, &y], |m, rows| {
            if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                panic!("a bug in the loss function");
            }
            ce(m, rows)
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("panicked") && e.contains("a bug in the loss function"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn one_local_replica_is_plain_training() {
    let _turn = turn();
    let comm: Arc<dyn Collective> = LocalGroup::ranks(1).remove(0);
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let train = data(64 * 5);
    let b = batches(&train, 64, 5);
    let want = one_device(mlp, Device::Cpu, &b, true);
    voltaic::manual_seed(11);
    let mut dp = DataParallel::with_collectives(&[Device::Cpu], vec![comm], mlp, |m| Box::new(Adam::new(m.parameters(), 1e-3))).unwrap();
    let got = parallel_losses(&mut dp, &b);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-6 * w.abs(), "{g} vs {w}");
    }
}

/// A bag of word embeddings and a classifier: the table's gradient is a
/// scatter of the rows a batch touched.
#[derive(Module)]
struct Bag {
    emb: voltaic::nn::Embedding,
    out: voltaic::nn::Linear,
}

fn bag(d: Device) -> Result<Bag> {
    Ok(Bag { emb: voltaic::nn::Embedding::new(3000, 24, d)?, out: voltaic::nn::Linear::new(24, 5, true, d)? })
}

fn bag_loss(m: &Bag, rows: &[Tensor]) -> Result<Tensor> {
    m.out.forward(&m.emb.forward(&rows[0])?.mean(&[1], false)?)?.cross_entropy(&rows[1], 0.0, Reduction::Mean)
}

/// Batches of 24 sequences of 10 ids, drawn skewed towards small ids so
/// that rows repeat within a replica's part and across replicas.
fn bag_batches(steps: usize) -> Vec<(Tensor, Tensor)> {
    voltaic::manual_seed(29);
    (0..steps)
        .map(|_| {
            let u = Tensor::rand(&[24, 10], DType::F32, Device::Cpu).unwrap();
            let ids = u.sqr().unwrap().sqr().unwrap().mul(3000.0).unwrap().floor().unwrap().to_dtype(DType::I32).unwrap();
            let first: Vec<i32> = ids.to_vec::<i32>().unwrap().chunks(10).map(|s| s[0] % 5).collect();
            (ids, Tensor::from_vec(first, &[24], Device::Cpu).unwrap())
        })
        .collect()
}

/// The table's rows travel (fewer bytes than its gradient) and the run
/// matches one device on the whole batches, on the CPU (sums before
/// `backward` returns) and on two devices of a GPU adapter (sums on the
/// reducer thread, uploads of the rows alone).
#[test]
fn a_word_embedding_exchanges_the_rows_its_batches_touch() {
    let _turn = turn();
    // Three batches, four times: the classifier learns them.
    let b: Vec<(Tensor, Tensor)> = bag_batches(3).into_iter().cycle().take(12).collect();
    for device in [Device::Cpu, gpu()] {
        voltaic::manual_seed(13);
        let m = bag(device).unwrap();
        let mut opt = Adam::new(m.parameters(), 5e-2);
        let want: Vec<f64> = b
            .iter()
            .map(|(x, y)| {
                opt.zero_grad();
                let loss = bag_loss(&m, &[x.to_device(device).unwrap(), y.to_device(device).unwrap()]).unwrap();
                loss.backward().unwrap();
                opt.step().unwrap();
                loss.item::<f32>().unwrap() as f64
            })
            .collect();
        let group = DeviceGroup::replicas(device, 2).unwrap();
        voltaic::manual_seed(13);
        let mut dp = DataParallel::new(&group, bag, |m| -> Box<dyn Optimizer + Send> { Box::new(Adam::new(m.parameters(), 5e-2)) }).unwrap();
        // Buckets of 64 KiB: the 3000x24 table (288,000 bytes) is large enough.
        dp.set_bucket_bytes(16 << 10, 64 << 10);
        let got: Vec<f64> = b.iter().map(|(x, y)| dp.step(&[x, y], bag_loss).unwrap().item::<f32>().unwrap() as f64).collect();
        for s in dp.last_sync() {
            assert_eq!(s.row_tables, 1, "{device}: {s:?}");
            // 12 sequences of 10 ids: 120 rows of 24 and their ids, with
            // the classifier's 125 values and the loss.
            assert_eq!(s.bytes, (120 * 25 + 125 + 1) * 4, "{device}: {s:?}");
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * w.abs(), "{device}: step {} loss {g} against one device's {w}", i + 1);
        }
        assert!(want[11] < want[0] * 0.9, "{device}: the loss did not fall: {want:?}");
        let table = |m: &Bag| m.emb.weight.value().to_device(Device::Cpu).unwrap().to_vec::<f32>().unwrap();
        let (one, two) = (table(dp.module()), table(&m));
        assert_eq!(table(dp.replica(1).unwrap()), one, "{device}: the replicas differ");
        let worst = one.iter().zip(&two).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "{device}: the table differs from one device's by {worst}");
    }
}

/// A rank whose table gradient is no scatter of rows (the table also
/// enters its loss elsewhere) while the other's is: the table is summed
/// whole that step, and every rank gets the whole batch's gradient.
#[test]
fn a_table_summed_whole_on_one_rank_still_gets_the_sum() {
    let _turn = turn();
    let b = bag_batches(1);
    let (x, y) = &b[0];
    let part = |r: usize| [x.narrow(0, r * 12, 12).unwrap(), y.narrow(0, r * 12, 12).unwrap()];
    // Rank 1 also pulls the table towards zero.
    let loss = |m: &Bag, r: usize| -> Result<Tensor> {
        let l = bag_loss(m, &part(r))?;
        if r == 1 {
            l.add(&m.emb.weight.value().sqr()?.sum(&[], false)?.mul(1e-3)?)
        } else {
            Ok(l)
        }
    };
    voltaic::manual_seed(17);
    let m = bag(Device::Cpu).unwrap();
    loss(&m, 0).unwrap().add(loss(&m, 1).unwrap()).unwrap().mul(0.5).unwrap().backward().unwrap();
    let want = m.emb.weight.grad().unwrap().to_vec::<f32>().unwrap();
    voltaic::manual_seed(17);
    let comms = LocalGroup::ranks(2);
    let models: Vec<Bag> = (0..2).map(|_| bag(Device::Cpu).unwrap()).collect();
    let got: Vec<(Vec<f32>, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = models
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(r, (m, c))| {
                s.spawn(move || {
                    let d = DistributedDataParallel::new(m, c).unwrap().with_bucket_bytes(16 << 10, 64 << 10);
                    d.backward(&loss(d.module(), r).unwrap(), 0.5).unwrap();
                    (d.module().emb.weight.grad().unwrap().to_vec::<f32>().unwrap(), d.last_sync().row_tables)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!((got[0].1, got[1].1), (1, 0), "rank 0 sent rows, rank 1 its whole gradient");
    assert_eq!(got[0].0, got[1].0, "the ranks' sums differ");
    let worst = got[0].0.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-6, "the sum differs from one model's gradient by {worst}");
}
