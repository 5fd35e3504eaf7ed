//! Realization: schedule the pending graph, run the plan on its device's
//! executor, and hand each kept buffer to its node. While a capture is
//! open on a thread (see `tensor`'s `Capture`), each realization is also
//! logged with its plan and buffers, so that it can be run again without
//! the graph.

use crate::backend::{executor, Buffer};
use crate::device::Device;
use crate::error::{bail, Result};
use crate::graph::{State, Value};
use crate::ir::Plan;
use crate::schedule::schedule;
use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::Arc;

/// One realization as it ran: the plan, the buffers it read, and the
/// buffers it stored (`outputs[i]` for `plan.outputs[i]`).
pub(crate) struct Realization {
    pub device: Device,
    pub plan: Arc<Plan>,
    pub inputs: Vec<Buffer>,
    pub outputs: Vec<Buffer>,
}

thread_local! {
    /// The realizations of the open capture on this thread, if one is open.
    static LOG: RefCell<Option<Vec<Realization>>> = const { RefCell::new(None) };
}

/// This thread's realizations are logged while a `Log` lives; dropping it
/// (an error or a panic in the step) closes the log. Logs do not nest.
pub(crate) struct Log(());

impl Log {
    /// Start logging this thread's realizations.
    pub(crate) fn start() -> Result<Log> {
        LOG.with(|l| {
            let mut l = l.borrow_mut();
            if l.is_some() {
                bail!(Value, "capture", "a captured step ran another capture inside it; captures do not nest");
            }
            if is_dry() {
                bail!(Value, "capture", "a step was captured inside voltaic::dry_run, which runs nothing to capture");
            }
            *l = Some(Vec::new());
            Ok(Log(()))
        })
    }

    /// Stop logging; what was logged since [`Log::start`].
    pub(crate) fn end(self) -> Vec<Realization> {
        LOG.with(|l| l.borrow_mut().take().unwrap_or_default())
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        LOG.with(|l| l.borrow_mut().take());
    }
}

/// The dry run open on a thread (see [`dry_run`]).
struct Dry {
    /// The first node id of the outermost dry run: nodes made before it are
    /// not the dry run's to realize.
    first: u64,
    /// Nodes the dry run realized: their buffers hold no values to read.
    realized: HashSet<u64>,
}

thread_local! {
    static DRY: RefCell<Option<Dry>> = const { RefCell::new(None) };
}

/// Run `f` as a dry run: everything it records is scheduled and every
/// kernel its realizations need is compiled (into the device's kernel
/// cache and the plan cache), but nothing runs on the device. A realized
/// tensor holds a buffer of the right size whose contents are undefined,
/// so the code after a realization goes on as it would, and reading a
/// value the dry run computed is an error (uploads read as usual). This is ahead-of-time compilation, as `jax.jit(f).lower(x).compile()`
/// is: a training loop calls it on a thread of its own with a step on its
/// last, smaller batch (a copy of the model and optimizer), so that when
/// that batch comes its kernels are ready instead of compiled on the spot.
/// On the CPU there is nothing to compile and a dry run only allocates.
///
/// A dry run only realizes tensors made inside it: one made before it and
/// still pending would be left holding undefined values, so realizing it
/// there is an error (realize it first). Random numbers drawn inside come
/// from a generator of the thread's own, so the default stream
/// ([`manual_seed`](crate::manual_seed)) is where it would have been
/// without the dry run.
///
/// ```
/// use voltaic::{Device, DType, Tensor};
/// let x = Tensor::ones(&[3, 5], DType::F32, Device::Cpu)?;
/// let y = voltaic::dry_run(|| -> voltaic::Result<Vec<usize>> {
///     let y = x.exp()?.sum(&[1], false)?;
///     y.realize()?; // scheduled, compiled, not computed
///     assert!(y.to_vec::<f32>().is_err()); // nothing to read in a dry run
///     Ok(y.dims().to_vec())
/// })?;
/// assert_eq!(y, [3]);
/// # Ok::<(), voltaic::Error>(())
/// ```
pub fn dry_run<R>(f: impl FnOnce() -> R) -> R {
    if is_dry() {
        return f(); // nested: part of the outer dry run
    }
    /// Closes the dry run however `f` ends.
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            DRY.with(|d| d.borrow_mut().take());
        }
    }
    DRY.with(|d| *d.borrow_mut() = Some(Dry { first: crate::graph::next_node_id(), realized: HashSet::new() }));
    let _close = Close;
    crate::rng::with_own_generator(f)
}

/// Whether this thread is inside [`dry_run`].
pub(crate) fn is_dry() -> bool {
    DRY.with(|d| d.borrow().is_some())
}

/// Whether node `id` was realized by this thread's open dry run (its
/// buffer holds no values).
pub(crate) fn realized_dry(id: u64) -> bool {
    DRY.with(|d| d.borrow().as_ref().is_some_and(|d| d.realized.contains(&id)))
}

/// Log a realization if a log is open.
fn log(r: impl FnOnce() -> Realization) {
    LOG.with(|l| {
        if let Some(log) = l.borrow_mut().as_mut() {
            log.push(r());
        }
    });
}

/// Realize `targets`, grouped by device.
pub(crate) fn realize(targets: &[&Value]) -> Result<()> {
    let pending: Vec<&Value> = targets.iter().copied().filter(|t| !t.is_realized()).collect();
    if pending.is_empty() {
        return Ok(());
    }
    crate::profile::realization_starts();
    let mut devices: Vec<Device> = pending.iter().map(|t| t.node.device).collect();
    devices.dedup();
    for d in devices {
        let group: Vec<&Value> = pending.iter().copied().filter(|t| t.node.device == d).collect();
        let exec = executor(d)?;
        let s = schedule(&group, exec.capabilities());
        if let Some(first) = DRY.with(|d| d.borrow().as_ref().map(|d| d.first)) {
            if let Some(n) = s.store.iter().find(|n| n.id < first) {
                bail!(
                    Value,
                    "dry_run",
                    "a {:?} {} tensor made before the dry run began is still pending and would be left without its values; realize it before the dry run",
                    n.dims,
                    n.dtype
                );
            }
            // Compiled, not run: nothing is logged (a capture replays what ran).
            let outs = exec.dry_run(&s.plan, &s.inputs)?;
            for (node, buf) in s.store.iter().zip(&outs) {
                *node.state() = State::Realized(buf.clone());
            }
            DRY.with(|d| d.borrow_mut().as_mut().map(|d| d.realized.extend(s.store.iter().map(|n| n.id))));
            crate::profile::realization_ends(d, "dry run");
            continue;
        }
        let outs = exec.run(&s.plan, &s.inputs)?;
        for (node, buf) in s.store.iter().zip(&outs) {
            *node.state() = State::Realized(buf.clone());
        }
        log(|| Realization { device: d, plan: s.plan.clone(), inputs: s.inputs.clone(), outputs: outs });
        crate::profile::realization_ends(d, if s.cached { "cached plan" } else { "new plan" });
    }
    Ok(())
}

/// Run a logged plan again on `device` with other input buffers: no graph,
/// no scheduling; the outputs in the plan's order. Logged like any
/// realization (a replay inside a traced step is part of that step).
pub(crate) fn replay(device: Device, plan: &Arc<Plan>, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
    if is_dry() {
        bail!(Value, "capture", "a captured step was replayed inside voltaic::dry_run; a replay runs its kernels, so it has no dry form");
    }
    crate::profile::realization_starts();
    let outs = executor(device)?.run(plan, inputs)?;
    log(|| Realization { device, plan: plan.clone(), inputs: inputs.to_vec(), outputs: outs.clone() });
    crate::profile::realization_ends(device, "replayed plan");
    Ok(outs)
}
