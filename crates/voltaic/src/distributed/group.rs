//! Several devices in one process: a [`DeviceGroup`], and [`DataParallel`]
//! training over it (one long-lived host thread per device).

use super::collective::{Collective, LocalGroup};
use super::ddp::{DistributedDataParallel, SyncStats};
use super::workers::Workers;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::nn::Module;
use crate::optim::Optimizer;
use crate::tensor::Tensor;
use std::sync::Arc;

/// The devices a data-parallel run spreads over, in replica order.
///
/// GPUs are named as everywhere (`Device::Gpu(i)`); naming one GPU twice
/// opens a second wgpu device on the same adapter (its own queue, its own
/// memory), so a group of several devices can be tried on one GPU or on
/// lavapipe. Naming the CPU twice gives two CPU replicas sharing the
/// machine's cores.
///
/// ```
/// use voltaic::distributed::DeviceGroup;
/// use voltaic::Device;
/// let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu])?;
/// assert_eq!(group.len(), 2);
/// # Ok::<(), voltaic::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct DeviceGroup {
    devices: Vec<Device>,
}

impl DeviceGroup {
    /// A group of `devices`, opening each (and an extra device on the same
    /// adapter for each repeated GPU).
    pub fn new(devices: &[Device]) -> Result<DeviceGroup> {
        if devices.is_empty() {
            return Err(Error::Value { op: "DeviceGroup::new", msg: "expected at least one device, got none".into() });
        }
        let mut out: Vec<Device> = Vec::with_capacity(devices.len());
        for &d in devices {
            d.check_available("DeviceGroup::new")?;
            out.push(if d.is_gpu() && out.contains(&d) { crate::backend::open_replica(d)? } else { d });
        }
        Ok(DeviceGroup { devices: out })
    }

    /// `n` replicas on `device`: `n` wgpu devices on its adapter, or `n`
    /// CPU replicas.
    pub fn replicas(device: Device, n: usize) -> Result<DeviceGroup> {
        DeviceGroup::new(&vec![device; n])
    }

    /// Every hardware GPU wgpu finds (software adapters left out), or an
    /// error when there is none.
    pub fn gpus() -> Result<DeviceGroup> {
        let gpus: Vec<Device> = crate::backend::adapters().iter().filter(|a| !a.is_software()).map(|a| Device::Gpu(a.index)).collect();
        if gpus.is_empty() {
            return Err(Error::Device { op: "DeviceGroup::gpus", msg: "wgpu found no hardware GPU adapter (software adapters such as lavapipe are left out)".into() });
        }
        DeviceGroup::new(&gpus)
    }

    /// The devices, in replica order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// How many devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// Never true: a group has at least one device.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// The rows of a global batch of `n` examples that rank `rank` of `world`
/// computes: `(start, len)`, the first `n % world` ranks taking one more.
pub fn shard(n: usize, rank: usize, world: usize) -> (usize, usize) {
    let (base, extra) = (n / world, n % world);
    (rank * base + rank.min(extra), base + (rank < extra) as usize)
}

/// Data-parallel training on the devices of this process, as PyTorch's
/// `DistributedDataParallel` with one process per device, here one thread
/// per device: every replica holds the module and an optimizer, computes
/// its rows of each batch, and the replicas' gradients are summed in
/// buckets before every replica takes the same optimizer step.
///
/// With one local replica and an MPI collective it is one rank of a run
/// over several processes or machines ([`DataParallel::with_collectives`]).
///
/// ```
/// use voltaic::distributed::{DataParallel, DeviceGroup};
/// use voltaic::nn::{Forward, Linear, Module};
/// use voltaic::optim::{Optimizer, Sgd};
/// use voltaic::{DType, Device, Tensor};
/// let group = DeviceGroup::new(&[Device::Cpu, Device::Cpu])?;
/// let mut dp = DataParallel::new(&group, |d| Linear::new(4, 1, true, d), |m| Box::new(Sgd::new(m.parameters(), 0.1)))?;
/// let x = Tensor::randn(&[10, 4], DType::F32, Device::Cpu)?;
/// let y = Tensor::randn(&[10, 1], DType::F32, Device::Cpu)?;
/// let first = dp.step(&[&x, &y], |m, b| m.forward(&b[0])?.sub(&b[1])?.sqr()?.mean(&[], false))?.item::<f32>()?;
/// for _ in 0..20 {
///     dp.step(&[&x, &y], |m, b| m.forward(&b[0])?.sub(&b[1])?.sqr()?.mean(&[], false))?;
/// }
/// let last = dp.step(&[&x, &y], |m, b| m.forward(&b[0])?.sub(&b[1])?.sqr()?.mean(&[], false))?.item::<f32>()?;
/// assert!(last < first);
/// # Ok::<(), voltaic::Error>(())
/// ```
pub struct DataParallel<M> {
    replicas: Vec<DistributedDataParallel<M>>,
    optimizers: Vec<Box<dyn Optimizer + Send>>,
    devices: Vec<Device>,
    failed: Option<String>,
    /// One long-lived thread per replica.
    workers: Workers,
}

impl<M: Module> DataParallel<M> {
    /// Build the module on every device of `group` (`build`, called on the
    /// first device first, so a seeded run starts as a one-device run
    /// would) and an optimizer for each (`optimizer`); every replica
    /// starts from the first one's parameters.
    pub fn new(
        group: &DeviceGroup,
        build: impl Fn(Device) -> Result<M>,
        optimizer: impl Fn(&M) -> Box<dyn Optimizer + Send>,
    ) -> Result<DataParallel<M>> {
        DataParallel::with_collectives(group.devices(), LocalGroup::ranks(group.len()), build, optimizer)
    }

    /// As [`DataParallel::new`], with the replicas of this process speaking
    /// through `comms` (one per device, their ranks among all the run's
    /// replicas): with one device and `MpiCollective::world()`, one rank
    /// of a run over several processes.
    pub fn with_collectives(
        devices: &[Device],
        comms: Vec<Arc<dyn Collective>>,
        build: impl Fn(Device) -> Result<M>,
        optimizer: impl Fn(&M) -> Box<dyn Optimizer + Send>,
    ) -> Result<DataParallel<M>> {
        if devices.is_empty() || devices.len() != comms.len() {
            return Err(Error::Value {
                op: "DataParallel::with_collectives",
                msg: format!("expected one collective per device, got {} devices and {} collectives", devices.len(), comms.len()),
            });
        }
        let modules: Vec<M> = devices.iter().map(|&d| build(d)).collect::<Result<_>>()?;
        let workers = Workers::new(devices.len())
            .map_err(|e| Error::Distributed { op: "DataParallel::with_collectives", msg: format!("starting a thread per replica: {e}") })?;
        let replicas: Vec<DistributedDataParallel<M>> = on_threads(&workers, modules.into_iter().zip(comms).zip(devices).map(|((m, c), d)| {
            let abort = c.clone();
            // Replicas on one wgpu device share its command batches.
            let shared = d.is_gpu() && devices.iter().filter(|&e| e == d).count() > 1;
            (abort, move || DistributedDataParallel::new(m, c).map(|r| if shared { r.without_overlap() } else { r }))
        }))?;
        let optimizers = replicas.iter().map(|r| optimizer(r.module())).collect();
        Ok(DataParallel { replicas, optimizers, devices: devices.to_vec(), failed: None, workers })
    }

    /// The first replica's module (every replica holds the same values).
    pub fn module(&self) -> &M {
        self.replicas[0].module()
    }

    /// Replica `i`'s module.
    pub fn replica(&self, i: usize) -> Option<&M> {
        self.replicas.get(i).map(|r| r.module())
    }

    /// The devices of this process's replicas.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The first replica's optimizer (for its state and learning rate).
    pub fn optimizer(&self) -> &dyn Optimizer {
        &*self.optimizers[0]
    }

    /// Set every replica's learning rate.
    pub fn set_lr(&mut self, lr: f64) {
        for o in &mut self.optimizers {
            o.set_lr(lr);
        }
    }

    /// Reduce gradients in buckets of about `bytes` after a first one of
    /// `first` bytes (PyTorch's defaults, 1 MiB and 25 MiB, otherwise).
    pub fn set_bucket_bytes(&mut self, first: usize, bytes: usize) {
        for r in &mut self.replicas {
            r.set_bucket_bytes(first, bytes);
        }
    }

    /// What each replica's last gradient synchronisation cost.
    pub fn last_sync(&self) -> Vec<SyncStats> {
        self.replicas.iter().map(|r| r.last_sync()).collect()
    }

    /// Wait until every replica's gradient sums of the last step are
    /// uploaded; the first error of one that failed (a step may return
    /// before its sums end: see [`step`](Self::step)). After an error,
    /// later steps are refused, as after a failed step.
    pub fn synchronize(&mut self) -> Result<()> {
        let mut first = None;
        for r in &self.replicas {
            if let Err(e) = r.synchronize() {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => {
                self.failed = Some(e.to_string());
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// One training step on a global batch: each of `batch`'s tensors is
    /// split along dim 0 over all the run's replicas ([`shard`]), each
    /// replica's rows are moved to its device, `loss` gives the mean loss
    /// of a replica's rows, and after the backward passes, the gradient
    /// sum and the optimizer steps, the whole batch's loss is returned as
    /// a one-element tensor on the first device. On GPUs the step may
    /// return before the last gradients are summed (see
    /// [`DistributedDataParallel::backward`]): reading the loss waits for
    /// them, so read it only as often as it is logged.
    ///
    /// An error on any replica (a device out of memory or lost, a failing
    /// `loss`) is returned from every replica's side at once; the replicas
    /// may then differ, so later steps are refused: rebuild from a
    /// checkpoint.
    pub fn step<F>(&mut self, batch: &[&Tensor], loss: F) -> Result<Tensor>
    where
        F: Fn(&M, &[Tensor]) -> Result<Tensor> + Sync,
    {
        if let Some(why) = &self.failed {
            return Err(Error::Distributed { op: "DataParallel::step", msg: format!("an earlier step failed ({why}); the replicas may differ: rebuild from a checkpoint") });
        }
        let Some(n) = batch.first().map(|t| t.dims().first().copied().unwrap_or(0)) else {
            return Err(Error::Value { op: "DataParallel::step", msg: "expected at least one batch tensor, got none".into() });
        };
        if n == 0 {
            // An empty step would still move the weights (momentum, weight decay).
            return Err(Error::Shape { op: "DataParallel::step", msg: "the batch is empty (its first dim is 0)".into() });
        }
        if let Some(t) = batch.iter().find(|t| t.dims().first().copied().unwrap_or(0) != n || t.rank() == 0) {
            return Err(Error::Shape {
                op: "DataParallel::step",
                msg: format!("every batch tensor must have the batch size {n} as its first dim; got shape {:?}", t.dims()),
            });
        }
        let (grad, autocast) = (crate::is_grad_enabled(), crate::autocast_dtype());
        let loss = &loss;
        let jobs = self.replicas.iter().zip(self.optimizers.iter_mut()).zip(&self.devices).map(|((r, opt), &device)| {
            let comm = r.comm().clone();
            (comm, move || -> Result<Tensor> {
                let _a = crate::AutocastGuard::new(autocast);
                let _g = (!grad).then(crate::NoGradGuard::new);
                let comm = r.comm();
                let (start, len) = shard(n, comm.rank(), comm.world_size());
                opt.zero_grad();
                let value = if len == 0 {
                    r.backward(&Tensor::zeros(&[], crate::DType::F32, device)?, 0.0)?
                } else {
                    let rows: Vec<Tensor> = batch.iter().map(|t| t.narrow(0, start, len)?.to_device(device)).collect::<Result<_>>()?;
                    let l = loss(r.module(), &rows)?;
                    r.backward(&l, len as f64 / n as f64)?
                };
                opt.step()?;
                r.module().realize_state()?;
                Ok(value)
            })
        });
        match on_threads(&self.workers, jobs) {
            Ok(mut values) => Ok(values.swap_remove(0)),
            Err(e) => {
                self.failed = Some(e.to_string());
                Err(e)
            }
        }
    }
}

/// Run each job on its replica's thread; when one fails (or panics) its
/// collective is aborted so the others stop waiting. The first root cause
/// is returned (an error of the failing replica, not the others' "replica
/// N failed").
fn on_threads<'a, T: Send + 'a, F: FnOnce() -> Result<T> + Send + 'a>(workers: &Workers, jobs: impl Iterator<Item = (Arc<dyn Collective>, F)>) -> Result<Vec<T>> {
    let jobs: Vec<Box<dyn FnOnce() -> Result<T> + Send + 'a>> = jobs
        .map(|(comm, job)| {
            Box::new(move || {
                let out = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)) {
                    Ok(r) => r,
                    Err(p) => {
                        let what = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
                        Err(Error::Distributed { op: "DataParallel", msg: format!("replica {} panicked: {what}", comm.rank()) })
                    }
                };
                if let Err(e) = &out {
                    comm.abort(&e.to_string());
                }
                out
            }) as Box<dyn FnOnce() -> Result<T> + Send + 'a>
        })
        .collect();
    let results: Vec<Result<T>> = workers
        .run(jobs)
        .into_iter()
        .map(|r| r.unwrap_or_else(|_| Err(Error::Distributed { op: "DataParallel", msg: "a replica thread died".into() })))
        .collect();
    let mut first_any = None;
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) => {
                let follower = matches!(&e, Error::Distributed { op, .. } if *op == super::collective::PEER_FAILED);
                if !follower {
                    return Err(e);
                }
                first_any.get_or_insert(e);
            }
        }
    }
    match first_any {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::shard;

    #[test]
    fn shards_cover_the_batch_in_order() {
        for n in 0..20 {
            for w in 1..6 {
                let mut next = 0;
                for r in 0..w {
                    let (s, l) = shard(n, r, w);
                    assert_eq!(s, next);
                    next += l;
                }
                assert_eq!(next, n);
            }
        }
    }
}
