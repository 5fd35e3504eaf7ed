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
    crate::profile::realization_starts();
    let outs = executor(device)?.run(plan, inputs)?;
    log(|| Realization { device, plan: plan.clone(), inputs: inputs.to_vec(), outputs: outs.clone() });
    crate::profile::realization_ends(device, "replayed plan");
    Ok(outs)
}
