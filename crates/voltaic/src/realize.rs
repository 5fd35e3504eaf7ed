//! Realization: schedule the pending graph, run the plan on its device's
//! executor, and hand each kept buffer to its node.

use crate::backend::executor;
use crate::device::Device;
use crate::error::Result;
use crate::graph::{State, Value};
use crate::schedule::schedule;

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
        for (node, buf) in s.store.iter().zip(outs) {
            *node.state() = State::Realized(buf);
        }
        crate::profile::realization_ends(d, s.cached);
    }
    Ok(())
}
