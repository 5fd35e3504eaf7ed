//! The lazy graph: nodes that produce buffers.
//!
//! A [`Value`] is a node plus a [`Layout`] into the node's output; a tensor
//! holds one, so views never create nodes. A node is `Pending` (it holds its
//! op and its inputs, themselves values) until it is realized; then it holds
//! its buffer and drops its inputs, which frees the graph behind it.

use crate::backend::Buffer;
use crate::device::Device;
use crate::dtype::DType;
use crate::layout::Layout;
use crate::primitive::{IndexOp, MapOp, ReduceOp};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Pending graphs deeper than this are realized as they are built, so that
/// neither scheduling nor dropping a long chain can exhaust the stack.
pub(crate) const MAX_PENDING_DEPTH: u32 = 1000;

/// A node's output seen through a layout: what an op reads, and what a
/// tensor is apart from its place in differentiation.
#[derive(Clone, Debug)]
pub(crate) struct Value {
    pub node: Arc<Node>,
    pub layout: Layout,
}

impl Value {
    /// Whether the node is computed.
    pub fn is_realized(&self) -> bool {
        matches!(&*self.node.state(), State::Realized(_))
    }
}

/// What a node computes from its inputs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum OpKind {
    /// A scalar constant (the output holds one element; views broadcast it).
    Const(f64),
    /// An elementwise primitive; inputs are already broadcast to the output
    /// shape and of the dtypes the primitive takes.
    Map(MapOp),
    /// A contiguous copy of the one input.
    Copy,
    /// A reduction over the given axes (output keeps them with size 1).
    Reduce(ReduceOp, Vec<usize>),
    /// Batched matmul `[..., m, k] @ [..., k, n]` with equal batch dims.
    Matmul,
    /// An index-like primitive (its inputs in [`IndexOp`]'s order).
    Index(IndexOp),
    /// `x [m, k] @ w.t()` for a block-quantized `w` `[n, k]` given as its
    /// padded blocks (u32 `[n, words per row]`, see `QTensor`); f32.
    QMatmul(crate::quant::GgmlType),
}

/// The op that produces a node's output.
#[derive(Clone, Debug)]
pub(crate) struct Op {
    pub kind: OpKind,
    pub inputs: Vec<Value>,
}

impl Op {
    /// Ops whose element `i` depends only on element `i` of each input; the
    /// scheduler fuses chains of them.
    pub(crate) fn is_elementwise(&self) -> bool {
        matches!(self.kind, OpKind::Const(_) | OpKind::Map(_) | OpKind::Copy)
    }

    /// A short name for schedules and profiles.
    pub(crate) fn name(&self) -> &'static str {
        match &self.kind {
            OpKind::Const(_) => "const",
            OpKind::Map(m) => m.name(),
            OpKind::Copy => "copy",
            OpKind::Reduce(r, _) => r.name(),
            OpKind::Matmul => "matmul",
            OpKind::Index(i) => i.name(),
            OpKind::QMatmul(_) => "qmatmul",
        }
    }
}

/// A node is waiting for its inputs or holds its result.
#[derive(Debug)]
pub(crate) enum State {
    Pending(Op),
    Realized(Buffer),
}

/// One buffer-producing step of the graph.
#[derive(Debug)]
pub(crate) struct Node {
    pub id: u64,
    pub dtype: DType,
    pub device: Device,
    /// Shape of the (contiguous) output.
    pub dims: Vec<usize>,
    /// Longest pending path below this node.
    pub depth: u32,
    pub state: Mutex<State>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The id the next node will get: every node made before now has a smaller one.
pub(crate) fn next_node_id() -> u64 {
    NEXT_ID.load(Ordering::Relaxed)
}

impl Node {
    pub(crate) fn new(state: State, dtype: DType, device: Device, dims: Vec<usize>, depth: u32) -> Arc<Node> {
        crate::profile::node_recorded();
        Arc::new(Node { id: NEXT_ID.fetch_add(1, Ordering::Relaxed), dtype, device, dims, depth, state: Mutex::new(state) })
    }
    /// A pending node for `op`, its depth one more than its deepest pending input.
    pub(crate) fn pending(op: Op, dtype: DType, device: Device, dims: Vec<usize>) -> Arc<Node> {
        let depth = 1 + op
            .inputs
            .iter()
            .map(|v| if matches!(&*v.node.state(), State::Pending(_)) { v.node.depth } else { 0 })
            .max()
            .unwrap_or(0);
        Node::new(State::Pending(op), dtype, device, dims, depth)
    }
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn buffer(&self) -> Option<Buffer> {
        match &*self.state() {
            State::Realized(b) => Some(b.clone()),
            State::Pending(_) => None,
        }
    }
    pub(crate) fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

impl Drop for Node {
    /// Unlink long pending chains iteratively: the default recursive drop of a
    /// deep `Arc` chain could overflow the stack.
    fn drop(&mut self) {
        // Only the input nodes are kept (cloning the values would copy their
        // layouts, a cost per node that long chains feel).
        let mut stack: Vec<Arc<Node>> = Vec::new();
        let take = |state: &mut State, stack: &mut Vec<Arc<Node>>| {
            if let State::Pending(op) = std::mem::replace(state, State::Pending(Op { kind: OpKind::Copy, inputs: vec![] })) {
                stack.extend(op.inputs.into_iter().map(|v| v.node));
            }
        };
        take(self.state.get_mut().unwrap_or_else(|e| e.into_inner()), &mut stack);
        while let Some(t) = stack.pop() {
            if let Ok(mut node) = Arc::try_unwrap(t) {
                take(node.state.get_mut().unwrap_or_else(|e| e.into_inner()), &mut stack);
            }
        }
    }
}
