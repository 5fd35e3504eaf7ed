//! Collectives: how replicas of a data-parallel run agree on numbers. One
//! trait, two engines: threads of one process ([`LocalGroup`]) and MPI
//! ranks (`MpiCollective`, behind the `mpi` feature).

use crate::error::{Error, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The operations data-parallel training needs from its peers. Every rank
/// calls each operation in the same order (they are collective); the data
/// lives in host memory.
pub trait Collective: Send + Sync {
    /// This participant's rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// How many participants there are.
    fn world_size(&self) -> usize;
    /// This participant's index among those on its machine (which of the
    /// machine's GPUs it takes): the rank itself unless the engine knows.
    fn local_rank(&self) -> usize {
        self.rank()
    }
    /// Sum `data` element-wise over every rank, in place. [`LocalGroup`]
    /// sums in rank order, so every rank gets the same bits; MPI only
    /// recommends that (Open MPI's algorithms for a few ranks do give every
    /// rank the same result, but the order of the sum is its own).
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()>;
    /// Write the element-wise sum over every rank of `src` into `dst` (of
    /// the same length): what [`all_reduce_sum`](Self::all_reduce_sum)
    /// does, out of place, so that a gradient bucket goes from the memory
    /// it was read back into to the memory it is uploaded from without a
    /// copy of its own. `dst` is only written, never read: it may be
    /// write-combined memory a GPU uploads from. (This default sums in a
    /// host vector and writes `dst` once.)
    fn all_reduce_sum_into(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        check_into(self, src, dst)?;
        let mut sum = src.to_vec();
        self.all_reduce_sum(&mut sum)?;
        par_copy(dst, &sum);
        Ok(())
    }
    /// Every rank's `values` (their lengths may differ), in rank order,
    /// shown to `visit` while the collective keeps them: each rank gets the
    /// same slices. An exchange whose size depends on the data, as the
    /// rows of a word embedding a batch touched. (This default gathers the
    /// lengths, then all-reduces one vector holding every rank's values at
    /// its own place and zeros elsewhere: adding zeros keeps the values, a
    /// negative zero aside.)
    fn all_gather_f32(&self, values: &[f32], visit: &mut dyn FnMut(&[&[f32]]) -> Result<()>) -> Result<()> {
        gather_by_sum(self, values, visit)
    }
    /// Replace `data` on every rank by rank `root`'s.
    fn broadcast(&self, data: &mut [f32], root: usize) -> Result<()>;
    /// Every rank's `values` (all of the same length), in rank order.
    fn all_gather(&self, values: &[u64]) -> Result<Vec<Vec<u64>>>;
    /// Tell the peers that this rank failed with `why`, so that none of
    /// them waits for it (an in-process group wakes them with an error;
    /// MPI aborts the job).
    fn abort(&self, why: &str);
}

/// [`Collective::all_gather_f32`] through the lengths and one all-reduce
/// of a vector holding every rank's values at its own place.
pub(crate) fn gather_by_sum<C: Collective + ?Sized>(c: &C, values: &[f32], visit: &mut dyn FnMut(&[&[f32]]) -> Result<()>) -> Result<()> {
    let lens: Vec<usize> = c.all_gather(&[values.len() as u64])?.iter().map(|v| v[0] as usize).collect();
    let at: usize = lens[..c.rank()].iter().sum();
    let mut all = vec![0f32; lens.iter().sum()];
    all[at..at + values.len()].copy_from_slice(values);
    c.all_reduce_sum(&mut all)?;
    let mut parts = Vec::with_capacity(lens.len());
    let mut start = 0;
    for len in lens {
        parts.push(&all[start..start + len]);
        start += len;
    }
    visit(&parts)
}

/// An out-of-place all-reduce's lengths agree; otherwise the group is
/// failed (its peers would wait for this rank) and the error returned.
fn check_into<C: Collective + ?Sized>(c: &C, src: &[f32], dst: &[f32]) -> Result<()> {
    if src.len() == dst.len() {
        return Ok(());
    }
    let why = format!("{} values reduced into {}", src.len(), dst.len());
    c.abort(&why);
    Err(Error::Distributed { op: "all_reduce", msg: why })
}

/// The `op` of the error a collective returns because another rank failed
/// (not itself the cause).
pub(crate) const PEER_FAILED: &str = "another replica failed";

/// How long an in-process collective waits for a peer that neither arrives
/// nor fails (`VOLTAIC_COLLECTIVE_TIMEOUT`, seconds; default 300).
fn timeout() -> Duration {
    let s = std::env::var("VOLTAIC_COLLECTIVE_TIMEOUT").ok().and_then(|v| v.parse::<f64>().ok()).filter(|v| *v > 0.0).unwrap_or(300.0);
    Duration::from_secs_f64(s)
}

/// One round of a rendezvous: what each rank brought.
#[derive(Default)]
struct Round {
    generation: u64,
    arrived: usize,
    slots: Vec<Option<Vec<f32>>>,
    /// Which operation each rank's contribution belongs to: ranks calling
    /// different collectives fail the group instead of misreading each other.
    ops: Vec<&'static str>,
    /// The previous round's contributions, in rank order.
    published: Option<Arc<Vec<Vec<f32>>>>,
    failed: Option<String>,
}

struct Shared {
    n: usize,
    round: Mutex<Round>,
    turn: Condvar,
    /// `Round::generation`, readable without the lock: a rank that arrives
    /// early spins on it for a moment before it sleeps.
    generation: std::sync::atomic::AtomicU64,
}

/// How long a rank spins for the others before it sleeps: replicas of one
/// step arrive within microseconds of each other more often than not, and
/// waking from a sleep costs tens of microseconds (more in a VM), several
/// times per step.
const SPIN: Duration = Duration::from_micros(100);

/// Threads of one process exchanging through shared memory: one handle per
/// replica, each used by that replica's thread.
///
/// ```
/// use voltaic::distributed::{Collective, LocalGroup};
/// let handles = LocalGroup::ranks(3);
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let jobs: Vec<_> = handles.iter().map(|h| s.spawn(move || {
///         let mut v = vec![h.rank() as f32; 4];
///         h.all_reduce_sum(&mut v).map(|_| v)
///     })).collect();
///     jobs.into_iter().map(|j| j.join().unwrap().unwrap()).collect()
/// });
/// assert!(sums.iter().all(|v| v == &vec![3.0; 4]));
/// ```
pub struct LocalGroup {
    rank: usize,
    /// Set while a collective runs on this handle: one handle is one rank,
    /// used by one thread at a time.
    busy: std::sync::atomic::AtomicBool,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// `n` connected handles, ranks `0..n`.
    pub fn ranks(n: usize) -> Vec<Arc<dyn Collective>> {
        let shared = Arc::new(Shared { n, round: Mutex::new(Round { slots: vec![None; n], ops: vec![""; n], ..Default::default() }), turn: Condvar::new(), generation: Default::default() });
        (0..n).map(|rank| Arc::new(LocalGroup { rank, busy: Default::default(), shared: shared.clone() }) as Arc<dyn Collective>).collect()
    }

    /// Give `data` to the round and wait for every rank's contribution.
    fn exchange(&self, op: &'static str, data: Vec<f32>) -> Result<Arc<Vec<Vec<f32>>>> {
        self.exchange_as(op, data, false)
    }

    /// With `strict`, wait for every rank whatever happens meanwhile (no
    /// failure or timeout ends the wait): for a round that every rank is
    /// known to reach, after which buffers the others read may be freed.
    fn exchange_as(&self, op: &'static str, data: Vec<f32>, strict: bool) -> Result<Arc<Vec<Vec<f32>>>> {
        let sh = &self.shared;
        let mut r = sh.round.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some(why), false) = (&r.failed, strict) {
            return Err(Error::Distributed { op: PEER_FAILED, msg: format!("{op}: {why}") });
        }
        let generation = r.generation;
        r.slots[self.rank] = Some(data);
        r.ops[self.rank] = op;
        r.arrived += 1;
        if r.arrived == sh.n {
            if let Some(q) = (0..sh.n).find(|&q| r.ops[q] != r.ops[0]) {
                // A programming error: the ranks are out of step.
                let why = format!("ranks called different collectives at once: rank 0 {}, rank {q} {}", r.ops[0], r.ops[q]);
                r.failed = Some(why.clone());
                sh.turn.notify_all();
                return Err(Error::Distributed { op, msg: why });
            }
            let all: Vec<Vec<f32>> = r.slots.iter_mut().map(|s| s.take().unwrap_or_default()).collect();
            r.published = Some(Arc::new(all));
            r.arrived = 0;
            r.generation += 1;
            sh.generation.store(r.generation, std::sync::atomic::Ordering::Release);
            sh.turn.notify_all();
        } else {
            drop(r);
            let spun = Instant::now();
            while sh.generation.load(std::sync::atomic::Ordering::Acquire) == generation && spun.elapsed() < SPIN {
                std::hint::spin_loop();
            }
            r = sh.round.lock().unwrap_or_else(|e| e.into_inner());
        }
        let limit = timeout();
        let start = Instant::now();
        while strict && r.generation == generation {
            r = sh.turn.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        while r.generation == generation && r.failed.is_none() {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                let missing: Vec<usize> = (0..sh.n).filter(|&i| r.slots[i].is_none()).collect();
                let why = format!("replica(s) {missing:?} did not arrive within {:.0} s (VOLTAIC_COLLECTIVE_TIMEOUT)", limit.as_secs_f64());
                r.failed = Some(why.clone());
                sh.turn.notify_all();
                return Err(Error::Distributed { op, msg: why });
            }
            r = sh.turn.wait_timeout(r, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        if r.generation == generation {
            let why = r.failed.clone().unwrap_or_default();
            return Err(Error::Distributed { op: PEER_FAILED, msg: format!("{op}: {why}") });
        }
        Ok(r.published.clone().expect("a finished round is published"))
    }
}

/// Apply `f(offset, chunk)` to chunks of `out`, on the CPU's threads when
/// `out` is large: a gradient bucket of tens of MB summed on one thread is
/// the longest part of the exchange, and the host has memory bandwidth to
/// spare for several.
fn par_chunks(out: &mut [f32], f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    #[cfg(not(target_arch = "wasm32"))]
    const CHUNK: usize = 1 << 18;
    #[cfg(not(target_arch = "wasm32"))]
    if out.len() > 2 * CHUNK {
        use rayon::prelude::*;
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| f(i * CHUNK, c));
        return;
    }
    f(0, out);
}

/// Elements `lo..hi` of the sum over `srcs` (in their order, so that
/// every caller summing any share gets the same bits) stored into every
/// one of `dsts`, on the CPU's threads when large. The pointers are
/// addresses of f32 arrays; a destination may be a source (the reads of
/// each block come before its writes), and may be write-combined memory:
/// the sum is formed in a small buffer on the stack and stored once.
///
/// # Safety
/// Every address must point to at least `hi` f32 values, readable
/// (sources) or writable (destinations), which nothing else reads or
/// writes in `lo..hi` during the call.
pub(crate) unsafe fn sum_share(srcs: &[usize], dsts: &[usize], lo: usize, hi: usize) {
    const BLOCK: usize = 2048;
    let sum_range = |at: usize, end: usize| {
        let mut acc = [0f32; BLOCK];
        let mut i = at;
        while i < end {
            let m = BLOCK.min(end - i);
            let acc = &mut acc[..m];
            for (q, &s) in srcs.iter().enumerate() {
                // SAFETY: in bounds and unshared, as the caller promises.
                let part = unsafe { std::slice::from_raw_parts((s as *const f32).add(i), m) };
                if q == 0 {
                    acc.copy_from_slice(part);
                } else {
                    for (a, x) in acc.iter_mut().zip(part) {
                        *a += x;
                    }
                }
            }
            for &d in dsts {
                // SAFETY: as above.
                let out = unsafe { std::slice::from_raw_parts_mut((d as *mut f32).add(i), m) };
                out.copy_from_slice(acc);
            }
            i += m;
        }
    };
    #[cfg(not(target_arch = "wasm32"))]
    {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 17;
        if hi - lo > 2 * CHUNK {
            (0..(hi - lo).div_ceil(CHUNK)).into_par_iter().for_each(|c| sum_range(lo + c * CHUNK, (lo + (c + 1) * CHUNK).min(hi)));
            return;
        }
    }
    sum_range(lo, hi);
}

/// `dst.copy_from_slice(src)` on the CPU's threads when large.
pub(crate) fn par_copy(dst: &mut [f32], src: &[f32]) {
    par_chunks(dst, &|at, out: &mut [f32]| out.copy_from_slice(&src[at..at + out.len()]));
}

/// Marks a handle busy for one collective.
struct Busy<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
    }
}

impl LocalGroup {
    fn enter(&self, op: &'static str) -> Result<Busy<'_>> {
        if self.busy.swap(true, std::sync::atomic::Ordering::Acquire) {
            return Err(Error::Distributed { op, msg: format!("rank {} is already in a collective: one handle serves one thread at a time", self.rank) });
        }
        Ok(Busy(&self.busy))
    }

    /// The all-reduce of every rank's `len` values at `src` into its `dst`
    /// (the same memory for an in-place sum). The ranks work on each
    /// other's memory: rank r sums share r of every rank's `src`, in rank
    /// order (so that every rank ends with the same bits), and writes it
    /// into every rank's `dst`. A share is read and written by its rank
    /// alone, so in place the reads of a share come before its writes.
    fn reduce_into(&self, src: *const f32, dst: *mut f32, len: usize) -> Result<()> {
        let n = self.shared.n;
        let _busy = self.enter("all_reduce")?;
        let all = self.gather_as("all_reduce", &[src as u64, dst as u64, len as u64])?;
        if let Some(bad) = all.iter().position(|v| v[2] != len as u64) {
            let why = format!("replica {bad} reduces {} values, replica {} reduces {len}", all[bad][2], self.rank);
            self.abort(&why);
            return Err(Error::Distributed { op: "all_reduce", msg: why });
        }
        let (lo, hi) = (len * self.rank / n, len * (self.rank + 1) / n);
        // Addresses travel as integers: raw pointers are not Sync.
        let (srcs, dsts): (Vec<usize>, Vec<usize>) = all.iter().map(|v| (v[0] as usize, v[1] as usize)).unzip();
        // SAFETY: every rank's `src` and `dst` hold `len` values (checked
        // above) and stay alive until their rank passes the last exchange
        // below, which needs this rank's arrival after this sum; no other
        // rank touches share `lo..hi` of them.
        unsafe { sum_share(&srcs, &dsts, lo, hi) };
        // Every rank passed the first exchange, so every rank reaches this
        // one: it waits for all of them even if the group fails meanwhile,
        // because until they arrive they may be using this rank's memory.
        self.exchange_as("all_reduce", Vec::new(), true)?;
        Ok(())
    }

    /// Every rank's `values`, under the name of operation `op`.
    fn gather_as(&self, op: &'static str, values: &[u64]) -> Result<Vec<Vec<u64>>> {
        // u64s travel as pairs of f32 bit patterns (copied, never computed on).
        let bits: Vec<f32> = values.iter().flat_map(|&v| [f32::from_bits(v as u32), f32::from_bits((v >> 32) as u32)]).collect();
        let all = self.exchange(op, bits)?;
        Ok(all.iter().map(|v| v.chunks_exact(2).map(|c| c[0].to_bits() as u64 | (c[1].to_bits() as u64) << 32).collect()).collect())
    }
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.n
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        if self.shared.n == 1 {
            return Ok(());
        }
        let len = data.len();
        let p = data.as_mut_ptr();
        self.reduce_into(p, p, len)
    }

    fn all_reduce_sum_into(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        check_into(self, src, dst)?;
        if self.shared.n == 1 {
            par_copy(dst, src);
            return Ok(());
        }
        self.reduce_into(src.as_ptr(), dst.as_mut_ptr(), src.len())
    }

    fn broadcast(&self, data: &mut [f32], root: usize) -> Result<()> {
        if root >= self.shared.n {
            return Err(Error::Distributed { op: "broadcast", msg: format!("root {root} is not a rank of a group of {}", self.shared.n) });
        }
        let _busy = self.enter("broadcast")?;
        let mine = if self.rank == root { data.to_vec() } else { Vec::new() };
        let all = self.exchange("broadcast", mine)?;
        if all[root].len() != data.len() {
            return Err(Error::Distributed {
                op: "broadcast",
                msg: format!("rank {root} sent {} values, rank {} expected {}", all[root].len(), self.rank, data.len()),
            });
        }
        data.copy_from_slice(&all[root]);
        Ok(())
    }

    fn all_gather(&self, values: &[u64]) -> Result<Vec<Vec<u64>>> {
        let _busy = self.enter("all_gather")?;
        self.gather_as("all_gather", values)
    }

    fn all_gather_f32(&self, values: &[f32], visit: &mut dyn FnMut(&[&[f32]]) -> Result<()>) -> Result<()> {
        if self.shared.n == 1 {
            return visit(&[values]);
        }
        let _busy = self.enter("all_gather_f32")?;
        // The ranks read each other's memory in place, as `reduce_into`.
        let all = self.gather_as("all_gather_f32", &[values.as_ptr() as u64, values.len() as u64])?;
        // SAFETY: every rank's values stay alive and unchanged until it
        // passes the exchange below, which waits for this rank.
        let parts: Vec<&[f32]> = all.iter().map(|v| unsafe { std::slice::from_raw_parts(v[0] as usize as *const f32, v[1] as usize) }).collect();
        let visited = visit(&parts);
        drop(parts);
        // Every rank passed the first exchange, so every rank reaches this
        // one (whatever its visit gave): until then its peers may read its
        // values.
        self.exchange_as("all_gather_f32", Vec::new(), true)?;
        visited
    }

    fn abort(&self, why: &str) {
        let mut r = self.shared.round.lock().unwrap_or_else(|e| e.into_inner());
        if r.failed.is_none() {
            r.failed = Some(format!("replica {} failed: {why}", self.rank));
        }
        self.shared.turn.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_threads<T: Send>(handles: &[Arc<dyn Collective>], f: impl Fn(&dyn Collective) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let jobs: Vec<_> = handles.iter().map(|h| s.spawn(|| f(&**h))).collect();
            jobs.into_iter().map(|j| j.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_and_every_rank_gets_the_same_bits() {
        for n in [1, 2, 3, 5] {
            let h = LocalGroup::ranks(n);
            let out = on_threads(&h, |c| {
                let mut v: Vec<f32> = (0..37).map(|i| ((i * 7 + c.rank() * 13) % 11) as f32 * 0.1 + 1e-7 * c.rank() as f32).collect();
                c.all_reduce_sum(&mut v).unwrap();
                v
            });
            let want: Vec<f32> = (0..37)
                .map(|i| {
                    let mut s = 0f32;
                    for r in 0..n {
                        s += ((i * 7 + r * 13) % 11) as f32 * 0.1 + 1e-7 * r as f32;
                    }
                    s
                })
                .collect();
            for v in &out {
                assert_eq!(v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn a_large_all_reduce_split_over_threads_keeps_the_rank_order_sum() {
        // Over a million values per share: summed in chunks on the CPU's threads.
        let (n, len) = (3, 3_000_017);
        let value = |r: usize, i: usize| ((i * 31 + r * 17) % 1013) as f32 * 1e-3 + (r as f32) * 1e-7;
        let h = LocalGroup::ranks(n);
        let out = on_threads(&h, |c| {
            let mut v: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
            c.all_reduce_sum(&mut v).unwrap();
            v
        });
        for v in &out {
            for i in (0..len).step_by(997).chain([len - 1]) {
                let mut want = 0f32;
                for r in 0..n {
                    want += value(r, i);
                }
                assert_eq!(v[i].to_bits(), want.to_bits(), "element {i}");
            }
        }
        assert!(out.iter().all(|v| v == &out[0]));
    }

    #[test]
    fn an_out_of_place_all_reduce_writes_the_rank_order_sum_and_leaves_the_source() {
        // Shares above two rayon chunks (split over threads) and odd sizes.
        for (n, len) in [(1, 1000), (2, 37), (3, 1_000_003)] {
            let value = |r: usize, i: usize| ((i * 29 + r * 11) % 997) as f32 * 1e-3 + (r as f32) * 1e-7;
            let h = LocalGroup::ranks(n);
            let out = on_threads(&h, |c| {
                let src: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                let mut dst = vec![f32::NAN; len];
                c.all_reduce_sum_into(&src, &mut dst).unwrap();
                assert!(src.iter().enumerate().all(|(i, x)| x.to_bits() == value(c.rank(), i).to_bits()), "the source changed");
                // The in-place form gives the same bits.
                let mut inplace = src.clone();
                c.all_reduce_sum(&mut inplace).unwrap();
                assert_eq!(inplace.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), dst.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                dst
            });
            for v in &out {
                for i in (0..len).step_by(991).chain([len - 1]) {
                    let mut want = 0f32;
                    for r in 0..n {
                        want += value(r, i);
                    }
                    assert_eq!(v[i].to_bits(), want.to_bits(), "{n} ranks, element {i}");
                }
            }
            assert!(out.iter().all(|v| v == &out[0]));
        }
        // Lengths that differ are an error, on one rank and across ranks.
        let h = LocalGroup::ranks(2);
        assert!(h[0].all_reduce_sum_into(&[1.0; 3], &mut [0.0; 2]).unwrap_err().to_string().contains("3 values reduced into 2"));
        // ... which fails the group, so that its peer does not wait.
        assert!(h[1].all_reduce_sum(&mut [1.0]).unwrap_err().to_string().contains("3 values reduced into 2"));
        let h = LocalGroup::ranks(2);
        let out = on_threads(&h, |c| {
            let len = 4 + c.rank();
            c.all_reduce_sum_into(&vec![1.0; len], &mut vec![0.0; len])
        });
        assert!(out.iter().all(|r| r.as_ref().unwrap_err().to_string().contains("reduces")), "{out:?}");
    }

    #[test]
    fn rounds_follow_each_other_and_broadcast_and_gather_work() {
        let h = LocalGroup::ranks(4);
        let out = on_threads(&h, |c| {
            let mut last = vec![];
            for round in 0..50 {
                let mut v = vec![(c.rank() * 100 + round) as f32; 3];
                c.broadcast(&mut v, round % 4).unwrap();
                assert_eq!(v, vec![((round % 4) * 100 + round) as f32; 3]);
                last = c.all_gather(&[c.rank() as u64, u64::MAX - round as u64]).unwrap();
            }
            last
        });
        for g in out {
            assert_eq!(g, (0..4).map(|r| vec![r as u64, u64::MAX - 49]).collect::<Vec<_>>());
        }
    }

    #[test]
    fn all_gather_f32_shows_every_ranks_values_of_any_length_in_rank_order() {
        let value = |r: usize, i: usize| (r * 1000 + i) as f32 * 0.5 - 3.25;
        for n in [1, 2, 3] {
            let h = LocalGroup::ranks(n);
            let out = on_threads(&h, |c| {
                // Lengths differ by rank; rank 1 brings nothing.
                let mine: Vec<f32> = (0..[5, 0, 1_000][c.rank()]).map(|i| value(c.rank(), i)).collect();
                let mut seen = Vec::new();
                for _ in 0..3 {
                    seen.clear();
                    c.all_gather_f32(&mine, &mut |parts| {
                        seen = parts.iter().map(|p| p.to_vec()).collect();
                        Ok(())
                    })
                    .unwrap();
                }
                // The trait's default (lengths, then an all-reduce) sees the same.
                let mut default = Vec::new();
                struct Default<'a>(&'a dyn Collective);
                impl Collective for Default<'_> {
                    fn rank(&self) -> usize {
                        self.0.rank()
                    }
                    fn world_size(&self) -> usize {
                        self.0.world_size()
                    }
                    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
                        self.0.all_reduce_sum(data)
                    }
                    fn broadcast(&self, data: &mut [f32], root: usize) -> Result<()> {
                        self.0.broadcast(data, root)
                    }
                    fn all_gather(&self, values: &[u64]) -> Result<Vec<Vec<u64>>> {
                        self.0.all_gather(values)
                    }
                    fn abort(&self, why: &str) {
                        self.0.abort(why)
                    }
                }
                Default(c)
                    .all_gather_f32(&mine, &mut |parts| {
                        default = parts.iter().map(|p| p.to_vec()).collect();
                        Ok(())
                    })
                    .unwrap();
                assert_eq!(default, seen);
                seen
            });
            for seen in out {
                assert_eq!(seen.len(), n);
                for (r, part) in seen.iter().enumerate() {
                    assert_eq!(part, &(0..[5, 0, 1_000][r]).map(|i| value(r, i)).collect::<Vec<_>>());
                }
            }
        }
        // A visit that fails on one rank fails that rank only; the group goes on.
        let h = LocalGroup::ranks(2);
        let out = on_threads(&h, |c| {
            let r = c.all_gather_f32(&[1.0], &mut |_| if c.rank() == 0 { Err(Error::Backend("bad rows".into())) } else { Ok(()) });
            let mut v = vec![1.0];
            c.all_reduce_sum(&mut v).unwrap();
            (r.is_err(), v[0])
        });
        assert_eq!(out, vec![(true, 2.0), (false, 2.0)]);
    }

    #[test]
    fn ranks_in_different_collectives_fail_instead_of_misreading() {
        let h = LocalGroup::ranks(2);
        let out = on_threads(&h, |c| {
            if c.rank() == 0 {
                let mut v = vec![1.0; 37];
                c.all_reduce_sum(&mut v).map(|_| ())
            } else {
                c.all_gather(&[0xdead_beef, 37]).map(|_| ())
            }
        });
        for e in out {
            let msg = e.unwrap_err().to_string();
            assert!(msg.contains("different collectives"), "{msg}");
        }
    }

    #[test]
    fn a_failed_rank_wakes_the_others_with_its_reason() {
        let h = LocalGroup::ranks(3);
        let out = on_threads(&h, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                c.abort("out of memory on gpu:7");
                return Err(Error::OutOfMemory("gpu:7".into()));
            }
            let mut v = vec![1.0; 8];
            c.all_reduce_sum(&mut v)
        });
        for (r, e) in out.into_iter().enumerate() {
            let msg = e.unwrap_err().to_string();
            if r != 1 {
                assert!(msg.contains("replica 1 failed") && msg.contains("out of memory on gpu:7"), "{msg}");
            }
        }
        // The group stays failed.
        let mut v = vec![0.0];
        assert!(h[0].all_reduce_sum(&mut v).is_err());
    }
}
