//! A size-bucketed pool of GPU storage buffers.
//!
//! Sizes round up to one of four steps per power of two (at most 25% waste),
//! so a loop that allocates the same shapes again finds its buffers cached.
//! A [`GpuBuf`] returns its buffer to the pool when it is dropped, which the
//! scheduler arranges to happen right after the buffer's last consumer.
//!
//! Buffers are numbered as they are created, and a request takes the
//! lowest-numbered free buffer of its bucket: which buffers a step gets
//! depends on which are free, not on the order they were freed in. A
//! training loop then gets the same buffers every step or two (a weight
//! and its update alternate), and kernels find their bind groups made.

use crate::backend::MemoryStats;
use crate::dtype::DType;
use crate::error::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// Smallest bucket in bytes.
const MIN_BUCKET: u64 = 256;

/// Free buffers by bucket size, and the counts behind [`MemoryStats`].
///
/// While work is encoded but not yet submitted (`deferring`), freed buffers
/// wait in `deferred` until the submission: the pending commands may still
/// use them, and a queue write into one (an upload, a kernel's constants)
/// would run before those commands, at the start of the submission. A
/// kernel of the pending pass may take them (see [`alloc_in_pass`]).
/// Batches are numbered, and a buffer waits for the submission of the
/// last batch begun when it was freed: a batch may still be on its way to
/// the queue (see `GpuContext::hand_off`) while the next one is recorded.
pub(crate) struct Pool {
    /// Free buffers by bucket, by number.
    free: HashMap<u64, BTreeMap<u64, wgpu::Buffer>>,
    deferring: bool,
    /// The last batch begun (see [`Pool::defer`]).
    batch: u64,
    /// Buffers freed since the pending work began, by bucket, by number,
    /// each with the batch it waits for.
    deferred: HashMap<u64, BTreeMap<u64, (wgpu::Buffer, u64)>>,
    /// The number of the next buffer created.
    next: u64,
    deferred_bytes: u64,
    stats: MemoryStats,
    max_buffer: u64,
}

/// The bucket a request of `bytes` is served from.
pub(crate) fn bucket(bytes: u64) -> u64 {
    if bytes <= MIN_BUCKET {
        return MIN_BUCKET;
    }
    let p = 63 - (bytes - 1).leading_zeros() as u64; // 2^p < bytes <= 2^(p+1)
    let step = (1u64 << p) / 4;
    bytes.div_ceil(step) * step
}

impl Pool {
    pub(crate) fn new(max_buffer: u64) -> Pool {
        Pool {
            free: HashMap::new(),
            deferring: false,
            batch: 0,
            deferred: HashMap::new(),
            next: 0,
            deferred_bytes: 0,
            stats: MemoryStats::default(),
            max_buffer,
        }
    }

    /// Batch `batch` (numbered from 1 up) began: hold buffers freed from
    /// now on back from reuse until `release_deferred` of it or a later one.
    pub(crate) fn defer(&mut self, batch: u64) {
        self.deferring = true;
        self.batch = self.batch.max(batch);
    }

    /// Batch `batch` and those before it were submitted: buffers freed
    /// meanwhile can be reused (the queue orders later work after them).
    pub(crate) fn release_deferred(&mut self, batch: u64) {
        // Unless a later batch is still recorded or on its way, all of them.
        if batch >= self.batch {
            self.deferring = false;
        }
        for (&size, d) in self.deferred.iter_mut() {
            let done: Vec<u64> = d.iter().filter(|(_, (_, waits))| *waits <= batch).map(|(&n, _)| n).collect();
            for n in done {
                let (b, _) = d.remove(&n).expect("listed above");
                self.deferred_bytes -= size;
                self.free.entry(size).or_default().insert(n, b);
            }
        }
        self.deferred.retain(|_, d| !d.is_empty());
    }

    /// Bytes freed since the pending work began.
    pub(crate) fn deferred_bytes(&self) -> u64 {
        self.deferred_bytes
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        self.stats
    }

    /// Destroy every cached buffer (the caller made sure no work uses them):
    /// their memory returns at once, even where a cached plan's bind group
    /// still names one (it is never bound again: the pool cannot hand the
    /// buffer out any more).
    pub(crate) fn destroy_cached(&mut self) {
        for (b, _) in self.deferred.values().flat_map(|d| d.values()) {
            b.destroy();
        }
        self.release_cached();
    }

    /// Give cached memory back to the device when it runs out: free
    /// buffers are destroyed (submitted work that reads one finishes first,
    /// and a cached plan's bind group that still names one no longer keeps
    /// its memory); buffers the pending work may use are only dropped.
    pub(crate) fn release_cached(&mut self) {
        for b in self.free.values().flat_map(|f| f.values()) {
            b.destroy();
        }
        self.clear();
    }

    /// Drop every cached buffer.
    pub(crate) fn clear(&mut self) {
        // Deferred buffers may be dropped too: wgpu keeps a buffer alive
        // while encoded commands use it.
        self.free.clear();
        self.deferred.clear();
        self.deferred_bytes = 0;
        self.stats.cached = 0;
    }
}

/// One pooled GPU buffer holding `numel` elements of `dtype`.
pub(crate) struct GpuBuf {
    buffer: Option<wgpu::Buffer>,
    /// The buffer's number in its pool.
    number: u64,
    pub numel: usize,
    pub dtype: DType,
    pool: Arc<Mutex<Pool>>,
}

impl std::fmt::Debug for GpuBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuf({} x {}, {} bytes)", self.numel, self.dtype, self.size())
    }
}

impl GpuBuf {
    /// The wgpu buffer.
    pub(crate) fn raw(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("a live GpuBuf holds its buffer")
    }
    /// The same buffer, relabelled to hold `numel` elements of `dtype`
    /// (which must fit).
    pub(crate) fn reuse(mut self, dtype: DType, numel: usize) -> GpuBuf {
        self.dtype = dtype;
        self.numel = numel;
        self
    }
    /// Bytes of the underlying (bucketed) buffer.
    pub(crate) fn size(&self) -> u64 {
        self.raw().size()
    }
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            let mut p = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            p.stats.in_use -= b.size();
            p.stats.cached += b.size();
            if p.deferring {
                p.deferred_bytes += b.size();
                let batch = p.batch;
                p.deferred.entry(b.size()).or_default().insert(self.number, (b, batch));
            } else {
                p.free.entry(b.size()).or_default().insert(self.number, b);
            }
        }
    }
}

/// Whether a buffer of `bytes` can exist on the device at all.
pub(crate) fn fits(ctx: &super::GpuContext, dtype: DType, numel: usize, bytes: u64) -> Result<()> {
    let max = ctx.pool.lock().unwrap_or_else(|e| e.into_inner()).max_buffer;
    check_size(ctx.index, max, dtype, numel, bytes)
}

fn check_size(index: usize, max_buffer: u64, dtype: DType, numel: usize, bytes: u64) -> Result<()> {
    if bucket(bytes.max(4)) > max_buffer {
        return Err(Error::OutOfMemory(format!(
            "gpu:{index}: a buffer of {numel} {dtype} elements ({bytes} bytes) exceeds the adapter's largest buffer ({max_buffer} bytes)"
        )));
    }
    Ok(())
}

/// A buffer for `numel` elements of `dtype`, `bytes` long, from the pool of
/// `ctx` or newly created. Its contents are unspecified; it may be written
/// by the queue (an upload, constants).
pub(crate) fn alloc(ctx: &super::GpuContext, dtype: DType, numel: usize, bytes: u64) -> Result<GpuBuf> {
    alloc_from(ctx, dtype, numel, bytes, false)
}

/// [`alloc`] for a buffer that only kernels encoded into the pending pass
/// write (an output, scratch): it may be one freed since that pass began,
/// whose earlier readers the pass orders before the new writes. Which
/// buffer a step gets then does not depend on when the GPU last went idle.
pub(crate) fn alloc_in_pass(ctx: &super::GpuContext, dtype: DType, numel: usize, bytes: u64) -> Result<GpuBuf> {
    alloc_from(ctx, dtype, numel, bytes, true)
}

fn alloc_from(ctx: &super::GpuContext, dtype: DType, numel: usize, bytes: u64, in_pass: bool) -> Result<GpuBuf> {
    let size = bucket(bytes.max(4));
    let mut p = ctx.pool.lock().unwrap_or_else(|e| e.into_inner());
    check_size(ctx.index, p.max_buffer, dtype, numel, bytes)?;
    let first_free = p.free.get(&size).and_then(|f| f.first_key_value()).map(|(&n, _)| n);
    let first_deferred = p.deferred.get(&size).and_then(|f| f.first_key_value()).map(|(&n, _)| n);
    let from_deferred = in_pass && first_deferred.is_some_and(|d| first_free.is_none_or(|f| d < f));
    let taken = if from_deferred {
        p.deferred_bytes -= size;
        p.deferred.get_mut(&size).and_then(|f| f.pop_first()).map(|(n, (b, _))| (n, b))
    } else {
        p.free.get_mut(&size).and_then(|f| f.pop_first())
    };
    if let Some((number, b)) = taken {
        p.stats.cached -= size;
        p.stats.in_use += size;
        return Ok(GpuBuf { buffer: Some(b), number, numel, dtype, pool: ctx.pool.clone() });
    }
    drop(p);
    let create = || {
        ctx.scoped(|| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    };
    let (mut b, mut err) = create();
    if err.is_some() {
        // Give the cache back to the device and try once more.
        let had_cache = {
            let mut p = ctx.pool.lock().unwrap_or_else(|e| e.into_inner());
            let had = p.stats.cached > 0;
            p.release_cached();
            had
        };
        if had_cache {
            (b, err) = create();
        }
    }
    if let Some(e) = err {
        return Err(Error::OutOfMemory(format!(
            "gpu:{}: cannot allocate {numel} {dtype} elements ({bytes} bytes): {e}",
            ctx.index
        )));
    }
    let mut p = ctx.pool.lock().unwrap_or_else(|e| e.into_inner());
    p.stats.allocations += 1;
    p.stats.in_use += size;
    let number = p.next;
    p.next += 1;
    Ok(GpuBuf { buffer: Some(b), number, numel, dtype, pool: ctx.pool.clone() })
}

#[cfg(test)]
mod tests {
    use super::{bucket, GpuBuf, Pool};
    use crate::dtype::DType;
    use std::sync::{Arc, Mutex};

    /// A buffer freed while batch 2 is recorded and batch 1 is still on its
    /// way to the queue waits for batch 2's submission, not batch 1's: the
    /// submitter's release of batch 1 must not hand it to a queue write that
    /// would run before batch 2 reads it.
    #[test]
    fn a_freed_buffer_waits_for_the_batch_that_was_open_when_it_was_freed() {
        assert!(!crate::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
        let ctx = crate::backend::wgpu::context(0).unwrap();
        let pool = Arc::new(Mutex::new(Pool::new(1 << 30)));
        let buf = |number: u64| {
            // Counted in use, as the pool's own allocation would: dropping one moves its bytes to cached.
            pool.lock().unwrap().stats.in_use += 256;
            GpuBuf {
                buffer: Some(ctx.device.create_buffer(&wgpu::BufferDescriptor { label: None, size: 256, usage: wgpu::BufferUsages::STORAGE, mapped_at_creation: false })),
                number,
                numel: 64,
                dtype: DType::F32,
                pool: pool.clone(),
            }
        };
        let free = |p: &Pool| p.free.get(&256).map_or(0, |f| f.len());
        let (a, b, c) = (buf(0), buf(1), buf(2));
        pool.lock().unwrap().defer(1);
        drop(a); // read by batch 1
        pool.lock().unwrap().defer(2);
        drop(b); // read by batch 2
        pool.lock().unwrap().release_deferred(1);
        assert_eq!(free(&pool.lock().unwrap()), 1, "batch 1 submitted: only its buffer is free");
        assert!(pool.lock().unwrap().deferring, "batch 2 is still recorded");
        drop(c);
        assert_eq!(free(&pool.lock().unwrap()), 1, "a buffer freed meanwhile waits too");
        pool.lock().unwrap().release_deferred(2);
        let p = pool.lock().unwrap();
        assert_eq!((free(&p), p.deferred_bytes(), p.deferring), (3, 0, false));
    }

    #[test]
    fn buckets_waste_at_most_a_quarter() {
        for bytes in [1u64, 255, 256, 257, 1000, 1024, 1025, 4096 + 1, 1 << 20, (1 << 20) + 1, 123_456_789] {
            let b = bucket(bytes);
            assert!(b >= bytes, "{bytes} -> {b}");
            assert!(b <= (bytes * 5 / 4).max(256) + 1, "{bytes} -> {b}");
        }
        assert_eq!(bucket(1000), 1024);
        assert_eq!(bucket(1025), 1280);
    }
}
