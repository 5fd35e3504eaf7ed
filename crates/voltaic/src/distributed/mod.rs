//! Data-parallel training over several devices and several processes.
//!
//! wgpu gives every adapter its own device with no shared memory, so the
//! gradients of the replicas meet on the host: each replica realises its
//! gradients in buckets (the last layers' first, as backward produces
//! them), reads each bucket back while the device computes the next, and a
//! [`Collective`] sums the buckets over all replicas. Within one process
//! the replicas are threads ([`LocalGroup`], [`DataParallel`] over a
//! [`DeviceGroup`]); across processes and machines they are MPI ranks
//! (`MpiCollective`, behind the `mpi` cargo feature), each running one
//! [`DataParallel`] replica.
//!
//! Every replica starts from rank 0's parameters and takes the same
//! optimizer step on the same summed gradients, so a run over `n` devices
//! computes what one device computes on the whole batch (to rounding: the
//! sums are grouped differently). The replicas stay bitwise equal where
//! they compute alike (devices of one kind, an in-process group);
//! parameters are not compared or re-synchronised after the start, so a
//! group mixing kinds of device (a CPU and a GPU), or MPI ranks whose sum
//! differs by rank, may drift apart in the last bits. Random ops (dropout)
//! draw from the one process-wide generator in whatever order the replica
//! threads reach it: such runs do not repeat exactly.

mod collective;
mod ddp;
mod group;
#[cfg(feature = "mpi")]
mod mpi;
mod workers;

pub use collective::{Collective, LocalGroup};
pub use ddp::{DistributedDataParallel, SyncStats};
pub use group::{shard, DataParallel, DeviceGroup};
#[cfg(feature = "mpi")]
pub use mpi::MpiCollective;
