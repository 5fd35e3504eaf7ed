//! The scheduler: turns the pending graph below some values into a
//! [`Plan`] of kernels, in passes, each in its own file:
//!
//! 1. [`collect`]: the pending subgraph in topological order.
//! 2. [`fuse`]: which elementwise nodes are computed inside their consumers' kernels.
//! 3. [`lower`]: one kernel per remaining node; fused work becomes expressions.
//! 4. [`refine`]: loads walk as few, as simple layouts as possible.
//! 5. [`epilogue`]: elementwise work after a matmul runs in its stores (and
//!    after max pooling's gradient or fold, on each block it makes, where
//!    the executor asks for it: `Capabilities::index_epilogues`).
//! 6. [`rows`]: row-wise work becomes one-pass kernels, where the executor
//!    asks for them (`Capabilities::row_kernels`).
//! 7. [`prologue`]: row-wise or elementwise work before a quantized GEMV
//!    runs in the GEMV's loads, where the executor asks for it
//!    (`Capabilities::prologue_rows`).
//! 8. [`siblings`]: elementwise kernels of one shape that share buffers
//!    become one kernel with several outputs, where the executor runs them
//!    (`Capabilities::multi_output`).
//! 9. [`lifetimes`]: which buffers are kept, and when the others are freed.

pub(crate) mod cache;
pub(crate) mod collect;
pub(crate) mod epilogue;
pub(crate) mod fuse;
pub(crate) mod lifetimes;
pub(crate) mod lower;
pub(crate) mod prologue;
pub(crate) mod refine;
pub(crate) mod rows;
pub(crate) mod siblings;
#[cfg(test)]
pub(crate) mod testing;

use crate::backend::{Buffer, Capabilities};
use crate::graph::{Node, Value};
use crate::ir::Plan;
use crate::profile::{self, Phase};
use std::sync::Arc;

/// A plan and what ties it to the graph: the buffers it runs with, and the
/// nodes that receive its outputs (`store[i]` gets `plan.outputs[i]`).
pub(crate) struct Scheduled {
    pub plan: Arc<Plan>,
    pub inputs: Vec<Buffer>,
    pub store: Vec<Arc<Node>>,
    /// Whether the plan came from the plan cache.
    pub cached: bool,
}

/// Schedule the realization of `targets` for an executor with `caps`,
/// reusing the plan of an earlier graph of the same structure (see [`cache`]).
pub(crate) fn schedule(targets: &[&Value], caps: Capabilities) -> Scheduled {
    let (dag, key) = profile::time(Phase::Collect, || {
        let dag = collect::collect(targets);
        let key = cache::Key::of(&dag, caps);
        (dag, key)
    });
    profile::time(Phase::Schedule, || {
        if let Some(e) = cache::lookup(&key) {
            key.recycle();
            let inputs = e.input_nodes.iter().map(|&p| dag.nodes[p].buffer().expect("a plan input is realized")).collect();
            let store = e.store_nodes.iter().map(|&p| dag.nodes[p].clone()).collect();
            return Scheduled { plan: e.plan_for(&dag), inputs, store, cached: true };
        }
        let (s, entry) = schedule_dag(&dag, caps);
        cache::insert(key, entry);
        s
    })
}

/// Schedule a collected graph; also returns the cache entry of its plan.
pub(crate) fn schedule_dag(dag: &collect::Dag, caps: Capabilities) -> (Scheduled, cache::Entry) {
    let inline = fuse::inline_decisions(dag, caps.max_inputs);
    let survives = lifetimes::survivors(dag, &inline);
    let lower::Lowered { mut plan, slot_of, inputs, input_nodes } = lower::lower(dag, &inline);
    refine::refine(&mut plan);
    let (kept, store) = lifetimes::kept_slots(dag, &slot_of, &survives);
    epilogue::fuse_epilogues(&mut plan, &kept, caps.max_inputs, caps.index_epilogues);
    if caps.row_kernels {
        rows::fuse_rows(&mut plan, &kept, caps.max_inputs);
    }
    prologue::fuse_prologues(&mut plan, &kept, caps.max_inputs, caps.prologue_rows);
    if caps.multi_output {
        siblings::fuse_siblings(&mut plan, &kept, caps.max_inputs);
    }
    lifetimes::plan_lifetimes(&mut plan, &kept, &store);
    let store_nodes = store.iter().map(|(_, n)| dag.index[&n.id]).collect();
    let plan = Arc::new(plan);
    let entry = cache::Entry { plan: plan.clone(), input_nodes, store_nodes };
    (Scheduled { plan, inputs, store: store.into_iter().map(|(_, n)| n).collect(), cached: false }, entry)
}

/// A summary of a plan, for tests and tools: one entry per kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSummary {
    /// Kernel kind (`elementwise`, `reduce`, `matmul`, `rows`, `gather`, ...).
    pub kind: &'static str,
    /// Graph ops fused into it, in build order.
    pub ops: Vec<&'static str>,
    /// Number of buffers it reads.
    pub inputs: usize,
    /// Number of output elements.
    pub numel: usize,
}

/// The kernel summaries of the plan that would realize `targets` on an
/// executor with `caps`, without running it.
pub(crate) fn summarize(targets: &[&Value], caps: Capabilities) -> Vec<KernelSummary> {
    schedule_dag(&collect::collect(targets), caps)
        .0
        .plan
        .kernels
        .iter()
        .map(|k| KernelSummary { kind: k.kind.name(), ops: k.ops.clone(), inputs: k.inputs.len(), numel: k.numel })
        .collect()
}
