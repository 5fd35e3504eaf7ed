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
    /// Bytes of gradient reduced (f32).
    pub bytes: usize,
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
        let plan = pieces(&buckets(numels.iter().map(|n| n * 4), self.first_bucket_bytes, self.bucket_bytes), &numels, self.bucket_bytes);
        let n_buckets = plan.len().max(1);
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
        // Buckets in flight: pieces, flat tensor (held until its read
        // completes) and read.
        let mut in_flight: Vec<(Vec<Piece>, Tensor, PendingRead)> = Vec::new();
        // The pieces of a large gradient summed so far.
        let mut partial: Vec<Tensor> = Vec::new();
        for b in 0..n_buckets {
            let members: Vec<Piece> = plan.get(b).map(|c| c.iter().map(|p| Piece { param: order[p.param], ..*p }).collect()).unwrap_or_default();
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
            if b + 1 == n_buckets {
                // The loss travels with the last bucket.
                grads.push(weighted.detach());
            }
            let t = Instant::now();
            let flat = flat_f32(&grads)?;
            let read = flat.read_start_in_place()?;
            stats.realize_seconds += t.elapsed().as_secs_f64();
            if !defer {
                if let Some((prev, pflat, pread)) = in_flight.pop() {
                    self.reduce(prev, pflat, pread, &mut stats, &mut partial, false, false)?;
                }
            }
            in_flight.push((members, flat, read));
        }
        let count = in_flight.len();
        let mut global_loss = None;
        for (i, (members, flat, read)) in in_flight.into_iter().enumerate() {
            let last = i + 1 == count;
            if let Some(l) = self.reduce(members, flat, read, &mut stats, &mut partial, last, defer)? {
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

    /// Sum one bucket over the ranks and hand each parameter its part (a
    /// view of one uploaded buffer); the last bucket carries the loss as
    /// its last value, returned as a view too. The sum goes from the memory
    /// the bucket was read back into straight into the memory it is
    /// uploaded from: on a GPU both are mapped staging buffers, and the host
    /// touches each value once. With `defer` the sum is left to the reducer
    /// thread (buckets in order), the upload's values to come.
    #[allow(clippy::too_many_arguments)]
    fn reduce(&self, members: Vec<Piece>, flat: Tensor, read: PendingRead, stats: &mut SyncStats, partial: &mut Vec<Tensor>, last: bool, defer: bool) -> Result<Option<Tensor>> {
        let device = flat.device();
        let n = members.iter().map(|p| p.len).sum::<usize>() + last as usize;
        let later = if defer { Tensor::from_f32_later(n, device)? } else { None };
        let summed = match later {
            Some((summed, fill)) => {
                let comm = self.comm.clone();
                let mut fill = Some(fill);
                self.reducer.lock().unwrap_or_else(|e| e.into_inner()).start(Box::new(move || {
                    // Dropped unwritten on an error: NaN for whatever reads it.
                    let sums = sum_bucket(&*comm, read, n, &mut |src, reduce| fill.take().map_or(Ok(()), |f| f.fill(&mut |dst| reduce(src, dst))));
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
                let (read_s, reduce_s) = sum_bucket(&*self.comm, read, n, &mut |src, reduce| {
                    summed = Some(Tensor::from_f32_fill(n, device, &mut |dst| reduce(src, dst))?);
                    Ok(())
                })?;
                drop(flat);
                stats.read_seconds += read_s;
                stats.reduce_seconds += reduce_s;
                summed.ok_or_else(|| Error::Backend("internal: a gradient bucket was not uploaded".into()))?
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

/// Whether a GPU's buckets are summed on the reducer thread while the next
/// step is recorded (`VOLTAIC_DDP_OVERLAP=0`: before `backward` returns).
fn overlap() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VOLTAIC_DDP_OVERLAP").map_or(true, |v| v != "0"))
}

/// Sums `src` over the ranks into `dst` (the collective's all-reduce, timed).
type SumInto<'a> = dyn FnMut(&[f32], &mut [f32]) -> Result<()> + 'a;

/// Wait for a bucket's read (`n` values) and sum it over the ranks into
/// the memory `upload` offers (it calls its second argument with the
/// values read and that memory). Returns the seconds spent reading and
/// reducing.
fn sum_bucket(
    comm: &dyn Collective,
    read: PendingRead,
    n: usize,
    upload: &mut dyn FnMut(&[f32], &mut SumInto) -> Result<()>,
) -> Result<(f64, f64)> {
    let t = Instant::now();
    let host = read.wait()?;
    let read_seconds = t.elapsed().as_secs_f64();
    // A flat f32 tensor read in place is always seen as f32 values.
    let src = host.as_f32().ok_or_else(|| Error::Backend("DistributedDataParallel: a gradient bucket did not read back as f32".into()))?;
    if src.len() != n {
        return Err(Error::Backend(format!("internal: a gradient bucket of {n} values read back {}", src.len())));
    }
    let mut reduce_seconds = 0.0;
    upload(src, &mut |src, dst| {
        let t = Instant::now();
        let r = comm.all_reduce_sum_into(src, dst);
        reduce_seconds = t.elapsed().as_secs_f64();
        r
    })?;
    Ok((read_seconds, reduce_seconds))
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
    use super::{buckets, pieces, Piece};

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
