//! The ranks of an MPI job as a [`Collective`] (the `mpi` feature: rsmpi
//! over the system's MPI, e.g. Debian's Open MPI).

use super::collective::{gather_by_sum, par_copy, sum_share, Collective};
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;
use std::sync::Mutex;

/// This process's rank of an MPI job (`mpirun -np N ...`). Gradients are
/// summed over host memory: when every rank runs on one machine, in an MPI
/// shared-memory window, each rank summing its share of every rank's
/// values on all its cores (`VOLTAIC_MPI_SHARED=0` turns that off);
/// otherwise with `MPI_Allreduce`. The shared-memory sum runs in rank
/// order, so every rank gets the same bits. MPI is initialised by
/// [`MpiCollective::world`] and finalised when the value is dropped; calls
/// go through a lock, so any one thread may make them at a time. Drop it on
/// the thread that created it (MPI wants to be finalised there).
///
/// When this rank fails, [`Collective::abort`] prints the reason and calls
/// `MPI_Abort`, which ends every rank of the job; when another rank dies,
/// the MPI launcher ends this one and names the rank that died.
pub struct MpiCollective {
    world: Mutex<SimpleCommunicator>,
    /// The send side of all-reduces, kept between calls (MPI wants two
    /// buffers; a fresh one every step costs page faults).
    send: Mutex<Vec<f32>>,
    /// The receive side of out-of-place all-reduces, kept likewise.
    recv: Mutex<Vec<f32>>,
    /// Shared memory over the ranks, when they all run on one machine.
    node: Mutex<Option<NodeShared>>,
    rank: usize,
    size: usize,
    local_rank: usize,
    // Dropped last: finalises MPI.
    _universe: Universe,
}

// SAFETY: MPI is initialised with at least MPI_THREAD_SERIALIZED (checked
// in `world`), and every call on the communicator holds the mutex, so calls
// from different threads never overlap.
unsafe impl Send for MpiCollective {}
unsafe impl Sync for MpiCollective {}

fn mpi_err(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Distributed { op, msg: msg.into() }
}

impl MpiCollective {
    /// Initialise MPI and join its world communicator. An error when MPI
    /// was already initialised or cannot serve calls from several threads.
    pub fn world() -> Result<MpiCollective> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| mpi_err("MpiCollective::world", "MPI is already initialised in this process"))?;
        if level < Threading::Serialized {
            return Err(mpi_err("MpiCollective::world", format!("the MPI library offers thread level {level:?}; Voltaic needs Serialized or Multiple")));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let local_rank = ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"]
            .iter()
            .find_map(|v| std::env::var(v).ok()?.parse().ok())
            .unwrap_or(rank);
        let node_comm = world.split_shared(world.rank());
        let local_size = node_comm.size() as usize;
        share_cores(local_size);
        warn_if_bound_narrowly(local_size, local_rank);
        // Every rank must take the same path: the setting is agreed on
        // (shared memory only if every rank allows it).
        let allow = !std::env::var("VOLTAIC_MPI_SHARED").is_ok_and(|v| v == "0") as i32;
        let mut all_allow = 0i32;
        world.all_reduce_into(&allow, &mut all_allow, SystemOperation::min());
        let node = if all_allow == 1 { NodeShared::new(node_comm, size) } else { None };
        Ok(MpiCollective { world: Mutex::new(world), send: Mutex::new(Vec::new()), recv: Mutex::new(Vec::new()), node: Mutex::new(node), rank, size, local_rank, _universe: universe })
    }

    fn comm(&self) -> std::sync::MutexGuard<'_, SimpleCommunicator> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every rank brings `len` values to an all-reduce: MPI cannot check
    /// it, and a mismatch would corrupt memory, so the lengths are compared.
    fn same_length_everywhere(&self, len: usize) -> Result<()> {
        let lens = self.all_gather(&[len as u64])?;
        match lens.iter().position(|l| l[0] != len as u64) {
            Some(bad) => Err(mpi_err("all_reduce", format!("rank {bad} reduces {} values, rank {} reduces {len}", lens[bad][0], self.rank))),
            None => Ok(()),
        }
    }

    /// The sum over the ranks of `src` into `dst` (the same memory for an
    /// in-place sum) through memory every rank of the machine maps, when
    /// every rank runs on this machine; `false` (nothing done) otherwise.
    /// Lengths were checked equal on every rank.
    ///
    /// # Safety
    /// `src` and `dst` point to `len` values, readable and writable.
    unsafe fn reduce_in_shared_memory(&self, src: *const f32, dst: *mut f32, len: usize) -> Result<bool> {
        let mut node = self.node.lock().unwrap_or_else(|e| e.into_inner());
        let Some(node) = node.as_mut() else { return Ok(false) };
        if len == 0 {
            // Every rank has the same length (checked): none takes part.
            return Ok(true);
        }
        // One thread in MPI at a time (the Serialized level), as elsewhere.
        let _world = self.comm();
        node.reserve(len)?;
        let me = node.comm.rank() as usize;
        let mine = node.bases[me];
        // SAFETY: this rank's segment holds at least `len` values
        // (reserved), and no other rank touches it until the barrier below;
        // `src` is read whole before `dst` (maybe the same memory) is written.
        par_copy(unsafe { std::slice::from_raw_parts_mut(mine as *mut f32, len) }, unsafe { std::slice::from_raw_parts(src, len) });
        node.fence();
        let n = node.bases.len();
        // SAFETY: every segment holds `len` values; between the two
        // barriers only this rank reads or writes share `lo..hi` of any.
        unsafe { sum_share(&node.bases, &node.bases, len * me / n, len * (me + 1) / n) };
        node.fence();
        // SAFETY: `dst` holds `len` values (the caller's slice), and this
        // rank's segment is written by no one until the next call's first
        // barrier, which this rank reaches after the copy.
        par_copy(unsafe { std::slice::from_raw_parts_mut(dst, len) }, unsafe { std::slice::from_raw_parts(mine as *const f32, len) });
        Ok(true)
    }
}

/// Say so (once per machine) when the launcher bound this rank to far
/// fewer CPUs than its share of the machine: Open MPI binds each rank to
/// one core when it starts two, and a rank's host threads (recording,
/// the driver's, the all-reduce's) then take turns on that core.
fn warn_if_bound_narrowly(local_size: usize, local_rank: usize) {
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").ok().map(|s| online_cpus(&s)).unwrap_or(0);
    if local_rank == 0 && online > 0 && allowed < online / local_size.max(1) {
        eprintln!(
            "voltaic: this MPI rank may use {allowed} of the machine's {online} CPUs ({local_size} ranks here): \
             start the job with `mpirun --bind-to none` (or `--bind-to numa`) so that each rank's host threads have cores"
        );
    }
}

/// Size the CPU thread pool of a rank to its share of the machine's CPUs
/// (as `torchrun` sets `OMP_NUM_THREADS`): with several ranks on a
/// machine, each would otherwise start a thread per CPU. A pool the
/// program already configured is left alone.
fn share_cores(local_size: usize) {
    if local_size > 1 {
        let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
        let _ = rayon::ThreadPoolBuilder::new().num_threads((allowed / local_size).max(1)).build_global();
    }
}

/// The count of CPUs in a Linux CPU list (`0-63`, `0,2-5`).
fn online_cpus(list: &str) -> usize {
    list.trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => b.trim().parse::<usize>().unwrap_or(0).saturating_sub(a.trim().parse().unwrap_or(0)) + 1,
            None => 1,
        })
        .sum()
}

/// A shared-memory window over the ranks of one machine: each rank's
/// segment, mapped by all of them. An all-reduce there sums with every
/// core of the machine reading each segment once (Open MPI's all-reduce
/// over shared memory moved the encoder's 90 MB between 2 ranks in 50-100
/// ms, one core reducing and copying through small fragments).
struct NodeShared {
    win: Option<mpi::ffi::MPI_Win>,
    /// The addresses of the ranks' segments, in rank order.
    bases: Vec<usize>,
    /// Values each segment holds.
    capacity: usize,
    // Dropped after the window.
    comm: SimpleCommunicator,
}

impl NodeShared {
    /// Over `comm`, the ranks of this machine, when they are all `world`
    /// ranks of the job.
    fn new(comm: SimpleCommunicator, world: usize) -> Option<NodeShared> {
        (comm.size() as usize == world && world > 1).then(|| NodeShared { win: None, bases: Vec::new(), capacity: 0, comm })
    }

    /// Segments of at least `len` values (collective: every rank asks for
    /// the same `len`, so every rank grows the window at the same call).
    fn reserve(&mut self, len: usize) -> Result<()> {
        if len <= self.capacity {
            return Ok(());
        }
        self.free();
        // Rounded up so that the few bucket sizes of a run grow it rarely.
        let capacity = len.next_multiple_of(1 << 20);
        let bytes = capacity.checked_mul(4).and_then(|b| mpi::ffi::MPI_Aint::try_from(b).ok()).ok_or_else(|| mpi_err("all_reduce", format!("{len} values do not fit a shared window")))?;
        let mut base: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut win: mpi::ffi::MPI_Win = unsafe { std::mem::zeroed() };
        // SAFETY: plain MPI calls on a live communicator with valid out
        // pointers; every rank of it makes them together.
        let rc = unsafe {
            mpi::ffi::MPI_Win_allocate_shared(bytes, 4, mpi::ffi::RSMPI_INFO_NULL, self.comm.as_raw(), &mut base as *mut *mut std::ffi::c_void as *mut std::ffi::c_void, &mut win)
        };
        if rc != 0 {
            return Err(mpi_err("all_reduce", format!("MPI_Win_allocate_shared of {bytes} bytes per rank failed (error {rc})")));
        }
        // A passive epoch for the whole life of the window: the segments
        // are then read and written directly, ordered by `fence`.
        let rc = unsafe { mpi::ffi::MPI_Win_lock_all(mpi::ffi::MPI_MODE_NOCHECK as i32, win) };
        self.win = Some(win);
        if rc != 0 {
            return Err(mpi_err("all_reduce", format!("MPI_Win_lock_all on the shared window failed (error {rc})")));
        }
        let mut bases = Vec::new();
        for q in 0..self.comm.size() {
            let (mut size, mut unit, mut ptr): (mpi::ffi::MPI_Aint, i32, *mut std::ffi::c_void) = (0, 0, std::ptr::null_mut());
            // SAFETY: `win` is a shared window of this communicator.
            let rc = unsafe { mpi::ffi::MPI_Win_shared_query(win, q, &mut size, &mut unit, &mut ptr as *mut *mut std::ffi::c_void as *mut std::ffi::c_void) };
            if rc != 0 || ptr.is_null() || size < bytes || !(ptr as *const f32).is_aligned() {
                return Err(mpi_err("all_reduce", format!("rank {q}'s shared segment is {size} bytes at {ptr:?} (error {rc}), expected {bytes} aligned for f32")));
            }
            bases.push(ptr as usize);
        }
        self.bases = bases;
        self.capacity = capacity;
        Ok(())
    }

    /// Every rank's writes to the segments before this are seen by every
    /// rank after it (the unified memory model's sync-barrier-sync).
    fn fence(&self) {
        if let Some(win) = self.win {
            // SAFETY: a live window in a passive epoch, its communicator's
            // ranks all calling.
            unsafe {
                mpi::ffi::MPI_Win_sync(win);
                mpi::ffi::MPI_Barrier(self.comm.as_raw());
                mpi::ffi::MPI_Win_sync(win);
            }
        }
    }

    fn free(&mut self) {
        if let Some(mut win) = self.win.take() {
            // SAFETY: the window is live and every rank frees it together
            // (in `reserve` at the same call, or when the job ends).
            unsafe {
                mpi::ffi::MPI_Win_unlock_all(win);
                mpi::ffi::MPI_Win_free(&mut win);
            }
        }
        self.bases.clear();
        self.capacity = 0;
    }
}

impl Drop for NodeShared {
    fn drop(&mut self) {
        self.free();
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    /// From the launcher's environment (Open MPI, MPICH, MVAPICH, Slurm).
    fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        self.same_length_everywhere(data.len())?;
        let p = data.as_mut_ptr();
        // SAFETY: `data` holds its length of values.
        if unsafe { self.reduce_in_shared_memory(p, p, data.len())? } {
            return Ok(());
        }
        let mut send = self.send.lock().unwrap_or_else(|e| e.into_inner());
        send.clear();
        send.extend_from_slice(data);
        self.comm().all_reduce_into(&send[..], data, SystemOperation::sum());
        Ok(())
    }

    /// Through host vectors kept between calls: MPI's single-copy
    /// transports (CMA, XPMEM) may reach into a peer's buffers, which they
    /// cannot do in memory a GPU driver mapped.
    fn all_reduce_sum_into(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        if src.len() != dst.len() {
            return Err(mpi_err("all_reduce", format!("{} values reduced into {}", src.len(), dst.len())));
        }
        self.same_length_everywhere(src.len())?;
        // SAFETY: both slices hold `src.len()` values (checked above).
        if unsafe { self.reduce_in_shared_memory(src.as_ptr(), dst.as_mut_ptr(), src.len())? } {
            return Ok(());
        }
        let mut send = self.send.lock().unwrap_or_else(|e| e.into_inner());
        let mut recv = self.recv.lock().unwrap_or_else(|e| e.into_inner());
        send.resize(src.len(), 0.0);
        recv.resize(src.len(), 0.0);
        par_copy(&mut send, src);
        self.comm().all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        par_copy(dst, &recv);
        Ok(())
    }

    /// Through the shared window when every rank runs on this machine:
    /// each rank copies its values into its segment and every rank reads
    /// them all there.
    fn all_gather_f32(&self, values: &[f32], visit: &mut dyn FnMut(&[&[f32]]) -> Result<()>) -> Result<()> {
        let mut node = self.node.lock().unwrap_or_else(|e| e.into_inner());
        let Some(node) = node.as_mut() else {
            drop(node);
            return gather_by_sum(self, values, visit);
        };
        // The window's lock before MPI's, as in `reduce_in_shared_memory`.
        let lens: Vec<usize> = self.all_gather(&[values.len() as u64])?.iter().map(|v| v[0] as usize).collect();
        let _world = self.comm();
        // The same size on every rank: every rank grows the window alike.
        node.reserve(lens.iter().copied().max().unwrap_or(0))?;
        let me = node.comm.rank() as usize;
        // SAFETY: this rank's segment holds at least its `values.len()`
        // values (reserved), and no other rank touches it until the barrier.
        par_copy(unsafe { std::slice::from_raw_parts_mut(node.bases[me] as *mut f32, values.len()) }, values);
        node.fence();
        // SAFETY: every segment holds its rank's values, which nobody
        // writes until every rank passed the barrier after the visits.
        let parts: Vec<&[f32]> = node.bases.iter().zip(&lens).map(|(&b, &len)| unsafe { std::slice::from_raw_parts(b as *const f32, len) }).collect();
        let visited = visit(&parts);
        drop(parts);
        node.fence();
        visited
    }

    fn broadcast(&self, data: &mut [f32], root: usize) -> Result<()> {
        if root >= self.size {
            return Err(mpi_err("broadcast", format!("root {root} is not a rank of a job of {}", self.size)));
        }
        let lens = self.all_gather(&[data.len() as u64])?;
        if let Some(bad) = lens.iter().position(|l| l[0] != data.len() as u64) {
            return Err(mpi_err("broadcast", format!("rank {bad} expects {} values, rank {} expects {}", lens[bad][0], self.rank, data.len())));
        }
        let world = self.comm();
        world.process_at_rank(root as i32).broadcast_into(data);
        Ok(())
    }

    fn all_gather(&self, values: &[u64]) -> Result<Vec<Vec<u64>>> {
        let world = self.comm();
        // The lengths first, so that ranks bringing different counts get an
        // error rather than a buffer overrun.
        let mut lens = vec![0u64; self.size];
        world.all_gather_into(&(values.len() as u64), &mut lens[..]);
        if let Some(bad) = lens.iter().position(|&l| l != values.len() as u64) {
            return Err(mpi_err("all_gather", format!("rank {bad} sent {} values, rank {} sent {}", lens[bad], self.rank, values.len())));
        }
        let mut all = vec![0u64; self.size * values.len()];
        world.all_gather_into(values, &mut all[..]);
        Ok(all.chunks(values.len().max(1)).map(|c| c.to_vec()).take(self.size).collect())
    }

    fn abort(&self, why: &str) {
        eprintln!("voltaic: rank {} of {} failed: {why}; ending the MPI job", self.rank, self.size);
        // Taken if it comes free soon, so that no other thread of this rank
        // (a replica's gradient-summing thread) is inside MPI meanwhile;
        // not waited for longer: the failing thread, or a thread stuck in a
        // collective with a rank that is gone, may hold it for ever.
        let start = std::time::Instant::now();
        let _held = loop {
            match self.world.try_lock() {
                Ok(g) => break Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if start.elapsed() < std::time::Duration::from_secs(2) => std::thread::sleep(std::time::Duration::from_millis(1)),
                Err(std::sync::TryLockError::WouldBlock) => break None,
            }
        };
        // SAFETY: MPI_Abort does not return. With the lock held no other
        // thread of this process is inside an MPI call (every call holds
        // it); without it, one is blocked in a collective that cannot end,
        // and ending the job is what remains (the launcher ends it anyway
        // once this rank is gone).
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 3);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(super::online_cpus("0-63\n"), 64);
        assert_eq!(super::online_cpus("0,2-5,7"), 6);
        assert_eq!(super::online_cpus("0"), 1);
        assert_eq!(super::online_cpus(""), 0);
    }
}
