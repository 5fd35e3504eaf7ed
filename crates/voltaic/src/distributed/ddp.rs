//! One replica of data-parallel training: its module, and the bucketed
//! all-reduce that turns its gradients into the whole batch's.

use super::collective::Collective;
use super::workers::Workers;
use crate::backend::PendingRead;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Module, Parameter};
use crate::tensor::Tensor;
use std::sync::{mpsc, Arc, Mutex};
use web_time::Instant;

/// PyTorch DDP's bucket sizes: a small first bucket, so that the reduction
/// starts early, then 25 MiB ones.
const FIRST_BUCKET_BYTES: usize = 1 << 20;
const BUCKET_BYTES: usize = 25 << 20;

/// What the last gradient synchronisation cost, in seconds of host time.
#[derive(Clone, Copy, Debug, Default)]
pub struct SyncStats {
    /// Buckets reduced.
    pub buckets: usize,
    /// Bytes of gradient reduced (f32): for a table whose rows travel, the
    /// bytes of this rank's rows and their ids.
    pub bytes: usize,
    /// Tables whose gradient this rank sent as the rows its batch touched.
    pub row_tables: usize,
    /// From the start of the synchronisation to its end (realising the
    /// gradients, reading them back, reducing, uploading); where the sums
    /// run on the reducer thread, until the buckets are handed to it.
    pub total_seconds: f64,
    /// Inside the collective (waiting for the peers and adding). Where the
    /// sums run on the replica's reducer thread (a GPU), these are the sums
    /// of earlier steps that had finished when this backward pass began.
    pub reduce_seconds: f64,
    /// Waiting for the device to compute and return a bucket (on the
    /// reducer thread: as `reduce_seconds`).
    pub read_seconds: f64,
    /// Recording the backward graph (before any bucket is realised).
    pub backward_seconds: f64,
    /// Realising the loss (the forward pass) and then the buckets:
    /// scheduling, encoding and submitting the kernels, bucket by bucket.
    pub realize_seconds: f64,
}

/// One replica of data-parallel training, as PyTorch's
/// `DistributedDataParallel`: it holds the module, makes every rank start
/// from rank 0's parameters (and refuses a rank whose model differs), and
/// replaces the gradients of a backward pass by their sum over the ranks,
/// reduced in buckets while later gradients are still being computed.
///
/// ```
/// use voltaic::distributed::{DistributedDataParallel, LocalGroup};
/// use voltaic::nn::{Forward, Linear, Module};
/// use voltaic::{DType, Device, Tensor};
/// let comm = LocalGroup::ranks(1).remove(0);
/// let ddp = DistributedDataParallel::new(Linear::new(3, 2, true, Device::Cpu)?, comm)?;
/// let x = Tensor::randn(&[4, 3], DType::F32, Device::Cpu)?;
/// let loss = ddp.module().forward(&x)?.sqr()?.mean(&[], false)?;
/// let global = ddp.backward(&loss, 1.0)?; // this rank holds the whole batch
/// assert!((global.item::<f32>()? - loss.item::<f32>()?).abs() < 1e-6);
/// assert!(ddp.module().parameters()[0].grad().is_some());
/// # Ok::<(), voltaic::Error>(())
/// ```
pub struct DistributedDataParallel<M> {
    /// Sums buckets while the next step is recorded. First, so that it is
    /// dropped (its last sums finished) before the collective: MPI is
    /// finalised where its last handle is dropped.
    reducer: Mutex<Reducer>,
    /// Whether a GPU's sums may run on the reducer (off for replicas that
    /// share one wgpu device: one's held-back work would hold the other's
    /// reads, which its sums wait for).
    overlap: bool,
    module: M,
    comm: Arc<dyn Collective>,
    params: Vec<Parameter>,
    first_bucket_bytes: usize,
    bucket_bytes: usize,
    /// Which parameters exchange rows (see `tables`), once known.
    tables: std::sync::OnceLock<Vec<bool>>,
    stats: Mutex<SyncStats>,
}

/// A stable digest of a model's layout: names, shapes, dtypes, roles.
fn signature(named: &[(String, Parameter)]) -> (u64, u64) {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    let mut numel = 0u64;
    for (name, p) in named {
        let v = p.value();
        eat(name.as_bytes());
        for d in v.dims() {
            eat(&(*d as u64).to_le_bytes());
        }
        eat(v.dtype().to_string().as_bytes());
        eat(&[p.is_trainable() as u8, 0xff]);
        numel += v.numel() as u64;
    }
    (h, numel)
}

/// Read a flat f32 tensor's values once its pending read arrives.
fn finish_f32(read: PendingRead) -> Result<Vec<f32>> {
    Ok(read.wait()?.into_vec().expect("an f32 bucket"))
}

impl<M: Module> DistributedDataParallel<M> {
    /// Wrap `module` for the rank `comm` speaks for. Collective: every rank
    /// calls it. Checks that every rank built the same model (names,
    /// shapes, dtypes) and copies rank 0's parameters and buffers to all.
    pub fn new(module: M, comm: Arc<dyn Collective>) -> Result<Self> {
        let named = module.named_tensors();
        // The collectives carry f32: every other dtype but f64 survives the
        // trip exactly (integers up to 2^24); f64 would be rounded.
        if let Some((name, _)) = named.iter().find(|(_, p)| p.value().dtype() == DType::F64) {
            return Err(Error::DType {
                op: "DistributedDataParallel::new",
                msg: format!("{name} is f64, and gradients and parameters travel as f32: convert the model to f32 (or bf16/f16)"),
            });
        }
        let (sig, numel) = signature(&named);
        let all = comm.all_gather(&[named.len() as u64, numel, sig])?;
        if let Some(bad) = all.iter().position(|v| v != &all[0]) {
            let why = format!(
                "ranks disagree on the model: rank 0 has {} tensors ({} values, layout digest {:016x}), rank {bad} has {} tensors ({} values, digest {:016x})",
                all[0][0], all[0][1], all[0][2], all[bad][0], all[bad][1], all[bad][2]
            );
            return Err(Error::Distributed { op: "DistributedDataParallel::new", msg: why });
        }
        let ddp = DistributedDataParallel {
            params: module.parameters(),
            module,
            comm,
            first_bucket_bytes: FIRST_BUCKET_BYTES,
            bucket_bytes: BUCKET_BYTES,
            tables: std::sync::OnceLock::new(),
            stats: Mutex::new(SyncStats::default()),
            reducer: Mutex::new(Reducer::default()),
            overlap: true,
        };
        ddp.broadcast_state(&named)?;
        Ok(ddp)
    }

    /// Reduce gradients in buckets of about `bytes` (f32) after a first
    /// bucket of `first` bytes; PyTorch's defaults are 1 MiB and 25 MiB.
    pub fn with_bucket_bytes(mut self, first: usize, bytes: usize) -> Self {
        self.set_bucket_bytes(first, bytes);
        self
    }

    /// As [`with_bucket_bytes`](Self::with_bucket_bytes), in place.
    pub fn set_bucket_bytes(&mut self, first: usize, bytes: usize) {
        self.first_bucket_bytes = first.max(4);
        self.bucket_bytes = bytes.max(4);
        // Which tables exchange rows depends on the bucket size.
        self.tables = std::sync::OnceLock::new();
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// Give the module back.
    pub fn into_inner(self) -> M {
        self.module
    }

    /// Keep the sums on the calling thread, before `backward` returns (for
    /// replicas that share one wgpu device).
    pub(crate) fn without_overlap(mut self) -> Self {
        self.overlap = false;
        self
    }

    /// The collective this replica reduces through.
    pub fn comm(&self) -> &Arc<dyn Collective> {
        &self.comm
    }

    /// What the last [`backward`](Self::backward) spent on synchronising.
    pub fn last_sync(&self) -> SyncStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copy rank 0's parameters and buffers to every rank, bucket by bucket.
    fn broadcast_state(&self, named: &[(String, Parameter)]) -> Result<()> {
        let _g = crate::NoGradGuard::new();
        for chunk in buckets(named.iter().map(|(_, p)| p.value().numel() * 4), self.bucket_bytes, self.bucket_bytes) {
            let vals: Vec<Tensor> = chunk.iter().map(|&i| named[i].1.value()).collect();
            let flat = flat_f32(&vals)?;
            let mut host = finish_f32(flat.read_start()?)?;
            self.comm.broadcast(&mut host, 0)?;
            // Each tensor gets a buffer of its own (a view of one flat
            // buffer would keep all of it alive for any one of them).
            let mut at = 0;
            for (&i, v) in chunk.iter().zip(&vals) {
                let part = Tensor::from_vec(host[at..at + v.numel()].to_vec(), v.dims(), v.device())?.to_dtype(v.dtype())?;
                at += v.numel();
                named[i].1.set(part.realize()?.clone())?;
            }
        }
        Ok(())
    }

    /// Backpropagate `loss` (this replica's part of the batch, as a mean
    /// over its examples) weighted by `share`, this replica's fraction of
    /// the global batch, then replace every parameter's gradient by the sum
    /// over the ranks: the gradient of the whole batch's mean loss, as one
    /// device computing it would have. Returns the whole batch's loss (the
    /// weighted sum over the ranks) as a one-element f32 tensor. Collective:
    /// every rank calls it once per step, also a rank with an empty part
    /// (`share` 0).
    ///
    /// Buckets are formed from the last parameters backwards (their
    /// gradients are ready first); each is realised, read back and reduced
    /// while the device computes the next. On a GPU every bucket's read is
    /// started first and the sums (the loss's with the last bucket) run in
    /// order on a thread of this replica's own after this returns: the
    /// optimizer step and the next forward and backward passes are recorded
    /// and encoded meanwhile, held back from the device until the sums are
    /// uploaded (then submitted at once), so the device does not wait for
    /// that host work between steps. Anything that reads those gradients or
    /// the loss waits for them (`VOLTAIC_DDP_OVERLAP=0` sums each bucket
    /// before returning, as the CPU does). Call
    /// [`synchronize`](Self::synchronize) before a collective of your own on
    /// [`comm`](Self::comm).
    pub fn backward(&self, loss: &Tensor, share: f64) -> Result<Tensor> {
        if !share.is_finite() || !(0.0..=1.0).contains(&share) {
            return Err(Error::Value { op: "DistributedDataParallel::backward", msg: format!("share must be in [0, 1], got {share}") });
        }
        if loss.numel() != 1 {
            return Err(Error::Shape { op: "DistributedDataParallel::backward", msg: format!("expected a one-element loss, got shape {:?}", loss.dims()) });
        }
        let start = Instant::now();
        // The forward pass goes to the device now, so that it computes
        // while the backward pass is recorded and its first bucket
        // scheduled: a step cannot overlap the one before (its parameters
        // wait for the sum), so this is the only work to hide that behind.
        if share > 0.0 {
            loss.realize()?;
        }
        let submitted = start.elapsed().as_secs_f64();
        // An empty part's mean is NaN: it contributes zero, not NaN.
        let weighted = if share > 0.0 { loss.mul(share)? } else { Tensor::zeros(loss.dims(), DType::F32, loss.device())? };
        if share > 0.0 {
            weighted.backward()?;
        }
        let _g = crate::NoGradGuard::new();
        let mut stats = SyncStats { backward_seconds: start.elapsed().as_secs_f64() - submitted, realize_seconds: submitted, ..Default::default() };
        // Last parameters first: backward reaches them first.
        let order: Vec<usize> = (0..self.params.len()).rev().collect();
        let numels: Vec<usize> = order.iter().map(|&i| self.params[i].value().numel()).collect();
        let by_param = self.tables()?;
        let rows: Vec<bool> = order.iter().map(|&i| by_param[i]).collect();
        // A table whose rows travel is a bucket of its own.
        let sizes = numels.iter().zip(&rows).map(|(n, &r)| if r { (n * 4).max(self.bucket_bytes) } else { n * 4 });
        let mut plan: Vec<Slot> = Vec::new();
        for b in buckets(sizes, self.first_bucket_bytes, self.bucket_bytes) {
            match b[..] {
                [i] if rows[i] => plan.push(Slot::Rows(order[i])),
                _ => plan.extend(pieces(&[b], &numels, self.bucket_bytes).into_iter().map(|c| Slot::Sum(c.iter().map(|p| Piece { param: order[p.param], ..*p }).collect()))),
            }
        }
        // The loss travels with the last bucket summed whole.
        let carrier = match plan.iter().rposition(|s| matches!(s, Slot::Sum(_))) {
            Some(at) => at,
            None => {
                plan.push(Slot::Sum(Vec::new()));
                plan.len() - 1
            }
        };
        let n_buckets = plan.len();
        // On a GPU every bucket is realized and its read started first, so
        // the device computes the whole backward pass without waiting for
        // the host, and the sums run in order on the reducer thread while
        // this one records on (see above). Otherwise a bucket is summed here
        // while the device computes the next one.
        let defer = self.overlap && overlap() && loss.device().is_gpu() && !cfg!(target_arch = "wasm32");
        if defer {
            let (read, reduce) = self.reducer.lock().unwrap_or_else(|e| e.into_inner()).reap(false)?;
            stats.read_seconds += read;
            stats.reduce_seconds += reduce;
        }
        let mut in_flight: Vec<InFlight> = Vec::new();
        // The pieces of a large gradient summed so far.
        let mut partial: Vec<Tensor> = Vec::new();
        let mut global_loss = None;
        for (b, slot) in plan.into_iter().enumerate() {
            let t = Instant::now();
            let bucket = match slot {
                Slot::Sum(members) => {
                    let mut grads: Vec<Tensor> = Vec::with_capacity(members.len() + 1);
                    for p in &members {
                        let v = self.params[p.param].value();
                        let g = match self.params[p.param].grad() {
                            Some(g) => g,
                            // A parameter the loss did not reach: zeros, so that every
                            // rank's buckets have the same layout.
                            None => Tensor::zeros(v.dims(), v.dtype(), v.device())?,
                        };
                        grads.push(if p.len == v.numel() { g } else { g.flatten_all()?.narrow(0, p.start, p.len)? });
                    }
                    if b == carrier {
                        grads.push(weighted.detach());
                    }
                    let flat = flat_f32(&grads)?;
                    let read = flat.read_start_in_place()?;
                    InFlight { what: Exchange::Sum(members), flat: Some(flat), read: Some(read), loss: b == carrier }
                }
                Slot::Rows(param) => {
                    // The rows the batch touched and their ids (exact in f32
                    // below 2^24 rows, which `tables` checks), or the
                    // whole gradient where it is not a scatter of rows.
                    let (sparse, flat) = match self.params[param].grad() {
                        None => (true, None),
                        Some(g) => match g.as_row_scatter() {
                            Some((ids, src)) => (true, Some(flat_f32(&[ids, src])?)),
                            None => (false, Some(flat_f32(&[g])?)),
                        },
                    };
                    let read = flat.as_ref().map(|f| f.read_start_in_place()).transpose()?;
                    stats.row_tables += sparse as usize;
                    InFlight { what: Exchange::Rows { param, sparse }, flat, read, loss: false }
                }
            };
            stats.realize_seconds += t.elapsed().as_secs_f64();
            if !defer {
                if let Some(prev) = in_flight.pop() {
                    global_loss = self.reduce(prev, &mut stats, &mut partial, false)?.or(global_loss);
                }
            }
            in_flight.push(bucket);
        }
        for bucket in in_flight {
            if let Some(l) = self.reduce(bucket, &mut stats, &mut partial, defer)? {
                global_loss = Some(l);
            }
        }
        stats.buckets = n_buckets;
        stats.total_seconds = start.elapsed().as_secs_f64();
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        global_loss.ok_or_else(|| Error::Backend("internal: DistributedDataParallel::backward reduced no last bucket".into()))
    }

    /// Wait until the buckets of the last step are summed and uploaded
    /// (see [`backward`](Self::backward)); the first error, if one failed.
    pub fn synchronize(&self) -> Result<()> {
        self.settle(None)
    }

    /// Wait for the reducer thread's buckets, if any are out; their read
    /// and reduce seconds count in `stats` (the step that waits for them).
    fn settle(&self, stats: Option<&mut SyncStats>) -> Result<()> {
        let (read, reduce) = self.reducer.lock().unwrap_or_else(|e| e.into_inner()).reap(true)?;
        if let Some(s) = stats {
            s.read_seconds += read;
            s.reduce_seconds += reduce;
        }
        Ok(())
    }

    /// Which parameters' gradients travel as the rows a batch touched (see
    /// [`Tensor::as_row_scatter`]): tables large enough to travel in
    /// pieces whose gradient is a scatter of rows on some rank in the
    /// first step, agreed on then by every rank (a collective, that once,
    /// where any parameter could be one) and kept. A later step where a
    /// rank's gradient of one is no scatter of rows sums it whole.
    /// `VOLTAIC_DDP_ROWS=0` sums every gradient whole.
    fn tables(&self) -> Result<Vec<bool>> {
        if let Some(t) = self.tables.get() {
            return Ok(t.clone());
        }
        // Decided alike on every rank, from shapes alone.
        let may = |p: &Parameter| {
            let v = p.value();
            rows_exchange() && self.comm.world_size() > 1 && v.rank() == 2 && v.dtype().is_float() && v.numel() > (self.bucket_bytes / 8).max(1 << 10) && v.dims()[0] < MAX_EXACT_ROWS
        };
        let agreed = if self.params.iter().any(may) {
            let mine: Vec<u64> = self.params.iter().map(|p| (may(p) && p.grad().is_some_and(|g| g.as_row_scatter().is_some())) as u64).collect();
            // One collective at a time per rank: the reducer's come first.
            self.settle(None)?;
            let all = self.comm.all_gather(&mine)?;
            (0..self.params.len()).map(|i| all.iter().any(|r| r[i] == 1)).collect()
        } else {
            vec![false; self.params.len()]
        };
        Ok(self.tables.get_or_init(|| agreed).clone())
    }

    /// Sum one bucket over the ranks and give each parameter its part:
    /// for summed buckets a view of one uploaded buffer (the last summed
    /// bucket carries the loss as its last value, returned as a view too),
    /// for a table's rows its gradient gathered on the device from the
    /// summed rows. The sums go from the memory a bucket was read back into
    /// straight into the memory it is uploaded from: on a GPU both are
    /// mapped staging buffers, and the host touches each value once. With
    /// `defer` the sum is left to the reducer thread (buckets in order),
    /// the upload's values to come.
    fn reduce(&self, bucket: InFlight, stats: &mut SyncStats, partial: &mut Vec<Tensor>, defer: bool) -> Result<Option<Tensor>> {
        let InFlight { what, flat, read, loss: last } = bucket;
        let device = match (&what, &flat) {
            (Exchange::Rows { param, .. }, _) => self.params[*param].value().device(),
            (_, Some(f)) => f.device(),
            (_, None) => return Err(Error::Backend("internal: a summed bucket without values".into())),
        };
        let read_bytes = flat.as_ref().map_or(0, |f| f.numel() * 4);
        let n = match &what {
            Exchange::Sum(members) => members.iter().map(|p| p.len).sum::<usize>() + last as usize,
            Exchange::Rows { param, .. } => {
                let d = self.params[*param].value().dims().to_vec();
                d[0] + (d[0] + 1) * d[1]
            }
        };
        // How this bucket's values become the sums, given where they go.
        let comm = self.comm.clone();
        let mut sum: Box<SumJob> = match &what {
            Exchange::Sum(_) => {
                let mut read = read;
                Box::new(move |upload| sum_bucket(&*comm, read.take(), n, upload))
            }
            Exchange::Rows { param, sparse } => {
                let d = self.params[*param].value().dims().to_vec();
                let (mut read, sparse) = (read, *sparse);
                Box::new(move |upload| sum_rows(&*comm, read.take(), sparse, d[0], d[1], upload))
            }
        };
        let later = if defer { Tensor::from_f32_later(n, device)? } else { None };
        let summed = match later {
            Some((summed, fill)) => {
                let comm = self.comm.clone();
                let mut fill = Some(fill);
                self.reducer.lock().unwrap_or_else(|e| e.into_inner()).start(Box::new(move || {
                    // Dropped unwritten on an error: NaN for whatever reads it.
                    let sums = sum(&mut |values| fill.take().map_or(Ok(()), |f| f.fill(values)));
                    drop(flat);
                    if let Err(e) = &sums {
                        // The other ranks wait in this collective.
                        comm.abort(&e.to_string());
                    }
                    sums
                }))?;
                summed
            }
            None => {
                // One collective at a time per rank: the reducer's come first.
                self.settle(Some(stats))?;
                let mut summed = None;
                let (read_s, reduce_s) = sum(&mut |values| {
                    summed = Some(Tensor::from_f32_fill(n, device, &mut |dst| values(dst).map(|_| ()))?);
                    Ok(())
                })?;
                drop(flat);
                stats.read_seconds += read_s;
                stats.reduce_seconds += reduce_s;
                summed.ok_or_else(|| Error::Backend("internal: a gradient bucket was not uploaded".into()))?
            }
        };
        let members = match what {
            Exchange::Sum(members) => members,
            Exchange::Rows { param, .. } => {
                let v = self.params[param].value();
                let (rows, d) = (v.dims()[0], v.dims()[1]);
                // What this rank read back: its rows, or its whole gradient.
                stats.bytes += read_bytes;
                // `[rows]` positions into `[rows + 1, d]` summed rows (the
                // last one zeros, for the rows no rank touched).
                let at = summed.narrow(0, 0, rows)?.to_dtype(DType::I32)?;
                let g = summed.narrow(0, rows, (rows + 1) * d)?.reshape_dims(&[rows + 1, d])?.index_select(0, &at)?;
                v.set_grad(Some(if g.dtype() == v.dtype() { g } else { g.to_dtype(v.dtype())? }))?;
                return Ok(None);
            }
        };
        stats.bytes += n * 4;
        let mut at = 0;
        for p in &members {
            let v = self.params[p.param].value();
            let part = summed.narrow(0, at, p.len)?;
            at += p.len;
            let g = if p.len == v.numel() {
                part
            } else {
                // A piece of a large gradient: the gradient once its last
                // piece is here (the pieces arrive in order).
                partial.push(part);
                if p.start + p.len < v.numel() {
                    continue;
                }
                let parts: Vec<Tensor> = std::mem::take(partial);
                let refs: Vec<&Tensor> = parts.iter().collect();
                Tensor::cat(&refs, 0)?
            };
            let g = g.reshape_dims(v.dims())?;
            v.set_grad(Some(if g.dtype() == v.dtype() { g } else { g.to_dtype(v.dtype())? }))?;
        }
        if !last {
            return Ok(None);
        }
        // Realized at once (held back with the sums on a GPU), so that the
        // loss does not keep the whole bucket's buffer alive.
        let loss = summed.narrow(0, n - 1, 1)?.reshape_dims(&[])?.copied()?;
        loss.realize()?;
        Ok(Some(loss))
    }
}

/// Tables of at most this many rows may exchange rows: their ids travel as
/// f32 values, exact below 2^24.
const MAX_EXACT_ROWS: usize = 1 << 24;

/// Whether large tables exchange the rows a batch touched
/// (`VOLTAIC_DDP_ROWS=0`: their whole gradients are summed).
fn rows_exchange() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_DDP_ROWS").map_or(true, |v| v != "0"))
}

/// What one bucket of a step exchanges.
enum Slot {
    /// Gradients (or pieces of one) summed element by element.
    Sum(Vec<Piece>),
    /// A table's gradient, as the rows each rank's batch touched.
    Rows(usize),
}

/// A bucket whose read has started.
struct InFlight {
    what: Exchange,
    /// The flat tensor read (held until its read completes).
    flat: Option<Tensor>,
    /// `None` for a table that this rank's backward pass did not reach.
    read: Option<PendingRead>,
    /// Whether the loss travels as its last value.
    loss: bool,
}

/// What a bucket in flight carries.
enum Exchange {
    Sum(Vec<Piece>),
    /// Parameter `param`'s gradient: read as `[ids (T) | rows (T x D)]`
    /// where `sparse`, else whole.
    Rows { param: usize, sparse: bool },
}

/// Whether a GPU's buckets are summed on the reducer thread while the next
/// step is recorded (`VOLTAIC_DDP_OVERLAP=0`: before `backward` returns).
fn overlap() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_DDP_OVERLAP").map_or(true, |v| v != "0"))
}

/// Hands the memory a bucket's sums are uploaded from to its argument,
/// which returns how many leading values it wrote.
type Upload<'a> = dyn FnMut(&mut dyn FnMut(&mut [f32]) -> Result<usize>) -> Result<()> + 'a;

/// One bucket's sum over the ranks into what `Upload` offers: its read and
/// reduce seconds.
type SumJob = dyn FnMut(&mut Upload) -> Result<(f64, f64)> + Send;

/// Wait for a bucket's read (`n` values) and sum it over the ranks into
/// the memory `upload` offers. Returns the seconds spent reading and
/// reducing.
fn sum_bucket(comm: &dyn Collective, read: Option<PendingRead>, n: usize, upload: &mut Upload) -> Result<(f64, f64)> {
    let t = Instant::now();
    let host = read.ok_or_else(|| Error::Backend("internal: a gradient bucket had no read".into()))?.wait()?;
    let read_seconds = t.elapsed().as_secs_f64();
    // A flat f32 tensor read in place is always seen as f32 values.
    let src = host.as_f32().ok_or_else(|| Error::Backend("DistributedDataParallel: a gradient bucket did not read back as f32".into()))?;
    if src.len() != n {
        return Err(Error::Backend(format!("internal: a gradient bucket of {n} values read back {}", src.len())));
    }
    let mut reduce_seconds = 0.0;
    upload(&mut |dst| {
        let t = Instant::now();
        let r = comm.all_reduce_sum_into(src, dst);
        reduce_seconds = t.elapsed().as_secs_f64();
        r.map(|_| n)
    })?;
    Ok((read_seconds, reduce_seconds))
}

/// Wait for a table's read and sum its gradient (`rows` x `d`) over the
/// ranks into the memory `upload` offers, as `[rows]` positions (f32)
/// followed by the summed rows and a row of zeros that the rows no rank
/// touched point to. Where every rank read the rows its batch touched
/// (`sparse`: `[ids | rows]`; no read for none), they are gathered and
/// each row id's rows added in rank and batch order, as one device adds
/// them for the whole batch; only the rows touched travel to the device.
/// Where any rank read its whole gradient (not a scatter of rows), every
/// rank sums whole gradients. Returns the seconds spent reading and
/// reducing.
fn sum_rows(comm: &dyn Collective, read: Option<PendingRead>, sparse: bool, rows: usize, d: usize, upload: &mut Upload) -> Result<(f64, f64)> {
    let t = Instant::now();
    let host = read.map(|r| r.wait()).transpose()?;
    let read_seconds = t.elapsed().as_secs_f64();
    let src = match &host {
        Some(h) => h.as_f32().ok_or_else(|| Error::Backend("DistributedDataParallel: a gradient bucket did not read back as f32".into()))?,
        None => &[],
    };
    let t = Instant::now();
    let kinds = comm.all_gather(&[sparse as u64])?;
    if kinds.iter().all(|k| k[0] == 1) {
        comm.all_gather_f32(src, &mut |parts| upload(&mut |dst| merge_rows(parts, rows, d, dst)))?;
    } else {
        let own: std::borrow::Cow<[f32]> = if sparse { scatter_rows(src, rows, d)?.into() } else { src.into() };
        if own.len() != rows * d {
            return Err(Error::Backend(format!("internal: a {rows}x{d} gradient read back {} values", own.len())));
        }
        upload(&mut |dst| {
            for (r, x) in dst[..rows].iter_mut().enumerate() {
                *x = r as f32;
            }
            comm.all_reduce_sum_into(&own, &mut dst[rows..rows + rows * d])?;
            dst[rows + rows * d..rows + (rows + 1) * d].fill(0.0);
            Ok(rows + (rows + 1) * d)
        })?;
    }
    Ok((read_seconds, t.elapsed().as_secs_f64()))
}

/// The ids of a `[ids (T) | rows (T x d)]` read, checked against `rows`.
fn split_rows(part: &[f32], rows: usize, d: usize) -> Result<(&[f32], &[f32])> {
    let t = part.len() / (d + 1);
    if t * (d + 1) != part.len() {
        return Err(Error::Backend(format!("internal: {} values are no whole rows of {d} with their ids", part.len())));
    }
    let (ids, values) = part.split_at(t);
    if let Some(bad) = ids.iter().find(|&&x| !(x >= 0.0 && x < rows as f32 && x.fract() == 0.0)) {
        return Err(Error::Backend(format!("internal: row id {bad} of a table of {rows} rows")));
    }
    Ok((ids, values))
}

/// A whole `rows` x `d` gradient from a `[ids | rows]` read: each row
/// added into zeros in batch order, as the CPU's `scatter_add`.
fn scatter_rows(part: &[f32], rows: usize, d: usize) -> Result<Vec<f32>> {
    let (ids, values) = split_rows(part, rows, d)?;
    let mut out = vec![0f32; rows * d];
    for (&id, row) in ids.iter().zip(values.chunks_exact(d.max(1))) {
        for (o, x) in out[id as usize * d..][..d].iter_mut().zip(row) {
            *o += x;
        }
    }
    Ok(out)
}

/// Every rank's `[ids | rows]` (`parts`, in rank order) summed by row id
/// into `dst`, as [`sum_rows`] lays it out; the ids are numbered in order
/// of first appearance and each id's rows added in rank and batch order.
/// Returns the values written (`rows` positions, then one summed row per
/// id and a row of zeros). Every rank computes the same bits.
fn merge_rows(parts: &[&[f32]], rows: usize, d: usize, dst: &mut [f32]) -> Result<usize> {
    let split: Vec<(&[f32], &[f32])> = parts.iter().map(|p| split_rows(p, rows, d)).collect::<Result<_>>()?;
    // Each id's number among those seen, and how many rows each number adds.
    let mut slot = vec![u32::MAX; rows];
    let mut count: Vec<u32> = Vec::new();
    for (ids, _) in &split {
        for &id in ids.iter() {
            let s = &mut slot[id as usize];
            if *s == u32::MAX {
                *s = count.len() as u32;
                count.push(0);
            }
            count[*s as usize] += 1;
        }
    }
    let touched = count.len();
    let written = rows + (touched + 1) * d;
    if dst.len() < written {
        return Err(Error::Backend(format!("internal: {written} values of summed rows for an upload of {}", dst.len())));
    }
    // Where each number's rows start in `from`, which lists (rank, row)
    // by number, each number's in rank and batch order.
    let mut start = Vec::with_capacity(touched + 1);
    let mut acc = 0usize;
    for &c in &count {
        start.push(acc);
        acc += c as usize;
    }
    start.push(acc);
    let mut next = start.clone();
    let mut from = vec![(0u32, 0u32); acc];
    for (r, (ids, _)) in split.iter().enumerate() {
        for (j, &id) in ids.iter().enumerate() {
            let s = slot[id as usize] as usize;
            from[next[s]] = (r as u32, j as u32);
            next[s] += 1;
        }
    }
    for (x, &s) in dst[..rows].iter_mut().zip(&slot) {
        *x = if s == u32::MAX { touched as f32 } else { s as f32 };
    }
    // The memory may be write-combined: each row is added up in `sum` and
    // stored once.
    let add = |first: usize, out: &mut [f32]| {
        let mut sum = vec![0f32; d];
        for (k, row) in out.chunks_exact_mut(d.max(1)).enumerate() {
            let s = first + k;
            if s == touched {
                row.fill(0.0);
                continue;
            }
            for (i, &(r, j)) in from[start[s]..start[s + 1]].iter().enumerate() {
                let values = &split[r as usize].1[j as usize * d..][..d];
                if i == 0 {
                    sum.copy_from_slice(values);
                } else {
                    for (a, x) in sum.iter_mut().zip(values) {
                        *a += x;
                    }
                }
            }
            row.copy_from_slice(&sum);
        }
    };
    let out = &mut dst[rows..written];
    // Blocks of about 64K values, on the CPU's threads.
    let block = (d * ((1 << 16) / d.max(1)).max(1)).max(1);
    #[cfg(not(target_arch = "wasm32"))]
    {
        use rayon::prelude::*;
        out.par_chunks_mut(block).enumerate().for_each(|(c, o)| add(c * block / d.max(1), o));
    }
    #[cfg(target_arch = "wasm32")]
    for (c, o) in out.chunks_mut(block).enumerate() {
        add(c * block / d.max(1), o);
    }
    Ok(written)
}

/// A bucket summed off the replica's thread: its read and reduce seconds.
type Sums = Result<(f64, f64)>;

type Job = Box<dyn FnOnce() -> Sums + Send>;

/// One long-lived thread per replica that sums gradient buckets in the
/// order given (a thread per step costs more than the work it hides; see
/// `workers`). The buckets of at most about one step are out at a time: the
/// next step's first read is submitted only after they are uploaded.
#[derive(Default)]
struct Reducer {
    /// The thread, and the channel its jobs report on.
    thread: Option<(Workers, mpsc::Sender<Sums>, mpsc::Receiver<Sums>)>,
    /// Jobs given and not yet reaped.
    out: usize,
}

fn stopped() -> Error {
    Error::Distributed { op: "DistributedDataParallel::backward", msg: "the thread summing gradients has stopped".into() }
}

impl Reducer {
    /// Hand `job` to the thread (started on first use).
    fn start(&mut self, job: Job) -> Result<()> {
        if self.thread.is_none() {
            let workers = Workers::named(1, "voltaic-reduce")
                .map_err(|e| Error::Distributed { op: "DistributedDataParallel::backward", msg: format!("could not start a thread to sum gradients: {e}") })?;
            let (tx, done) = mpsc::channel();
            self.thread = Some((workers, tx, done));
        }
        let (workers, tx, _) = self.thread.as_ref().expect("started");
        let tx = tx.clone();
        // Every job reports (panics caught), so `reap` never waits for one
        // that was lost; the thread ends only with the reducer.
        let sent = workers.send(0, move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                .unwrap_or_else(|_| Err(Error::Distributed { op: "DistributedDataParallel::backward", msg: "the thread summing gradients panicked".into() }));
            let _ = tx.send(r);
        });
        if !sent {
            return Err(stopped());
        }
        self.out += 1;
        Ok(())
    }

    /// The finished jobs' seconds added up (with `block`, all of them,
    /// waiting), or the first error among them.
    fn reap(&mut self, block: bool) -> Sums {
        let mut total = (0.0, 0.0);
        let mut first: Option<Error> = None;
        while self.out > 0 {
            let Some((_, _, done)) = self.thread.as_ref() else { break };
            let r = if block {
                done.recv().unwrap_or_else(|_| Err(stopped()))
            } else {
                match done.try_recv() {
                    Ok(r) => r,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => Err(stopped()),
                }
            };
            self.out -= 1;
            match r {
                Ok((read, reduce)) => {
                    total.0 += read;
                    total.1 += reduce;
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(total), Err)
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        // Its last sums end before the thread (joined as the field drops).
        let _ = self.reap(true);
    }
}

/// The tensors as one flat f32 vector (lazy: fused into one kernel).
fn flat_f32(ts: &[Tensor]) -> Result<Tensor> {
    let parts: Vec<Tensor> = ts.iter().map(|t| t.to_dtype(DType::F32)?.flatten_all()).collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = parts.iter().collect();
    if refs.len() == 1 {
        return refs[0].contiguous();
    }
    Tensor::cat(&refs, 0)
}

/// A run of one parameter's gradient values (flattened): all of them, or
/// a piece of a gradient too large for one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    param: usize,
    start: usize,
    len: usize,
}

/// The buckets of `buckets` as pieces of the items (`numels[i]` values
/// each): an item alone in its bucket and larger than half a bucket
/// (`rest` bytes; at least 4 KiB) travels in pieces of at most that, each a bucket
/// of its own. The word embedding, the last and largest gradient of a
/// language model, then is read back, summed and uploaded piece after
/// piece, one piece's transfer overlapping the next one's sum, instead of
/// each step in turn over all of it.
fn pieces(buckets: &[Vec<usize>], numels: &[usize], rest: usize) -> Vec<Vec<Piece>> {
    // Not below 1,024 values: tiny buckets (a test's) need no tiny pieces.
    let max = (rest / 8).max(1 << 10);
    let mut out = Vec::new();
    for b in buckets {
        if let [i] = b[..] {
            let n = numels[i];
            if n > max {
                let k = n.div_ceil(max);
                for j in 0..k {
                    let (start, end) = (n * j / k, n * (j + 1) / k);
                    out.push(vec![Piece { param: i, start, len: end - start }]);
                }
                continue;
            }
        }
        out.push(b.iter().map(|&i| Piece { param: i, start: 0, len: numels[i] }).collect());
    }
    out
}

/// Group consecutive items of `sizes` (bytes) into buckets: the first of
/// at least `first` bytes, the rest of at least `rest` (an item is never
/// split), except that an item of `rest` bytes or more closes the bucket
/// before it and travels alone: a large last tensor (a word embedding)
/// then does not hold back the smaller ones before it. Indices into `sizes`.
fn buckets(sizes: impl Iterator<Item = usize>, first: usize, rest: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur = Vec::new();
    let mut bytes = 0;
    for (i, s) in sizes.enumerate() {
        if s >= rest && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        cur.push(i);
        bytes += s;
        let cap = if out.is_empty() { first } else { rest };
        if bytes >= cap {
            out.push(std::mem::take(&mut cur));
            bytes = 0;
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{buckets, merge_rows, pieces, scatter_rows, Piece};

    /// `[ids | rows]` of `t` rows of `d` values drawn from `rows` ids.
    fn part(seed: u64, t: usize, d: usize, rows: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let ids: Vec<f32> = (0..t).map(|_| (next() % rows as u64) as f32).collect();
        let values: Vec<f32> = (0..t * d).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        [ids, values].concat()
    }

    #[test]
    fn merged_rows_are_the_sum_of_every_ranks_scattered_rows() {
        let (rows, d) = (50, 7);
        // Ranks of 40, 0 and 13 rows: ids repeat within and across them.
        let parts = [part(1, 40, d, rows), part(2, 0, d, rows), part(3, 13, d, rows)];
        let refs: Vec<&[f32]> = parts.iter().map(|p| &p[..]).collect();
        let mut dst = vec![f32::NAN; rows + (rows + 1) * d];
        let written = merge_rows(&refs, rows, d, &mut dst).unwrap();
        // The whole gradient from positions and rows, against the sum of
        // each rank's scatter (f64: the orders of addition differ).
        let mut want = vec![0f64; rows * d];
        for p in &parts {
            for (w, x) in want.iter_mut().zip(scatter_rows(p, rows, d).unwrap()) {
                *w += x as f64;
            }
        }
        let touched = (written - rows) / d - 1;
        assert_eq!(written, rows + (touched + 1) * d);
        let mut ids: Vec<u32> = parts.iter().flat_map(|p| p[..p.len() / (d + 1)].iter().map(|&x| x as u32)).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(touched, ids.len(), "one summed row per id touched");
        for r in 0..rows {
            let at = dst[r] as usize;
            assert!(at <= touched);
            assert_eq!(at == touched, !ids.contains(&(r as u32)), "row {r}");
            for j in 0..d {
                let got = dst[rows + at * d + j] as f64;
                assert!((got - want[r * d + j]).abs() < 1e-5, "row {r}, column {j}: {got} against {}", want[r * d + j]);
            }
        }
        // One rank: each id's rows in batch order, as `scatter_add` on the CPU.
        let one = merge_rows(&refs[..1], rows, d, &mut dst).unwrap();
        let whole = scatter_rows(&parts[0], rows, d).unwrap();
        for r in 0..rows {
            let at = dst[r] as usize;
            assert_eq!(&dst[rows + at * d..][..d], &whole[r * d..][..d], "row {r}");
        }
        assert!(one < rows + (rows + 1) * d);
        // Ids out of the table, or a part of no whole rows: errors.
        let mut bad = parts[0].clone();
        bad[3] = rows as f32;
        assert!(merge_rows(&[&bad], rows, d, &mut dst).unwrap_err().to_string().contains("row id 50 of a table of 50 rows"));
        assert!(merge_rows(&[&parts[0][1..]], rows, d, &mut dst).unwrap_err().to_string().contains("no whole rows"));
    }

    #[test]
    fn a_gradient_larger_than_half_a_bucket_travels_in_pieces() {
        // Values of 4 bytes; buckets of 40,960 bytes: pieces of at most
        // 5,120 values.
        let k = 1024;
        let numels = [2 * k, 3 * k, 11 * k, k, 4 * k];
        let b = buckets(numels.iter().map(|n| n * 4), 12 * k, 40 * k);
        assert_eq!(b, vec![vec![0, 1], vec![2], vec![3, 4]]);
        let p = pieces(&b, &numels, 40 * k);
        let whole = |param, len| Piece { param, start: 0, len };
        assert_eq!(
            p,
            vec![
                vec![whole(0, 2 * k), whole(1, 3 * k)],
                vec![Piece { param: 2, start: 0, len: 3754 }],
                vec![Piece { param: 2, start: 3754, len: 3755 }],
                vec![Piece { param: 2, start: 7509, len: 3755 }],
                vec![whole(3, k), whole(4, 4 * k)],
            ]
        );
        // A tensor alone in its bucket but small stays whole; pieces are
        // never below 1,024 values.
        assert_eq!(pieces(&[vec![0]], &[5 * k], 40 * k), vec![vec![whole(0, 5 * k)]]);
        assert_eq!(pieces(&[vec![0]], &[2 * k + 1], 4).len(), 3);
    }

    #[test]
    fn buckets_start_small_and_never_split_a_tensor() {
        let b = buckets([10, 10, 10, 30, 5, 5, 5].into_iter(), 15, 40);
        assert_eq!(b, vec![vec![0, 1], vec![2, 3], vec![4, 5, 6]]);
        // A large item travels alone.
        let b = buckets([10, 10, 10, 50, 5, 5, 5, 60].into_iter(), 15, 40);
        assert_eq!(b, vec![vec![0, 1], vec![2], vec![3], vec![4, 5, 6], vec![7]]);
        assert!(buckets(std::iter::empty(), 1, 1).is_empty());
    }
}
