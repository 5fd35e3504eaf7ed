//! Realization: schedule the pending graph, run the plan on its device's
//! executor, and hand each kept buffer to its node.

use super::schedule::{schedule, Plan, SlotSource};
use super::{Buffer, State};
use crate::device::Device;
use crate::error::Result;
use crate::tensor::Tensor;

/// Realize `targets`, grouped by device.
pub(crate) fn realize(targets: &[&Tensor]) -> Result<()> {
    let pending: Vec<&Tensor> = targets.iter().copied().filter(|t| !t.is_realized()).collect();
    if pending.is_empty() {
        return Ok(());
    }
    let mut devices: Vec<Device> = pending.iter().map(|t| t.device()).collect();
    devices.dedup();
    for d in devices {
        let group: Vec<&Tensor> = pending.iter().copied().filter(|t| t.device() == d).collect();
        let plan = schedule(&group, d.is_gpu());
        run(&plan, d)?;
    }
    Ok(())
}

/// Run a plan on its device's executor and store the results in their nodes.
fn run(plan: &Plan, device: Device) -> Result<()> {
    let mut stored = match device {
        Device::Cpu => run_cpu(plan)?,
        Device::Gpu(i) => crate::gpu::exec::run_plan(&crate::gpu::context(i)?, plan)?,
    };
    for (s, node) in &plan.store {
        let buf = stored[*s].take().expect("kept slot was computed");
        *node.state() = State::Realized(buf);
    }
    Ok(())
}

/// Run a plan kernel by kernel on the CPU; returns the buffers of kept slots.
fn run_cpu(plan: &Plan) -> Result<Vec<Option<Buffer>>> {
    let mut bufs: Vec<Option<Buffer>> = plan
        .slots
        .iter()
        .map(|s| match &s.source {
            SlotSource::External(b) => Some(b.clone()),
            SlotSource::Kernel => None,
        })
        .collect();
    let mut store: Vec<Option<Buffer>> = vec![None; plan.slots.len()];
    let keep: std::collections::HashSet<usize> = plan.store.iter().map(|(s, _)| *s).collect();
    let profile = crate::gpu::transfer::profiling();
    let mut times = vec![];
    for (k, kernel) in plan.kernels.iter().enumerate() {
        let t0 = std::time::Instant::now();
        let out = crate::cpu::run_kernel(kernel, &bufs)?;
        if profile {
            times.push((t0.elapsed().as_secs_f64() * 1e6, kernel.numel, format!("{} ({})", kernel.kind.name(), kernel.ops.join(" "))));
        }
        if keep.contains(&kernel.out) {
            store[kernel.out] = Some(out.clone());
        }
        bufs[kernel.out] = Some(out);
        for &s in &plan.free_after[k] {
            bufs[s] = None;
        }
    }
    for (s, _) in &plan.store {
        if store[*s].is_none() {
            store[*s] = bufs[*s].clone();
        }
    }
    if profile && !times.is_empty() {
        eprintln!("voltaic profile (cpu):");
        for (us, n, label) in &times {
            eprintln!("  {us:>10.1} us  {n:>12} elements  {label}");
        }
    }
    Ok(store)
}
