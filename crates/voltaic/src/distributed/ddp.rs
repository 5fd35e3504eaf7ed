//! One replica of data-parallel training: its module, and the bucketed
//! all-reduce that turns its gradients into the whole batch's.

use super::collective::Collective;
use crate::backend::PendingRead;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::nn::{Module, Parameter};
use crate::tensor::Tensor;
use std::sync::{Arc, Mutex};
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
    /// gradients, reading them back, reducing, uploading).
    pub total_seconds: f64,
    /// Inside the collective (waiting for the peers and adding).
    pub reduce_seconds: f64,
    /// Waiting for the device to compute and return a bucket.
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
/// assert!((global - loss.item::<f32>()? as f64).abs() < 1e-6);
/// assert!(ddp.module().parameters()[0].grad().is_some());
/// # Ok::<(), voltaic::Error>(())
/// ```
pub struct DistributedDataParallel<M> {
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
    /// weighted sum over the ranks). Collective: every rank calls it once
    /// per step, also a rank with an empty part (`share` 0).
    ///
    /// Buckets are formed from the last parameters backwards (their
    /// gradients are ready first); each is realised, read back and reduced
    /// while the device computes the next.
    pub fn backward(&self, loss: &Tensor, share: f64) -> Result<f64> {
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
        // A bucket in flight: its pieces, its flat tensor (held until its
        // read completes) and the read.
        let mut in_flight: Option<(Vec<Piece>, Tensor, PendingRead)> = None;
        // The pieces of a large gradient summed so far.
        let mut partial: Vec<Tensor> = Vec::new();
        let mut global_loss = 0.0;
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
            if let Some((prev, pflat, pread)) = in_flight.take() {
                self.reduce(prev, pflat.device(), pread, &mut stats, &mut partial, None)?;
            }
            in_flight = Some((members, flat, read));
        }
        if let Some((prev, pflat, pread)) = in_flight.take() {
            self.reduce(prev, pflat.device(), pread, &mut stats, &mut partial, Some(&mut global_loss))?;
        }
        stats.buckets = n_buckets;
        stats.total_seconds = start.elapsed().as_secs_f64();
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        Ok(global_loss)
    }

    /// Wait for one bucket, sum it over the ranks and hand each parameter
    /// its part (a view of one uploaded buffer). The sum goes from the
    /// memory the bucket was read back into straight into the memory it is
    /// uploaded from: on a GPU both are mapped staging buffers, and the
    /// host touches each value once.
    fn reduce(&self, members: Vec<Piece>, device: crate::Device, read: PendingRead, stats: &mut SyncStats, partial: &mut Vec<Tensor>, loss: Option<&mut f64>) -> Result<()> {
        let t = Instant::now();
        let host = read.wait()?;
        stats.read_seconds += t.elapsed().as_secs_f64();
        // A flat f32 tensor read in place is always seen as f32 values.
        let src = host.as_f32().ok_or_else(|| Error::Backend("DistributedDataParallel: a gradient bucket did not read back as f32".into()))?;
        // The loss travels as the last value of the last bucket; it is
        // summed on its own, because the upload memory may not be read.
        let n = src.len() - loss.is_some() as usize;
        if let Some(l) = loss {
            let mut v = [src[n]];
            let t = Instant::now();
            self.comm.all_reduce_sum(&mut v)?;
            stats.reduce_seconds += t.elapsed().as_secs_f64();
            *l = v[0] as f64;
        }
        let src = &src[..n];
        let mut reduce_seconds = 0.0;
        let summed = Tensor::from_f32_fill(n, device, &mut |dst: &mut [f32]| {
            let t = Instant::now();
            self.comm.all_reduce_sum_into(src, dst)?;
            reduce_seconds = t.elapsed().as_secs_f64();
            Ok(())
        })?;
        stats.reduce_seconds += reduce_seconds;
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
        Ok(())
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
