//! The lazy graph: nodes that produce buffers, and their realization.
//!
//! A [`Tensor`](crate::Tensor) is a node plus a [`Layout`](crate::Layout) into
//! the node's output, so views never create nodes. A node is `Pending` (it
//! holds its op and inputs) until it is realized; then it holds its buffer and
//! drops its inputs, which frees the graph behind it.

pub(crate) mod kernel;
pub(crate) mod realize;
pub(crate) mod schedule;

use crate::device::Device;
use crate::dtype::DType;
use crate::op::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::tensor::Tensor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Pending graphs deeper than this are realized as they are built, so that
/// neither scheduling nor dropping a long chain can exhaust the stack.
pub(crate) const MAX_PENDING_DEPTH: u32 = 1000;

/// A realized buffer on some device.
#[derive(Clone, Debug)]
pub(crate) enum Buffer {
    /// Host memory.
    Cpu(Arc<crate::cpu::pool::HostBuf>),
    /// A pooled GPU buffer.
    Gpu(Arc<crate::gpu::pool::GpuBuf>),
}

/// Parameters of an unfold (im2col) over the last two dims of an NCHW input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct UnfoldParams {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl UnfoldParams {
    /// Output spatial size for an input of `h` x `w`; `None` when the
    /// kernel does not fit (or the sizes overflow).
    pub fn out_hw(&self, h: usize, w: usize) -> Option<[usize; 2]> {
        let f = |i: usize, n: usize| {
            let span = self.dilation[i].checked_mul(self.kernel[i].checked_sub(1)?)?.checked_add(1)?;
            let padded = self.padding[i].checked_mul(2)?.checked_add(n)?;
            if padded < span {
                None
            } else {
                Some((padded - span) / self.stride[i] + 1)
            }
        };
        Some([f(0, h)?, f(1, w)?])
    }
}

/// The op that produces a node's output. Inputs are tensors (node + layout);
/// elementwise ops' inputs are already broadcast to the output shape and of
/// the right dtype.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// A scalar constant (the output holds one element; views broadcast it).
    Const(f64),
    /// A unary primitive.
    Unary(UnaryOp, Tensor),
    /// A binary primitive.
    Binary(BinaryOp, Tensor, Tensor),
    /// A comparison, giving bool.
    Cmp(CmpOp, Tensor, Tensor),
    /// `cond ? a : b`.
    Where(Tensor, Tensor, Tensor),
    /// Conversion to the node's dtype.
    Cast(Tensor),
    /// A contiguous copy.
    Copy(Tensor),
    /// A reduction over the given axes (output keeps them with size 1).
    Reduce(ReduceOp, Tensor, Vec<usize>),
    /// Batched matmul `[..., m, k] @ [..., k, n]` with equal batch dims.
    Matmul(Tensor, Tensor),
    /// `out[i][j] = input[i][index[i][j]]` along `dim`.
    Gather(usize, Tensor, Tensor),
    /// `out = input; out[index[i][j]] += src[i][j]` along `dim`.
    ScatterAdd(usize, Tensor, Tensor, Tensor),
    /// Rows of `input` along `dim` picked by a 1-D index.
    IndexSelect(usize, Tensor, Tensor),
    /// Inclusive prefix sum along `dim`.
    Cumsum(usize, Tensor),
    /// Concatenation along `dim`.
    Cat(usize, Vec<Tensor>),
    /// im2col of an `[N, C, H, W]` input into `[N, C, kh, kw, oh, ow]`, padding with a value.
    Unfold(Tensor, UnfoldParams, f64),
    /// col2im, the adjoint of unfold: patches `[N, C, kh, kw, oh, ow]` added
    /// back into an `[N, C, H, W]` image of size `[H, W]`.
    Fold(Tensor, UnfoldParams, [usize; 2]),
}

impl Op {
    /// The input tensors.
    pub(crate) fn inputs(&self) -> Vec<&Tensor> {
        match self {
            Op::Const(_) => vec![],
            Op::Unary(_, a) | Op::Cast(a) | Op::Copy(a) | Op::Reduce(_, a, _) | Op::Cumsum(_, a) => vec![a],
            Op::Unfold(a, _, _) | Op::Fold(a, _, _) => vec![a],
            Op::Binary(_, a, b) | Op::Cmp(_, a, b) | Op::Matmul(a, b) => vec![a, b],
            Op::Gather(_, a, b) | Op::IndexSelect(_, a, b) => vec![a, b],
            Op::Where(a, b, c) | Op::ScatterAdd(_, a, b, c) => vec![a, b, c],
            Op::Cat(_, v) => v.iter().collect(),
        }
    }

    /// The input tensors, mutably.
    fn inputs_mut(&mut self) -> Vec<&mut Tensor> {
        match self {
            Op::Const(_) => vec![],
            Op::Unary(_, a) | Op::Cast(a) | Op::Copy(a) | Op::Reduce(_, a, _) | Op::Cumsum(_, a) => vec![a],
            Op::Unfold(a, _, _) | Op::Fold(a, _, _) => vec![a],
            Op::Binary(_, a, b) | Op::Cmp(_, a, b) | Op::Matmul(a, b) => vec![a, b],
            Op::Gather(_, a, b) | Op::IndexSelect(_, a, b) => vec![a, b],
            Op::Where(a, b, c) | Op::ScatterAdd(_, a, b, c) => vec![a, b, c],
            Op::Cat(_, v) => v.iter_mut().collect(),
        }
    }

    /// Drop the inputs' autograd records: the graph of values needs none,
    /// and keeping them would tie value nodes and gradient nodes together.
    pub(crate) fn detach_inputs(mut self) -> Op {
        for t in self.inputs_mut() {
            t.grad = None;
        }
        self
    }

    /// Ops whose element `i` depends only on element `i` of each input; the
    /// scheduler fuses chains of them.
    pub(crate) fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Const(_) | Op::Unary(..) | Op::Binary(..) | Op::Cmp(..) | Op::Where(..) | Op::Cast(_) | Op::Copy(_)
        )
    }

    /// A short name for schedules and profiles.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::Const(_) => "const",
            Op::Unary(u, _) => u.name(),
            Op::Binary(b, ..) => b.name(),
            Op::Cmp(c, ..) => c.name(),
            Op::Where(..) => "where",
            Op::Cast(_) => "cast",
            Op::Copy(_) => "copy",
            Op::Reduce(r, ..) => r.name(),
            Op::Matmul(..) => "matmul",
            Op::Gather(..) => "gather",
            Op::ScatterAdd(..) => "scatter_add",
            Op::IndexSelect(..) => "index_select",
            Op::Cumsum(..) => "cumsum",
            Op::Cat(..) => "cat",
            Op::Unfold(..) => "unfold",
            Op::Fold(..) => "fold",
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

impl Node {
    pub(crate) fn new(state: State, dtype: DType, device: Device, dims: Vec<usize>, depth: u32) -> Arc<Node> {
        Arc::new(Node { id: NEXT_ID.fetch_add(1, Ordering::Relaxed), dtype, device, dims, depth, state: Mutex::new(state) })
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
        // Only the input nodes are kept (cloning the tensors would copy their
        // layouts, a cost per node that long chains feel).
        let mut stack: Vec<Arc<Node>> = Vec::new();
        let take = |state: &mut State, stack: &mut Vec<Arc<Node>>| {
            if let State::Pending(op) = std::mem::replace(state, State::Pending(Op::Const(0.0))) {
                stack.extend(op.inputs().into_iter().map(|t| t.node.clone()));
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
