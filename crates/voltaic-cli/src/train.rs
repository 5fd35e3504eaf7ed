//! `voltaic train`: train a classifier on Fashion-MNIST, evaluate every
//! epoch, and write a checkpoint, a CSV of metrics and a PNG of the curves.

use crate::plot::{save_png, Panel, Series};
use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use voltaic::data::{fashion_mnist, fashion_mnist_dims, Batch, DataLoader, Dataset, DeviceDataset, LoaderOpts, FASHION_MNIST_DIR};
use voltaic::nn::{Forward, Module, Sequential};
use voltaic::optim::{Adam, CosineLr, GradScaler, LrSchedule, Optimizer, Sgd};
use voltaic::{DType, Device, Reduction, Tensor};

/// Arguments of `voltaic train`.
#[derive(clap::Args, Clone)]
pub struct TrainArgs {
    /// Dataset to train on.
    #[arg(long, default_value = "fashion-mnist", value_parser = ["fashion-mnist"])]
    pub dataset: String,
    /// Model: mlp (784-256-128-10) or cnn (two conv+pool blocks and a linear head).
    #[arg(long, default_value = "mlp", value_parser = ["mlp", "cnn"])]
    pub model: String,
    /// Passes over the training set (at least 1).
    #[arg(long, default_value_t = 5, value_parser = positive)]
    pub epochs: usize,
    /// Examples per step (at least 1).
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub batch_size: usize,
    /// Learning rate, finite and positive (default: 1e-3 for adam, 0.05 for sgd).
    #[arg(long, value_parser = learning_rate, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Optimizer: adam, adamw or sgd (momentum 0.9, Nesterov).
    #[arg(long, default_value = "adam", value_parser = ["adam", "adamw", "sgd"])]
    pub optimizer: String,
    /// Learning-rate schedule: cosine (annealed to zero over the run) or constant.
    #[arg(long, default_value = "cosine", value_parser = ["cosine", "constant"])]
    pub schedule: String,
    /// Device: cpu, gpu or gpu:N (default: the best available).
    #[arg(long)]
    pub device: Option<String>,
    /// Directory for the checkpoint, metrics.csv and curves.png.
    #[arg(long, default_value = "runs/fashion-mnist")]
    pub out: PathBuf,
    /// Directory with the four Fashion-MNIST IDX files (default: $VOLTAIC_FASHION_MNIST, else the Debian package's).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Seed of initialisation, shuffling and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Train on the first N examples only (quick runs; at least 1).
    #[arg(long, value_parser = positive)]
    pub limit: Option<usize>,
    /// Continue the run whose checkpoint is in DIR (after a kill or a crash),
    /// with its settings; reaches the same weights as an uninterrupted run.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "epochs", "batch_size", "lr", "optimizer", "schedule", "seed", "limit", "out", "precision", "devices", "distributed"])]
    pub resume: Option<PathBuf>,
    /// Keep the dataset on the device and gather each batch there: auto (on
    /// a GPU when both splits fit in 2 GiB), yes, or no (batches are made on
    /// the host, one step ahead, and uploaded).
    #[arg(long, default_value = "auto", value_parser = ["auto", "yes", "no"])]
    pub data_on_device: String,
    /// Arithmetic: f32, or f16/bf16 mixed precision (autocast: products
    /// and convolutions in the 16-bit type, norms, softmax and the loss in
    /// f32, f32 master weights; f16 adds dynamic loss scaling).
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    pub precision: String,
    /// Data-parallel training over several devices in this process, one
    /// thread each, e.g. `gpu:0,gpu:1`, or `gpu:0,gpu:0` (a GPU named twice
    /// gets a second device on its adapter), or `cpu,cpu`. --batch-size is
    /// the global batch, split over the devices.
    #[arg(long, value_delimiter = ',', value_name = "LIST", conflicts_with_all = ["device", "distributed"])]
    pub devices: Option<Vec<String>>,
    /// Be one rank of an MPI job (`mpirun -np N voltaic train --distributed`):
    /// each rank takes one device (the GPU of its local rank, or --device),
    /// rank 0 writes the checkpoint and the logs. Needs a voltaic built
    /// with `--features mpi`.
    #[arg(long)]
    pub distributed: bool,
    /// Write every step's training loss (of the whole batch) to FILE, as
    /// CSV lines `step,loss`.
    #[arg(long, value_name = "FILE")]
    pub loss_log: Option<PathBuf>,
    /// End with one JSON line of results.
    #[arg(long)]
    pub json: bool,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

/// A count that must be at least 1.
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("expected a whole number, got {s:?}")),
    }
}

/// A learning rate: finite and positive.
fn learning_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("must be a finite number above 0, got {v}")),
        Err(_) => Err(format!("expected a number, got {s:?}")),
    }
}

/// What one epoch measured.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct EpochStats {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_acc: f64,
    pub test_loss: f64,
    pub test_acc: f64,
    pub train_seconds: f64,
    pub samples_per_second: f64,
}

/// Find Fashion-MNIST: `--data`, else the Debian package's directory,
/// installing the package when it is missing and apt can.
pub fn locate_data(arg: Option<&Path>, quiet: bool) -> anyhow::Result<PathBuf> {
    if let Some(d) = arg {
        return Ok(d.to_path_buf());
    }
    if let Some(d) = std::env::var_os("VOLTAIC_FASHION_MNIST").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    let dir = PathBuf::from(FASHION_MNIST_DIR);
    if dir.join("train-images-idx3-ubyte.gz").exists() {
        return Ok(dir);
    }
    let root = std::process::Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0")).unwrap_or(false);
    let has_apt = Path::new("/usr/bin/apt-get").exists();
    if root && has_apt {
        if !quiet {
            eprintln!("Fashion-MNIST is missing: installing the Debian package dataset-fashion-mnist (apt-get)...");
        }
        let install = || std::process::Command::new("apt-get").args(["install", "-y", "-qq", "dataset-fashion-mnist"]).status();
        let mut ok = install().map(|s| s.success()).unwrap_or(false);
        if !ok {
            let _ = std::process::Command::new("apt-get").args(["update", "-qq"]).status();
            ok = install().map(|s| s.success()).unwrap_or(false);
        }
        if ok && dir.join("train-images-idx3-ubyte.gz").exists() {
            return Ok(dir);
        }
    }
    bail!(
        "Fashion-MNIST not found in {FASHION_MNIST_DIR}. Install it with `sudo apt-get install dataset-fashion-mnist`, \
         or pass --data DIR with train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz \
         and t10k-labels-idx1-ubyte.gz"
    )
}

/// Fashion-MNIST's mean and standard deviation of the pixel values in [0, 1].
pub const MEAN: f64 = voltaic::data::FASHION_MNIST_MEAN;
/// See [`MEAN`].
pub const STD: f64 = voltaic::data::FASHION_MNIST_STD;

pub fn build_model(name: &str, device: Device) -> anyhow::Result<Sequential> {
    Ok(match name {
        "mlp" => voltaic::models::classifier::mlp(device)?,
        "cnn" => voltaic::models::classifier::cnn(device)?,
        m => bail!("unknown model {m:?}: expected mlp or cnn"),
    })
}

pub fn build_optimizer(args: &TrainArgs, model: &Sequential) -> Box<dyn Optimizer + Send> {
    match args.optimizer.as_str() {
        "sgd" => Box::new(Sgd::new(model.parameters(), args.lr.unwrap_or(0.05)).with_momentum(0.9, true)),
        "adamw" => Box::new(Adam::adamw(model.parameters(), args.lr.unwrap_or(1e-3))),
        _ => Box::new(Adam::new(model.parameters(), args.lr.unwrap_or(1e-3))),
    }
}

/// One split of the data, and its copy on the device when it lives there.
#[derive(Clone)]
pub struct Split {
    /// The examples on the host.
    pub host: Arc<Dataset>,
    /// The normalized examples on the training device, if kept there.
    pub resident: Option<Arc<DeviceDataset>>,
}

/// Most bytes `--data-on-device auto` keeps on a GPU.
const RESIDENT_LIMIT: u64 = 2 << 30;

impl Split {
    /// Wrap `data`; with `resident`, also upload it to `device`.
    pub fn new(data: Dataset, device: Device, resident: bool) -> anyhow::Result<Split> {
        let resident = if resident { Some(Arc::new(DeviceDataset::new(&data, MEAN, STD, device)?)) } else { None };
        Ok(Split { host: Arc::new(data), resident })
    }

    /// Whether `--data-on-device` (`choice`) keeps datasets of `bytes` on `device`.
    pub fn keep_on_device(choice: &str, device: Device, bytes: u64) -> bool {
        match choice {
            "yes" => true,
            "no" => false,
            _ => matches!(device, Device::Gpu(_)) && bytes <= RESIDENT_LIMIT,
        }
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// The batch of examples `idx`, as the loader makes it.
    fn batch(&self, idx: &[usize], device: Device) -> voltaic::Result<Batch> {
        match &self.resident {
            Some(d) => d.batch(idx),
            None => self.host.batch(idx, MEAN, STD, device),
        }
    }

    /// The batches of one epoch.
    fn loader(&self, opts: &LoaderOpts, epoch: u64) -> voltaic::Result<DataLoader> {
        match &self.resident {
            Some(d) => DataLoader::on_device(d.clone(), opts, epoch),
            None => DataLoader::new(self.host.clone(), opts, epoch),
        }
    }
}

/// Loss sum and correct count over a test set, without gradients.
pub fn evaluate(model: &Sequential, data: &Split, device: Device, precision: &str) -> anyhow::Result<(f64, f64)> {
    model.eval();
    let _g = voltaic::NoGradGuard::new();
    let _a = voltaic::AutocastGuard::new(autocast_type(precision));
    let opts = LoaderOpts { batch_size: EVAL_BATCH, shuffle: false, seed: 0, mean: MEAN, std: STD, drop_last: false, device };
    let mut sums = Sums::zeros(device)?;
    for b in data.loader(&opts, 0)? {
        eval_batch(model, &b?, &mut sums)?;
    }
    let n = data.len() as f64;
    Ok((sums.loss.item::<f32>()? as f64 / n, sums.correct.item::<i32>()? as f64 / n))
}

/// Examples per evaluation batch.
const EVAL_BATCH: usize = 1000;

/// Add batch `b`'s summed loss and correct count to `sums` (under the
/// caller's no-grad and autocast guards) and realize them.
fn eval_batch(model: &Sequential, b: &Batch, sums: &mut Sums) -> voltaic::Result<()> {
    let logits = model.forward(&b.x)?;
    sums.loss = sums.loss.add(&logits.cross_entropy(&b.y, 0.0, Reduction::Sum)?)?;
    sums.correct = sums.correct.add(&logits.argmax(Some(-1), false)?.eq(&b.y)?.sum_all()?)?;
    Tensor::realize_all(&[&sums.loss, &sums.correct])
}

/// What an epoch (or an evaluation) adds up on the device, read at most once
/// per log interval: the loss summed over examples, the correct
/// predictions, and the loss since the last log line. They start as
/// uploaded zeros, not constants: every step's metrics then have one
/// structure (one cached plan, no kernels of their own).
struct Sums {
    loss: Tensor,
    correct: Tensor,
    window: Tensor,
}

impl Sums {
    fn zeros(device: Device) -> voltaic::Result<Sums> {
        Ok(Sums { loss: Sums::zero(device)?, correct: Tensor::from_vec(vec![0i32], &[], device)?, window: Sums::zero(device)? })
    }

    fn zero(device: Device) -> voltaic::Result<Tensor> {
        Tensor::from_vec(vec![0f32], &[], device)
    }
}

/// The step's optimizer and the f16 loss scaler, if the precision needs one.
struct Stepper<'a> {
    opt: &'a mut dyn Optimizer,
    scaler: Option<GradScaler>,
    /// The autocast type (`--precision`), `None` for f32.
    low: Option<DType>,
}

impl Stepper<'_> {
    /// One training step on batch `b`, realized with the metrics it adds to
    /// `sums`: forward under autocast, backward (scaled for f16), the
    /// optimizer's update. With `keep_loss`, the step's loss is realized too
    /// and returned (`--loss-log`).
    fn step(&mut self, model: &Sequential, b: &Batch, sums: &mut Sums, keep_loss: bool) -> voltaic::Result<Option<Tensor>> {
        let bs = b.y.numel();
        let (logits, loss) = {
            let _a = voltaic::AutocastGuard::new(self.low);
            let logits = model.forward(&b.x)?;
            let loss = logits.cross_entropy(&b.y, 0.0, Reduction::Mean)?;
            (logits, loss)
        };
        self.opt.zero_grad();
        // The metrics are recorded before the update, so that a plain
        // step realizes them with it: realized apart, they were a
        // realization of their own that computed the loss again from the
        // logits (on the 2-core CPU 0.5 ms of kernels and 0.13 ms of host
        // work per step).
        let l = loss.detach().mul(bs as f64)?;
        sums.loss = sums.loss.add(&l)?;
        sums.window = sums.window.add(&l)?;
        sums.correct = sums.correct.add(&logits.detach().argmax(Some(-1), false)?.eq(&b.y)?.sum_all()?)?;
        let step_loss = keep_loss.then(|| loss.detach().to_dtype(DType::F32)).transpose()?;
        let mut metrics = vec![&sums.loss, &sums.correct, &sums.window];
        metrics.extend(step_loss.as_ref());
        match &mut self.scaler {
            Some(s) => {
                s.scale(&loss)?.backward()?;
                s.step(&mut *self.opt)?;
                s.update()?;
                Tensor::realize_all(&metrics)?;
            }
            None => {
                loss.backward()?;
                self.opt.step_with(&metrics)?;
            }
        }
        model.realize_state()?;
        Ok(step_loss)
    }
}

/// One logged step: (epoch as a fraction, training loss).
pub type StepLoss = (f64, f64);

/// Where a run starts: epoch and step counters, and what earlier epochs measured.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// Epochs completed.
    pub epoch: usize,
    /// Optimizer steps taken.
    pub step: usize,
    /// Every completed epoch's figures.
    pub history: Vec<EpochStats>,
    /// The logged step losses so far.
    pub step_losses: Vec<StepLoss>,
    /// The f16 loss scaler's (scale, clean steps in a row), to resume it.
    #[serde(default)]
    pub loss_scale: Option<(f64, usize)>,
    /// Steps the loss scaler skipped (inf or NaN gradients).
    #[serde(default)]
    pub skipped_steps: usize,
    /// Every step's loss, kept with --loss-log (not checkpointed).
    #[serde(skip)]
    pub every_step: Vec<f64>,
}

/// Write `--loss-log`: one `step,loss` line per step (full precision).
pub(crate) fn write_loss_log(path: &Path, losses: &[f64]) -> anyhow::Result<()> {
    let mut csv = String::from("step,loss\n");
    for (i, l) in losses.iter().enumerate() {
        csv.push_str(&format!("{},{l:e}\n", i + 1));
    }
    voltaic::io::write_atomic(path, csv.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// Train from `progress` up to `args.epochs`, calling `on_epoch` after each
/// epoch with the progress so far (to checkpoint it).
#[allow(clippy::too_many_arguments, reason = "the pieces of a run, each owned by its caller")]
pub fn train_loop(
    args: &TrainArgs,
    device: Device,
    model: &Sequential,
    opt: &mut dyn Optimizer,
    train: &Split,
    test: Option<&Split>,
    mut progress: Progress,
    mut on_epoch: impl FnMut(&Progress, &dyn Optimizer) -> anyhow::Result<()>,
) -> anyhow::Result<Progress> {
    let opts = LoaderOpts { batch_size: args.batch_size, shuffle: true, seed: args.seed, mean: MEAN, std: STD, drop_last: false, device };
    let steps_per_epoch = train.len().div_ceil(args.batch_size);
    let total_steps = steps_per_epoch * args.epochs;
    let schedule = CosineLr { t_max: total_steps, min_lr: 0.0 };
    let base_lr = args_lr(args);
    let log_every = 50;
    let low = autocast_type(&args.precision);
    // f16's range needs the loss scaled; bf16 has f32's.
    let scaler = (low == Some(DType::F16)).then(|| {
        let mut s = GradScaler::new();
        if let Some((scale, clean)) = progress.loss_scale {
            s.load_state(scale, clean);
        }
        s
    });
    let mut stepper = Stepper { opt, scaler, low };
    // The scaler counts the steps it skipped on the device; a resumed run adds its own.
    let skipped_before = progress.skipped_steps;
    for epoch in progress.epoch + 1..=args.epochs {
        model.train();
        let pb = epoch_bar(args.quiet, steps_per_epoch, epoch, args.epochs);
        let t0 = Instant::now();
        let mut sums = Sums::zeros(device)?;
        let (mut seen, mut window_seen) = (0usize, 0usize);
        // With --loss-log, every step's loss, read once the epoch is over.
        let mut step_losses: Vec<Tensor> = Vec::new();
        for b in train.loader(&opts, epoch as u64)? {
            let b = b?;
            let bs = b.y.numel();
            if args.schedule == "cosine" {
                stepper.opt.set_lr(schedule.lr(base_lr, progress.step));
            }
            if let Some(l) = stepper.step(model, &b, &mut sums, args.loss_log.is_some())? {
                step_losses.push(l);
            }
            seen += bs;
            window_seen += bs;
            progress.step += 1;
            pb.inc(1);
            if progress.step.is_multiple_of(log_every) {
                let avg = sums.window.item::<f32>()? as f64 / window_seen as f64;
                if !avg.is_finite() {
                    bail!("the training loss became {avg} at step {}: lower --lr", progress.step);
                }
                progress.step_losses.push((progress.step as f64 / steps_per_epoch as f64, avg));
                let rate = seen as f64 / t0.elapsed().as_secs_f64();
                let acc = sums.correct.item::<i32>()? as f64 / seen as f64;
                pb.set_message(format!("loss {avg:.4} acc {:.2}% {rate:.0} samples/s", 100.0 * acc));
                sums.window = Sums::zero(device)?;
                window_seen = 0;
            }
        }
        for l in &step_losses {
            progress.every_step.push(l.item::<f32>()? as f64);
        }
        let train_loss = sums.loss.item::<f32>()? as f64 / seen as f64;
        let train_acc = sums.correct.item::<i32>()? as f64 / seen as f64;
        let secs = t0.elapsed().as_secs_f64();
        pb.finish_and_clear();
        if !train_loss.is_finite() {
            bail!("the training loss became {train_loss} in epoch {epoch}: lower --lr");
        }
        let (test_loss, test_acc) = match test {
            Some(t) => evaluate(model, t, device, &args.precision)?,
            None => (f64::NAN, f64::NAN),
        };
        progress.epoch = epoch;
        progress.loss_scale = stepper.scaler.as_ref().map(|s| s.state()).transpose()?;
        if let Some(s) = &stepper.scaler {
            progress.skipped_steps = skipped_before + s.skipped_steps()? as usize;
        }
        progress.history.push(EpochStats { epoch, train_loss, train_acc, test_loss, test_acc, train_seconds: secs, samples_per_second: seen as f64 / secs });
        on_epoch(&progress, &*stepper.opt)?;
    }
    Ok(progress)
}

/// A split's size and item shape, and whether it will live on the device:
/// what [`compile_ahead`] needs before the data is loaded.
#[derive(Clone)]
struct SplitShape {
    len: usize,
    item_dims: Vec<usize>,
    resident: bool,
}

impl SplitShape {
    /// A stand-in for the split in a dry run: zeros of its shapes where the
    /// split will be (on the device, realized, so that batches gather from
    /// a buffer as they will from the real one; or on the host, `batch`
    /// examples of it, uploaded per batch as the real loader does).
    fn stand_in(&self, device: Device, batch: usize) -> voltaic::Result<Split> {
        let k: usize = self.item_dims.iter().product();
        if self.resident {
            let mut dims = vec![self.len];
            dims.extend_from_slice(&self.item_dims);
            // Contiguous: `zeros` alone is a broadcast scalar, which a gather would read as one.
            let zeros = |dims: &[usize], dt| Tensor::zeros(dims, dt, device)?.contiguous();
            let d = DeviceDataset { x: zeros(&dims, DType::F32)?, y: zeros(&[self.len], DType::I32)? };
            Tensor::realize_all(&[&d.x, &d.y])?;
            let none = Dataset { pixels: vec![], labels: vec![], item_dims: self.item_dims.clone() };
            return Ok(Split { host: Arc::new(none), resident: Some(Arc::new(d)) });
        }
        let host = Dataset { pixels: vec![0; batch * k], labels: vec![0; batch], item_dims: self.item_dims.clone() };
        Ok(Split { host: Arc::new(host), resident: None })
    }
}

/// Compile, on a thread of its own, the kernels of every batch shape the run
/// will meet (a GPU compiles each kernel anew for new sizes: about 50
/// pipelines for the CNN's step, a few tenths of a second on an H100's 16
/// threads): the first training batch while the data loads, then the
/// epoch's last batch where it is smaller than the others, and the
/// evaluation's batches, which a cold run would otherwise pay for when they
/// come. The thread runs one step (and one evaluation batch) of each size
/// as a dry run (`voltaic::dry_run`) on a fresh model and optimizer of the
/// same kind over zeros of the data's shapes, so nothing of the run's own
/// state or random stream moves; the real steps then find their plans and
/// kernels ready, or wait for a kernel being compiled rather than compile
/// it again. `None` when there is nothing to compile (the CPU) or with
/// `VOLTAIC_COMPILE_AHEAD=0` (for measuring what it saves).
fn compile_ahead(args: &TrainArgs, device: Device, train: SplitShape, test: SplitShape) -> Option<std::thread::JoinHandle<()>> {
    let off = std::env::var("VOLTAIC_COMPILE_AHEAD").is_ok_and(|v| v == "0");
    if off || matches!(device, Device::Cpu) || train.len == 0 {
        return None;
    }
    let sizes = |n: usize, bs: usize| -> Vec<usize> {
        let mut v: Vec<usize> = [bs.min(n), n % bs].into_iter().filter(|&r| r > 0).collect();
        v.dedup();
        v
    };
    let (train_sizes, eval_sizes) = (sizes(train.len, args.batch_size), sizes(test.len, EVAL_BATCH));
    let args = args.clone();
    let work = move || -> anyhow::Result<()> {
        let model = build_model(&args.model, device)?;
        let mut opt = build_optimizer(&args, &model);
        let low = autocast_type(&args.precision);
        let mut stepper = Stepper { opt: opt.as_mut(), scaler: (low == Some(DType::F16)).then(GradScaler::new), low };
        let data = train.stand_in(device, train_sizes[0])?;
        for &size in &train_sizes {
            model.train();
            let b = data.batch(&(0..size).collect::<Vec<_>>(), device)?;
            stepper.step(&model, &b, &mut Sums::zeros(device)?, args.loss_log.is_some())?;
        }
        drop(data);
        if let Some(&first) = eval_sizes.first() {
            let data = test.stand_in(device, first)?;
            model.eval();
            let _g = voltaic::NoGradGuard::new();
            let _a = voltaic::AutocastGuard::new(low);
            for &size in &eval_sizes {
                eval_batch(&model, &data.batch(&(0..size).collect::<Vec<_>>(), device)?, &mut Sums::zeros(device)?)?;
            }
        }
        Ok(())
    };
    let spawned = std::thread::Builder::new().name("voltaic-compile-ahead".into()).spawn(move || {
        if let Err(e) = voltaic::dry_run(work) {
            // Only time is lost: each batch compiles its kernels when it comes.
            eprintln!("warning: compiling the training step's kernels ahead failed: {e:#}");
        }
    });
    spawned.ok()
}

/// The progress bar of one epoch (hidden when `quiet`).
pub(crate) fn epoch_bar(quiet: bool, steps: usize, epoch: usize, epochs: usize) -> ProgressBar {
    let pb = if quiet { ProgressBar::hidden() } else { ProgressBar::new(steps as u64) };
    pb.set_style(ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed} / {eta} left)").expect("valid template").progress_chars("=> "));
    pb.set_prefix(format!("{epoch}/{epochs}"));
    pb
}

/// The autocast type of a `--precision` value (None for f32).
pub fn autocast_type(precision: &str) -> Option<DType> {
    match precision {
        "f16" => Some(DType::F16),
        "bf16" => Some(DType::BF16),
        _ => None,
    }
}

/// The learning rate a run starts from.
pub(crate) fn args_lr(args: &TrainArgs) -> f64 {
    args.lr.unwrap_or(if args.optimizer == "sgd" { 0.05 } else { 1e-3 })
}

/// "1 epoch", "5 epochs".
pub(crate) fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// The checkpoint of a run: model, optimizer state and progress, written in
/// one atomic file (so they always agree), then the plain `model.safetensors`
/// and `metrics.csv` derived from it.
pub const CHECKPOINT: &str = "checkpoint.safetensors";
/// The metadata key holding the run's settings and progress.
const STATE_KEY: &str = "voltaic_train";

/// What a checkpoint holds besides tensors.
#[derive(serde::Serialize, serde::Deserialize)]
struct RunState {
    args: SavedArgs,
    progress: Progress,
    /// The default generator's (seed, offset).
    rng: (u64, u64),
}

/// The settings that determine a run's weights.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct SavedArgs {
    model: String,
    epochs: usize,
    batch_size: usize,
    lr: Option<f64>,
    optimizer: String,
    schedule: String,
    seed: u64,
    limit: Option<usize>,
    #[serde(default = "f32_name")]
    precision: String,
}

/// Checkpoints written before `--precision` existed trained in f32.
fn f32_name() -> String {
    "f32".into()
}

impl SavedArgs {
    fn of(a: &TrainArgs) -> SavedArgs {
        SavedArgs {
            model: a.model.clone(),
            epochs: a.epochs,
            batch_size: a.batch_size,
            lr: a.lr,
            optimizer: a.optimizer.clone(),
            schedule: a.schedule.clone(),
            seed: a.seed,
            limit: a.limit,
            precision: a.precision.clone(),
        }
    }

    fn apply(&self, a: &mut TrainArgs) {
        a.model = self.model.clone();
        a.epochs = self.epochs;
        a.batch_size = self.batch_size;
        a.lr = self.lr;
        a.optimizer = self.optimizer.clone();
        a.schedule = self.schedule.clone();
        a.seed = self.seed;
        a.limit = self.limit;
        a.precision = self.precision.clone();
    }
}

pub(crate) fn write_checkpoint(dir: &Path, args: &TrainArgs, model: &Sequential, opt: &dyn Optimizer, progress: &Progress) -> anyhow::Result<()> {
    let g = voltaic::rng_state();
    let state = RunState { args: SavedArgs::of(args), progress: progress.clone(), rng: (g.seed(), g.offset()) };
    let mut tensors: Vec<(String, Tensor)> = model.named_tensors().into_iter().map(|(n, p)| (format!("model.{n}"), p.value())).collect();
    tensors.extend(opt.state().into_iter().map(|(n, t)| (format!("optimizer.{n}"), t)));
    let meta = HashMap::from([(STATE_KEY.to_string(), serde_json::to_string(&state)?)]);
    voltaic::io::safetensors::save_with_metadata(dir.join(CHECKPOINT), &tensors, &meta)?;
    voltaic::nn::save(model, dir.join("model.safetensors"))?;
    // The metrics last: after a kill they never run ahead of the weights.
    let mut csv = String::from("epoch,train_loss,train_acc,test_loss,test_acc,train_seconds,samples_per_second\n");
    for s in &progress.history {
        csv.push_str(&format!(
            "{},{:.6},{:.6},{:.6},{:.6},{:.3},{:.1}\n",
            s.epoch, s.train_loss, s.train_acc, s.test_loss, s.test_acc, s.train_seconds, s.samples_per_second
        ));
    }
    voltaic::io::write_atomic(&dir.join("metrics.csv"), csv.as_bytes()).with_context(|| format!("writing {}", dir.join("metrics.csv").display()))?;
    Ok(())
}

/// Read a run's checkpoint: its state, and its tensors split into model and optimizer parts.
fn read_checkpoint(dir: &Path) -> anyhow::Result<(RunState, voltaic::io::safetensors::SafetensorsFile)> {
    let path = dir.join(CHECKPOINT);
    if !path.exists() {
        bail!("{}: no checkpoint here (a run writes {CHECKPOINT} after its first epoch)", dir.display());
    }
    let file = voltaic::io::safetensors::SafetensorsFile::open(&path)?;
    let meta = file.metadata()?;
    let state: RunState = meta
        .get(STATE_KEY)
        .with_context(|| format!("{}: not a voltaic train checkpoint (no {STATE_KEY:?} metadata)", path.display()))
        .and_then(|s| serde_json::from_str(s).with_context(|| format!("{}: unreadable {STATE_KEY:?} metadata", path.display())))?;
    Ok((state, file))
}

/// Load the `model.` tensors of a checkpoint into `model` (every one, exactly).
fn load_model(file: &voltaic::io::safetensors::SafetensorsFile, model: &Sequential, device: Device) -> anyhow::Result<()> {
    for (name, p) in model.named_tensors() {
        let key = format!("model.{name}");
        let t = file.tensor(&key, device).with_context(|| format!("the checkpoint lacks {key:?}"))?;
        p.set(t.to_dtype(p.value().dtype())?)?;
    }
    Ok(())
}

pub fn run(mut args: TrainArgs) -> anyhow::Result<()> {
    if args.devices.is_some() || args.distributed {
        return crate::parallel::run(args);
    }
    // Everything is checked before anything is written.
    let device = crate::parse_device(args.device.as_deref())?;
    let resumed = match args.resume.clone() {
        Some(dir) => {
            let (state, file) = read_checkpoint(&dir)?;
            state.args.apply(&mut args);
            args.out = dir;
            Some((state, file))
        }
        None => None,
    };
    let dir = locate_data(args.data.as_deref(), args.quiet)?;
    // The data's shapes from the files' headers: the kernels of the steps
    // to come compile while the data loads (see `compile_ahead`). A file
    // that cannot be read is reported by the loading below.
    let ahead = fashion_mnist_dims(&dir).ok().and_then(|[(n_train, item), (n_test, _)]| {
        let n_train = args.limit.map_or(n_train, |l| l.min(n_train));
        let k: usize = item.iter().product();
        let resident = Split::keep_on_device(&args.data_on_device, device, DeviceDataset::bytes_for(n_train, k) + DeviceDataset::bytes_for(n_test, k));
        let shape = |len: usize| SplitShape { len, item_dims: item.clone(), resident };
        compile_ahead(&args, device, shape(n_train), shape(n_test))
    });
    let (mut train, test) = fashion_mnist(&dir).with_context(|| format!("loading Fashion-MNIST from {}", dir.display()))?;
    if let Some(n) = args.limit {
        train = train.take(n);
    }
    let resident = Split::keep_on_device(&args.data_on_device, device, DeviceDataset::bytes(&train) + DeviceDataset::bytes(&test));
    let (train, test) = (Split::new(train, device, resident)?, Split::new(test, device, resident)?);
    voltaic::manual_seed(args.seed);
    let model = build_model(&args.model, device)?;
    let mut opt = build_optimizer(&args, &model);
    let progress = match &resumed {
        Some((state, file)) => {
            load_model(file, &model, device)?;
            let opt_state: Vec<(String, Tensor)> = file
                .names()?
                .into_iter()
                .filter_map(|n| n.strip_prefix("optimizer.").map(|k| (n.clone(), k.to_string())))
                .map(|(n, k)| Ok((k, file.tensor(&n, device)?)))
                .collect::<voltaic::Result<_>>()?;
            opt.load_state(&opt_state)?;
            voltaic::set_rng_state(voltaic::Generator::at(state.rng.0, state.rng.1));
            if state.progress.epoch >= args.epochs {
                bail!("{}: the run already finished its {}", args.out.display(), plural(args.epochs, "epoch"));
            }
            state.progress.clone()
        }
        None => Progress::default(),
    };
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    // Temporary files of a killed run are never read: remove them.
    voltaic::io::remove_stale_temp_files(&args.out).with_context(|| format!("cleaning {}", args.out.display()))?;
    if !args.quiet {
        let params: usize = model.parameters().iter().map(|p| p.value().numel()).sum();
        let from = if progress.epoch > 0 { format!(", resuming after epoch {}", progress.epoch) } else { String::new() };
        eprintln!(
            "Training {} ({params} parameters) on {} Fashion-MNIST images on {device}, {}, batch {}, {} lr {}, {}{from}",
            args.model,
            train.len(),
            plural(args.epochs, "epoch"),
            args.batch_size,
            args.optimizer,
            opt.lr(),
            match args.precision.as_str() {
                "f32" => "f32".to_string(),
                p => format!("{p} mixed precision"),
            }
        );
    }
    let quiet = args.quiet;
    let progress = train_loop(&args, device, &model, opt.as_mut(), &train, Some(&test), progress, |p, opt| {
        let s = p.history.last().expect("an epoch was just run");
        if !quiet {
            eprintln!(
                "epoch {:>2}: train loss {:.4} acc {:.2}% | test loss {:.4} acc {:.2}% | {:.1} s, {:.0} samples/s",
                s.epoch,
                s.train_loss,
                100.0 * s.train_acc,
                s.test_loss,
                100.0 * s.test_acc,
                s.train_seconds,
                s.samples_per_second
            );
        }
        write_checkpoint(&args.out, &args, &model, opt, p)
    })?;
    if let Some(h) = ahead {
        // Done long before on a GPU; joined so that no thread outlives the run.
        let _ = h.join();
    }
    finish(&args, &progress, &device.to_string(), device)
}

/// The end of a run: the loss log, the curves, the summary line and the
/// JSON results (`where_` names the device or devices).
pub(crate) fn finish(args: &TrainArgs, progress: &Progress, where_: &str, device: Device) -> anyhow::Result<()> {
    if let Some(p) = &args.loss_log {
        write_loss_log(p, &progress.every_step)?;
    }
    let history = &progress.history;
    let epochs: Vec<f64> = history.iter().map(|s| s.epoch as f64).collect();
    let pts = |f: &dyn Fn(&EpochStats) -> f64| epochs.iter().copied().zip(history.iter().map(f)).collect::<Vec<_>>();
    save_png(
        &args.out.join("curves.png"),
        &[
            Panel {
                title: format!("{} on Fashion-MNIST: loss", args.model),
                x_label: "epoch".into(),
                y_label: "cross entropy".into(),
                series: vec![
                    Series { name: "train (every 50 steps)".into(), points: progress.step_losses.clone() },
                    Series { name: "test".into(), points: pts(&|s| s.test_loss) },
                ],
            },
            Panel {
                title: "accuracy".into(),
                x_label: "epoch".into(),
                y_label: "accuracy".into(),
                series: vec![
                    Series { name: "train".into(), points: pts(&|s| s.train_acc) },
                    Series { name: "test".into(), points: pts(&|s| s.test_acc) },
                ],
            },
        ],
    )?;
    let last = history.last().context("no epochs were run")?;
    let train_seconds: f64 = history.iter().map(|s| s.train_seconds).sum();
    let samples: f64 = history.iter().map(|s| s.samples_per_second * s.train_seconds).sum();
    if !args.quiet {
        eprintln!(
            "Test accuracy {:.2}%. Wrote model.safetensors, {CHECKPOINT}, metrics.csv and curves.png to {}",
            100.0 * last.test_acc,
            args.out.display()
        );
    }
    if args.json {
        println!(
            "{}",
            json!({
                "dataset": args.dataset, "model": args.model, "device": where_, "epochs": args.epochs,
                "precision": args.precision, "skipped_steps": progress.skipped_steps,
                "test_accuracy": (last.test_acc * 1e4).round() / 1e4,
                "train_seconds": (train_seconds * 100.0).round() / 100.0,
                "samples_per_second": (samples / train_seconds).round(),
                "epoch_seconds": history.iter().map(|s| (s.train_seconds * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
                "pipelines": device.stats().map(|s| s.pipelines).unwrap_or(0),
                "bind_groups": device.stats().map(|s| s.bind_groups).unwrap_or(0),
                "compile_seconds": (voltaic::host_profile().compile_us / 1e4).round() / 100.0,
            })
        );
    }
    std::io::stdout().flush()?;
    voltaic::backend::save_caches();
    Ok(())
}

/// Arguments of `voltaic eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// A run directory written by `voltaic train` (its checkpoint.safetensors).
    pub dir: PathBuf,
    /// Device: cpu, gpu or gpu:N (default: the best available).
    #[arg(long)]
    pub device: Option<String>,
    /// Directory with the Fashion-MNIST IDX files (default: the Debian package's).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Evaluate only the first N test images.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `voltaic eval DIR`: test loss and accuracy of a run's checkpoint.
pub fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let device = crate::parse_device(args.device.as_deref())?;
    let (state, file) = read_checkpoint(&args.dir)?;
    let data = locate_data(args.data.as_deref(), true)?;
    let (_, mut test) = fashion_mnist(&data).with_context(|| format!("loading Fashion-MNIST from {}", data.display()))?;
    if let Some(n) = args.limit {
        if n == 0 {
            bail!("--limit must be positive");
        }
        test = test.take(n);
    }
    let model = build_model(&state.args.model, device)?;
    load_model(&file, &model, device)?;
    let n_images = test.len();
    let (loss, acc) = evaluate(&model, &Split::new(test, device, false)?, device, "f32")?;
    let epoch = state.progress.epoch;
    if args.json {
        println!("{}", json!({ "dir": args.dir.display().to_string(), "model": state.args.model, "epoch": epoch, "images": n_images, "test_loss": loss, "test_accuracy": acc }));
    } else {
        println!("{} after {}: test accuracy {:.2}%, test loss {:.4}", state.args.model, plural(epoch, "epoch"), 100.0 * acc, loss);
    }
    Ok(())
}
