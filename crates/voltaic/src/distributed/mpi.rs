//! The ranks of an MPI job as a [`Collective`] (the `mpi` feature: rsmpi
//! over the system's MPI, e.g. Debian's Open MPI).

use super::collective::{par_copy, Collective};
use crate::error::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;
use std::sync::Mutex;

/// This process's rank of an MPI job (`mpirun -np N ...`): gradients are
/// summed with `MPI_Allreduce` over host memory. MPI is initialised by
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
        Ok(MpiCollective { world: Mutex::new(world), send: Mutex::new(Vec::new()), recv: Mutex::new(Vec::new()), rank, size, local_rank, _universe: universe })
    }

    fn comm(&self) -> std::sync::MutexGuard<'_, SimpleCommunicator> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
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
        // Every rank must bring the same length: MPI cannot check it, and a
        // mismatch would corrupt memory, so the lengths are compared first.
        let lens = self.all_gather(&[data.len() as u64])?;
        if let Some(bad) = lens.iter().position(|l| l[0] != data.len() as u64) {
            return Err(mpi_err("all_reduce", format!("rank {bad} reduces {} values, rank {} reduces {}", lens[bad][0], self.rank, data.len())));
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
        let lens = self.all_gather(&[src.len() as u64])?;
        if let Some(bad) = lens.iter().position(|l| l[0] != src.len() as u64) {
            return Err(mpi_err("all_reduce", format!("rank {bad} reduces {} values, rank {} reduces {}", lens[bad][0], self.rank, src.len())));
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
        // Not through the lock: the failing thread may hold it.
        // SAFETY: MPI_Abort does not return. At the Serialized level no
        // other thread may be inside an MPI call meanwhile: a process runs
        // one replica, whose thread is the one failing here (or the main
        // thread after it), so none is.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 3);
        }
    }
}
