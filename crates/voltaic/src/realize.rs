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

/// Start logging this thread's realizations. Captures do not nest.
pub(crate) fn start_log() -> Result<()> {
    LOG.with(|l| {
        let mut l = l.borrow_mut();
        if l.is_some() {
            bail!(Value, "capture", "a captured step ran another capture inside it; captures do not nest");
        }
        *l = Some(Vec::new());
        Ok(())
    })
}

/// Stop logging and return what was logged since [`start_log`].
pub(crate) fn end_log() -> Vec<Realization> {
    LOG.with(|l| l.borrow_mut().take().unwrap_or_default())
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
        LOG.with(|l| {
            if let Some(log) = l.borrow_mut().as_mut() {
                log.push(Realization { device: d, plan: s.plan.clone(), inputs: s.inputs.clone(), outputs: outs });
            }
        });
        crate::profile::realization_ends(d, if s.cached { "cached plan" } else { "new plan" });
    }
    Ok(())
}

/// Run a logged plan again on `device` with other input buffers: no graph,
/// no scheduling; the outputs in the plan's order.
pub(crate) fn replay(device: Device, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
    crate::profile::realization_starts();
    let outs = executor(device)?.run(plan, inputs)?;
    crate::profile::realization_ends(device, "replayed plan");
    Ok(outs)
}
