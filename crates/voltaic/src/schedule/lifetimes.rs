//! Pass 9, lifetimes: which buffers the realization hands back to their
//! nodes, and after which kernel every other buffer can be dropped.
//!
//! A node keeps its buffer when something outside the plan still refers to
//! it (a user's tensor, a pending node that is not part of this
//! realization) or when it was asked for; everything else is freed after
//! its last reader.

use super::collect::Dag;
use crate::graph::Node;
use crate::ir::{Plan, Slot};
use foldhash::HashSet;
use std::sync::Arc;

/// Whether each node of `g` stays referenced after the realization: held
/// from outside the graph, or read by an inlined node that itself stays.
pub(crate) fn survivors(g: &Dag, inline: &[bool]) -> Vec<bool> {
    let n = g.nodes.len();
    let mut survives: Vec<bool> = (0..n)
        .map(|i| {
            // Our own references: `g.nodes`, and each edge twice (the
            // consumer's op and our clone of it).
            let internal = 1 + 2 * g.edges_in[i];
            g.target[i] || Arc::strong_count(&g.nodes[i]) > internal
        })
        .collect();
    for i in (0..n).rev() {
        if !survives[i] {
            survives[i] = g.consumers[i].iter().any(|&c| inline[c] && survives[c]);
        }
    }
    survives
}

/// The slots of surviving nodes that the plan computes, and those nodes.
pub(crate) fn kept_slots(g: &Dag, slot_of: &[Option<Slot>], survives: &[bool]) -> (HashSet<Slot>, Vec<(Slot, Arc<Node>)>) {
    let mut kept = HashSet::default();
    let mut store = vec![];
    for i in 0..g.nodes.len() {
        if let (Some(s), Some(_), true) = (slot_of[i], &g.ops[i], survives[i]) {
            kept.insert(s);
            store.push((s, g.nodes[i].clone()));
        }
    }
    (kept, store)
}

/// Fill in `plan.free_after` and `plan.outputs` (the kept slots, in `store`'s order).
pub(crate) fn plan_lifetimes(plan: &mut Plan, kept: &HashSet<Slot>, store: &[(Slot, Arc<Node>)]) {
    let mut last_use: Vec<Option<usize>> = vec![None; plan.slots.len()];
    for (k, kern) in plan.kernels.iter().enumerate() {
        for &s in &kern.inputs {
            last_use[s] = Some(k);
        }
    }
    plan.free_after = vec![vec![]; plan.kernels.len()];
    for (s, lu) in last_use.iter().enumerate() {
        if let (Some(k), false) = (lu, kept.contains(&s)) {
            plan.free_after[*k].push(s);
        }
    }
    // Kernel outputs nobody reads and nobody keeps are still computed (they
    // were asked for), so nothing more to do for them.
    plan.outputs = store.iter().map(|(s, _)| *s).collect();
}

#[cfg(test)]
mod tests {
    use crate::primitive::{ReduceOp, UnaryOp};
    use crate::schedule::testing::*;
    use crate::schedule::{schedule, Scheduled};

    #[test]
    fn an_intermediate_is_freed_after_its_last_reader_and_targets_are_kept() {
        let x = input(&[4]);
        // Only the graph refers to the intermediates.
        let y = {
            let a = unary(&x, UnaryOp::Exp);
            let s = reduce(&a, ReduceOp::Sum, &[0]);
            let m = reduce(&a, ReduceOp::Max, &[0]);
            crate::schedule::testing::binary(&s, &m, crate::primitive::BinaryOp::Add)
        };
        let Scheduled { plan, store, .. } = schedule(&[&y], cpu_caps());
        assert_eq!(plan.kernels.len(), 4);
        // exp's buffer dies after the second reduction; y is the one output.
        let a_slot = plan.kernels[0].out;
        assert!(plan.free_after[2].contains(&a_slot), "{:?}", plan.free_after);
        assert_eq!(store.len(), plan.outputs.len());
        assert_eq!(plan.outputs, vec![plan.kernels[3].out]);
    }

    #[test]
    fn a_node_still_held_outside_the_plan_keeps_its_buffer() {
        let x = input(&[4]);
        let a = unary(&x, UnaryOp::Exp);
        let s = reduce(&a, ReduceOp::Sum, &[0]);
        let m = reduce(&a, ReduceOp::Max, &[0]);
        // `a` is held here (like a user's tensor): its buffer is stored in its node.
        let Scheduled { plan, store, .. } = schedule(&[&s, &m], cpu_caps());
        assert!(store.iter().any(|n| n.id == a.node.id));
        assert!(plan.free_after.iter().all(|f| !f.contains(&plan.kernels[0].out)));
    }
}
