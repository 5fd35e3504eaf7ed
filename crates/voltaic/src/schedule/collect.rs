//! Pass 1, collect: the pending subgraph below the targets, in topological
//! order (inputs before the nodes that read them), with each node's
//! consumers. Realized nodes that pending ones read are included, without
//! an op: they become the plan's inputs.

use crate::graph::{Node, Op, State, Value};
// Maps keyed by node ids are rebuilt on every realization: a fast hasher,
// not SipHash (whose DoS resistance these keys do not need).
use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

/// The collected subgraph. Index `i` is a node's position in topological order.
pub(crate) struct Dag {
    pub nodes: Vec<Arc<Node>>,
    /// Each node's op (cloned out of its lock); `None` for a realized node.
    pub ops: Vec<Option<Op>>,
    /// Position of a node by its id.
    pub index: HashMap<u64, usize>,
    /// Distinct nodes that read each node.
    pub consumers: Vec<Vec<usize>>,
    /// Number of input edges that point at each node (with repeats).
    pub edges_in: Vec<usize>,
    /// Whether a node was asked for.
    pub target: Vec<bool>,
}

impl Dag {
    /// Position of the node a value reads.
    pub fn pos(&self, v: &Value) -> usize {
        self.index[&v.node.id]
    }
}

/// Collect the pending subgraph below `targets`.
pub(crate) fn collect(targets: &[&Value]) -> Dag {
    let mut g = Dag { nodes: vec![], ops: vec![], index: HashMap::new(), consumers: vec![], edges_in: vec![], target: vec![] };
    // Iterative post-order DFS (graphs can be deep); an expanded entry carries its node's op.
    enum Visit {
        Enter(Arc<Node>),
        Leave(Arc<Node>, Option<Op>),
    }
    let mut stack: Vec<Visit> = targets.iter().map(|t| Visit::Enter(t.node.clone())).collect();
    while let Some(visit) = stack.pop() {
        match visit {
            Visit::Leave(node, op) => {
                if let std::collections::hash_map::Entry::Vacant(e) = g.index.entry(node.id) {
                    e.insert(g.nodes.len());
                    g.nodes.push(node);
                    g.ops.push(op);
                }
            }
            Visit::Enter(node) => {
                if g.index.contains_key(&node.id) {
                    continue;
                }
                let op = match &*node.state() {
                    State::Pending(op) => Some(op.clone()),
                    State::Realized(_) => None,
                };
                let inputs: Vec<Arc<Node>> = match &op {
                    Some(op) => op.inputs.iter().rev().filter(|v| !g.index.contains_key(&v.node.id)).map(|v| v.node.clone()).collect(),
                    None => vec![],
                };
                stack.push(Visit::Leave(node, op));
                stack.extend(inputs.into_iter().map(Visit::Enter));
            }
        }
    }
    let n = g.nodes.len();
    g.consumers = vec![vec![]; n];
    g.edges_in = vec![0; n];
    g.target = vec![false; n];
    for (i, op) in g.ops.iter().enumerate() {
        if let Some(op) = op {
            for v in &op.inputs {
                let j = g.index[&v.node.id];
                g.edges_in[j] += 1;
                // Consumers arrive in increasing order, so a repeat can
                // only be the last one pushed (an op reading a node twice).
                if g.consumers[j].last() != Some(&i) {
                    g.consumers[j].push(i);
                }
            }
        }
    }
    for t in targets {
        let i = g.index[&t.node.id];
        g.target[i] = true;
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::testing::*;

    #[test]
    fn a_diamond_is_collected_inputs_first_with_its_consumers() {
        let x = input(&[4]);
        let a = unary(&x, crate::primitive::UnaryOp::Exp);
        let b = unary(&x, crate::primitive::UnaryOp::Neg);
        let y = binary(&a, &b, crate::primitive::BinaryOp::Add);
        let g = collect(&[&y]);
        assert_eq!(g.nodes.len(), 4);
        let (px, pa, pb, py) = (g.pos(&x), g.pos(&a), g.pos(&b), g.pos(&y));
        assert!(px < pa && px < pb && pa < py && pb < py, "topological order");
        assert!(g.ops[px].is_none(), "a realized input has no op");
        let mut cx = g.consumers[px].clone();
        cx.sort_unstable();
        let mut want = vec![pa, pb];
        want.sort_unstable();
        assert_eq!(cx, want);
        assert_eq!(g.consumers[py], Vec::<usize>::new());
        assert!(g.target[py] && !g.target[pa]);
    }

    #[test]
    fn a_node_read_twice_by_one_op_has_one_consumer_and_two_edges() {
        let x = input(&[3]);
        let y = binary(&x, &x, crate::primitive::BinaryOp::Mul);
        let g = collect(&[&y]);
        assert_eq!(g.consumers[g.pos(&x)], vec![g.pos(&y)]);
        assert_eq!(g.edges_in[g.pos(&x)], 2);
    }
}
