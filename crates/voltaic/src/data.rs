//! Datasets in memory and a data loader that shuffles (seeded), batches,
//! normalises and moves each batch to the device on a background thread
//! while the device computes the previous one.

use crate::error::{bail, Error, Result};
use crate::io::idx::{self, IdxData};
use crate::rng::Generator;
use crate::storage::CpuStorage;
use crate::tensor::Tensor;
use crate::Device;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

/// Labelled 8-bit images (or any fixed-size u8 items) held in memory.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// All items, `len * item_numel` bytes.
    pub pixels: Vec<u8>,
    /// Class of each item.
    pub labels: Vec<i32>,
    /// Shape of one item (e.g. `[1, 28, 28]`).
    pub item_dims: Vec<usize>,
}

impl Dataset {
    /// Items from an IDX image file (u8, `[n, ...]`) and an IDX label file (u8, `[n]`).
    pub fn from_idx(images: &Path, labels: &Path) -> Result<Dataset> {
        Dataset::from_parsed(idx::read(images)?, idx::read(labels)?, &images.display().to_string(), &labels.display().to_string())
    }

    /// Items from the bytes of an IDX image file and an IDX label file
    /// (gzipped or plain): where there is no filesystem, as in a browser.
    pub fn from_idx_bytes(images: &[u8], labels: &[u8]) -> Result<Dataset> {
        Dataset::from_parsed(idx::parse_bytes(images, "the image file")?, idx::parse_bytes(labels, "the label file")?, "the image file", "the label file")
    }

    fn from_parsed(im: idx::Idx, lb: idx::Idx, images: &str, labels: &str) -> Result<Dataset> {
        let (IdxData::U8(pixels), IdxData::U8(lab)) = (im.data, lb.data) else {
            bail!(Value, "dataset", "{images} and {labels} must hold u8 data");
        };
        if lb.dims.len() != 1 || im.dims.is_empty() || im.dims[0] != lb.dims[0] {
            bail!(Shape, "dataset", "{images} has dims {:?} but {labels} has {:?}: expected [n, ...] images and [n] labels", im.dims, lb.dims);
        }
        let mut item_dims = im.dims[1..].to_vec();
        if item_dims.len() == 2 {
            item_dims.insert(0, 1); // one channel
        }
        Ok(Dataset { pixels, labels: lab.into_iter().map(|l| l as i32).collect(), item_dims })
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// No items?
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Elements of one item.
    pub fn item_numel(&self) -> usize {
        self.item_dims.iter().product()
    }

    /// Fail, naming the file and the record, unless every label is a class
    /// index below `classes` (a corrupt byte would otherwise surface as an
    /// out-of-range index deep inside the loss).
    pub fn check_labels(&self, classes: usize, labels_file: &Path) -> Result<()> {
        if let Some((i, l)) = self.labels.iter().enumerate().find(|(_, &l)| l < 0 || l as usize >= classes) {
            bail!(Value, "dataset", "{}: record {i} has label {l}, expected a class in 0..{classes}", labels_file.display());
        }
        Ok(())
    }

    /// The batch of items `idx` (each below [`len`](Self::len)) on
    /// `device`, normalized as `(pixel / 255 - mean) / std` in f32 on the
    /// host and uploaded (what [`DataLoader::new`] makes).
    pub fn batch(&self, idx: &[usize], mean: f64, std: f64, device: Device) -> Result<Batch> {
        check_indices(idx, self.len())?;
        let (k, normalize) = (self.item_numel(), normalizer(mean, std));
        let mut x = Vec::with_capacity(idx.len() * k);
        for &i in idx {
            x.extend(self.pixels[i * k..(i + 1) * k].iter().map(normalize));
        }
        let y: Vec<i32> = idx.iter().map(|&i| self.labels[i]).collect();
        let mut dims = vec![idx.len()];
        dims.extend_from_slice(&self.item_dims);
        Ok(Batch { x: Tensor::from_storage(CpuStorage::F32(x), &dims, device)?, y: Tensor::from_storage(CpuStorage::I32(y), &[idx.len()], device)? })
    }

    /// The first `n` items (for quick runs and tests).
    pub fn take(&self, n: usize) -> Dataset {
        let n = n.min(self.len());
        Dataset { pixels: self.pixels[..n * self.item_numel()].to_vec(), labels: self.labels[..n].to_vec(), item_dims: self.item_dims.clone() }
    }
}

/// Fashion-MNIST's ten classes.
pub const FASHION_MNIST_CLASSES: usize = 10;

/// Where Debian's `dataset-fashion-mnist` package puts the files.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The path of Fashion-MNIST file `name` in `dir`: gzipped where there is one.
fn fashion_mnist_file(dir: &Path, name: &str) -> PathBuf {
    let gz = dir.join(format!("{name}.gz"));
    if gz.exists() {
        gz
    } else {
        dir.join(name)
    }
}

/// The number of items and the item dims of Fashion-MNIST's training and
/// test sets in `dir`, as [`fashion_mnist`] would load them, read from the
/// image files' headers alone (milliseconds, against a fraction of a second
/// to load them).
pub fn fashion_mnist_dims(dir: impl AsRef<Path>) -> Result<[(usize, Vec<usize>); 2]> {
    let dir = dir.as_ref();
    let dims = |name: &str| -> Result<(usize, Vec<usize>)> {
        let d = idx::read_dims(fashion_mnist_file(dir, name))?;
        let mut item = d[1..].to_vec();
        if item.len() == 2 {
            item.insert(0, 1); // one channel, as `Dataset::from_idx` makes it
        }
        Ok((d[0], item))
    };
    Ok([dims("train-images-idx3-ubyte")?, dims("t10k-images-idx3-ubyte")?])
}

/// Fashion-MNIST's training and test sets from `dir` (the four gzipped IDX
/// files of the Debian package `dataset-fashion-mnist`).
pub fn fashion_mnist(dir: impl AsRef<Path>) -> Result<(Dataset, Dataset)> {
    let dir = dir.as_ref();
    let f = |n: &str| fashion_mnist_file(dir, n);
    for n in ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"] {
        if !f(n).exists() {
            return Err(Error::Io(format!(
                "Fashion-MNIST file {n}(.gz) not found in {}: install the Debian package `dataset-fashion-mnist` \
                 (apt-get install dataset-fashion-mnist) or point --data at a directory holding the four IDX files",
                dir.display()
            )));
        }
    }
    let load = |images: &str, labels: &str| -> Result<Dataset> {
        let d = Dataset::from_idx(&f(images), &f(labels))?;
        if d.is_empty() {
            bail!(Value, "fashion_mnist", "{} holds no examples", f(images).display());
        }
        d.check_labels(FASHION_MNIST_CLASSES, &f(labels))?;
        Ok(d)
    };
    Ok((load("train-images-idx3-ubyte", "train-labels-idx1-ubyte")?, load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?))
}

/// One batch: inputs `[B, ...item_dims]` (f32, normalised) and labels `[B]` (i32).
#[derive(Clone, Debug)]
pub struct Batch {
    /// Inputs.
    pub x: Tensor,
    /// Class indices.
    pub y: Tensor,
}

/// How a [`DataLoader`] walks a dataset.
#[derive(Clone, Debug)]
pub struct LoaderOpts {
    /// Items per batch.
    pub batch_size: usize,
    /// Shuffle every epoch (seeded by `seed` and the epoch).
    pub shuffle: bool,
    /// Seed of the shuffle.
    pub seed: u64,
    /// `x = (pixel / 255 - mean) / std`.
    pub mean: f64,
    /// See `mean`.
    pub std: f64,
    /// Drop a last batch smaller than `batch_size`.
    pub drop_last: bool,
    /// Where the batches go.
    pub device: Device,
}

/// Batches of one epoch, prepared two ahead on a background thread.
pub struct DataLoader {
    rx: Receiver<Result<Batch>>,
    batches: usize,
}

/// The order of the items of `epoch`: a seeded Fisher-Yates shuffle, or 0..n.
pub fn epoch_order(n: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle && n > 1 {
        let mut g = Generator::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(epoch));
        let u = g.uniform53(n);
        for i in (1..n).rev() {
            let j = ((u[i] * (i + 1) as f64) as usize).min(i);
            order.swap(i, j);
        }
    }
    order
}

/// Fashion-MNIST's mean of the pixel values scaled to [0, 1] (what `voltaic
/// train` normalizes with).
pub const FASHION_MNIST_MEAN: f64 = 0.2860;
/// Fashion-MNIST's standard deviation of the pixel values scaled to [0, 1].
pub const FASHION_MNIST_STD: f64 = 0.3530;

/// `(pixel / 255 - mean) / std` in f32, as every loader computes it.
fn normalizer(mean: f64, std: f64) -> impl Fn(&u8) -> f32 + Copy {
    let (scale, shift) = (1.0 / (255.0 * std) as f32, (mean / std) as f32);
    move |&p| p as f32 * scale - shift
}

fn check_indices(idx: &[usize], len: usize) -> Result<()> {
    if let Some(i) = idx.iter().find(|&&i| i >= len) {
        bail!(Index, "batch", "example {i} is out of range for a dataset of {len}");
    }
    Ok(())
}

fn check_opts(opts: &LoaderOpts) -> Result<()> {
    if opts.batch_size == 0 {
        bail!(Value, "DataLoader", "batch_size must be positive");
    }
    if opts.std == 0.0 {
        bail!(Value, "DataLoader", "std must be nonzero");
    }
    Ok(())
}

/// A dataset normalized once and kept on a device, for
/// [`DataLoader::on_device`]: what a PyTorch user does by moving the whole
/// tensor to the GPU and indexing it there, rather than copying each batch.
#[derive(Clone, Debug)]
pub struct DeviceDataset {
    /// Every example, `(pixel / 255 - mean) / std`, as `[n, item dims...]` f32.
    pub x: Tensor,
    /// Every label, `[n]` i32.
    pub y: Tensor,
}

impl DeviceDataset {
    /// Normalize `data` with `mean` and `std` (of pixels scaled to [0, 1])
    /// and upload it to `device`.
    pub fn new(data: &Dataset, mean: f64, std: f64, device: Device) -> Result<DeviceDataset> {
        if std == 0.0 {
            bail!(Value, "DeviceDataset", "std must be nonzero");
        }
        // The host loader's arithmetic, so both give the same batches.
        let x: Vec<f32> = data.pixels.iter().map(normalizer(mean, std)).collect();
        let mut dims = vec![data.len()];
        dims.extend_from_slice(&data.item_dims);
        Ok(DeviceDataset {
            x: Tensor::from_storage(CpuStorage::F32(x), &dims, device)?,
            y: Tensor::from_storage(CpuStorage::I32(data.labels.clone()), &[data.len()], device)?,
        })
    }

    /// The batch of examples `idx` (below [`len`](Self::len)), gathered on
    /// the device: only the indices are uploaded.
    pub fn batch(&self, idx: &[usize]) -> Result<Batch> {
        check_indices(idx, self.len())?;
        let index: Vec<i32> = idx.iter().map(|&i| i as i32).collect();
        let index = Tensor::from_storage(CpuStorage::I32(index), &[idx.len()], self.x.device())?;
        Ok(Batch { x: self.x.index_select(0, &index)?, y: self.y.index_select(0, &index)? })
    }

    /// Bytes the dataset takes on its device.
    pub fn bytes(data: &Dataset) -> u64 {
        4 * (data.pixels.len() + data.labels.len()) as u64
    }

    /// Bytes a dataset of `len` examples of `item_numel` elements each
    /// would take on its device (f32 examples, i32 labels): what
    /// [`bytes`](Self::bytes) gives once it is loaded.
    pub fn bytes_for(len: usize, item_numel: usize) -> u64 {
        4 * (len * item_numel + len) as u64
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.y.dims()[0]
    }

    /// No examples?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DataLoader {
    /// Start preparing the batches of `epoch` on a thread: normalized on the
    /// host and uploaded to `opts.device`, two batches ahead of the consumer,
    /// so the upload of the next batch overlaps the current step.
    pub fn new(data: Arc<Dataset>, opts: &LoaderOpts, epoch: u64) -> Result<DataLoader> {
        check_opts(opts)?;
        let (mean, std, device) = (opts.mean, opts.std, opts.device);
        DataLoader::spawn(data.len(), opts, epoch, move |idx: &[usize]| data.batch(idx, mean, std, device))
    }

    /// Batches gathered on the device from a dataset that lives there: each
    /// step uploads only its indices (prepared ahead on a thread), and the
    /// gather runs on the device, in the same realization as the step that
    /// reads it. The batches are those [`DataLoader::new`] makes (same order,
    /// same values); `opts.mean`, `opts.std` and `opts.device` are the
    /// dataset's.
    pub fn on_device(data: Arc<DeviceDataset>, opts: &LoaderOpts, epoch: u64) -> Result<DataLoader> {
        check_opts(opts)?;
        if opts.device != data.x.device() {
            bail!(Device, "DataLoader::on_device", "the dataset is on {} but the loader was asked for {}", data.x.device(), opts.device);
        }
        DataLoader::spawn(data.len(), opts, epoch, move |idx: &[usize]| data.batch(idx))
    }

    /// Start a thread that makes the batches of `epoch` with `make` (given
    /// each batch's example indices), two ahead of the consumer.
    fn spawn(n: usize, opts: &LoaderOpts, epoch: u64, make: impl Fn(&[usize]) -> Result<Batch> + Send + 'static) -> Result<DataLoader> {
        let batches = if opts.drop_last { n / opts.batch_size } else { n.div_ceil(opts.batch_size) };
        let order = epoch_order(n, opts.shuffle, opts.seed, epoch);
        let (tx, rx) = sync_channel(2);
        let bs = opts.batch_size;
        std::thread::Builder::new()
            .name("voltaic-loader".into())
            .spawn(move || {
                for b in 0..batches {
                    let idx = &order[b * bs..((b + 1) * bs).min(n)];
                    if tx.send(make(idx)).is_err() {
                        return; // the loader was dropped
                    }
                }
            })
            .map_err(|e| Error::Io(format!("starting the data loader thread: {e}")))?;
        Ok(DataLoader { rx, batches })
    }

    /// Batches in this epoch.
    pub fn len(&self) -> usize {
        self.batches
    }

    /// No batches?
    pub fn is_empty(&self) -> bool {
        self.batches == 0
    }
}

impl Iterator for DataLoader {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        self.rx.recv().ok()
    }
}
