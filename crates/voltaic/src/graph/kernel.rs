//! Kernels: what the scheduler hands to an executor.
//!
//! A kernel writes one contiguous output buffer. Fused elementwise work is an
//! [`Expr`] (a small SSA program over loads and constants) that both the CPU
//! interpreter and the WGSL code generator consume.

use crate::dtype::DType;
use crate::graph::UnfoldParams;
use crate::layout::Layout;
use crate::op::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

/// Index of a buffer slot in a [`Plan`].
pub(crate) type Slot = usize;

/// How a load finds its element: `path[0]` maps the kernel's multi-index to a
/// linear position; each further layout maps that position (unravelled in its
/// own shape) onward. The last result is the offset in the buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Load {
    /// Which of the kernel's inputs.
    pub input: usize,
    /// The element type stored in the buffer.
    pub dtype: DType,
    /// Never empty; `path[0]` has the kernel's iteration shape.
    pub path: Vec<Layout>,
}

/// One instruction of a fused expression. Operands are earlier instruction indices.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Instr {
    Load(usize),
    Const(f64),
    Unary(UnaryOp, usize),
    Binary(BinaryOp, usize, usize),
    Cmp(CmpOp, usize, usize),
    Where(usize, usize, usize),
    Cast(usize),
}

impl std::hash::Hash for Instr {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match self {
            Instr::Load(a) | Instr::Cast(a) => a.hash(h),
            Instr::Const(c) => c.to_bits().hash(h),
            Instr::Unary(op, a) => (op, a).hash(h),
            Instr::Binary(op, a, b) => (op, a, b).hash(h),
            Instr::Cmp(op, a, b) => (op, a, b).hash(h),
            Instr::Where(c, a, b) => (c, a, b).hash(h),
        }
    }
}

/// A fused elementwise program; the last instruction is the result.
#[derive(Clone, Debug, Default, PartialEq, Hash)]
pub(crate) struct Expr {
    /// Instructions and the dtype of each one's value.
    pub instrs: Vec<(Instr, DType)>,
    pub loads: Vec<Load>,
}

impl Expr {
    /// Dtype of the result.
    pub fn dtype(&self) -> DType {
        self.instrs.last().map(|i| i.1).unwrap_or(DType::F32)
    }
}

/// Elementwise work fused after a matmul: `expr` over `shape` (the product's
/// elements in order), where load `acc` stands for the product itself and
/// the other loads read the kernel's inputs.
#[derive(Clone, Debug, PartialEq, Hash)]
pub(crate) struct Epilogue {
    pub expr: Expr,
    pub shape: Vec<usize>,
    pub acc: usize,
    /// The product's dtype (the value is rounded to it before the epilogue).
    pub acc_dtype: DType,
}

/// One step of a [`KernelKind::Rows`] kernel, computed for each row.
#[derive(Clone, Debug, PartialEq, Hash)]
pub(crate) struct RowStage {
    /// `Some(op)`: reduce `expr` over the row's `inner` elements (element
    /// `l = row * inner + j` of `shape`); `None`: evaluate `expr` once per row
    /// (at `l = row`), or, for the kernel's output stage, at every element.
    pub op: Option<ReduceOp>,
    pub expr: Expr,
    /// Iteration shape of `expr`.
    pub shape: Vec<usize>,
    /// Loads that stand for an earlier stage's per-row value: (load, stage).
    pub from: Vec<(usize, usize)>,
    /// Dtype of the stage's value.
    pub dtype: DType,
}

/// A strided read of a whole input buffer by a non-fused kernel.
#[derive(Clone, Debug, PartialEq, Hash)]
pub(crate) struct View {
    pub input: usize,
    pub layout: Layout,
}

/// What a kernel computes. Equal kinds generate equal code, so executors
/// cache compiled kernels by it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum KernelKind {
    /// `out[i] = expr(i)` over `shape`.
    Elementwise { expr: Expr, shape: Vec<usize> },
    /// Reduce `expr` over the trailing `inner` elements of `shape` (kept dims
    /// first, reduced dims last), for each of `outer` outputs.
    Reduce { op: ReduceOp, expr: Expr, shape: Vec<usize>, outer: usize, inner: usize },
    /// `[batch, m, k] @ [batch, k, n]`; layouts are 3-D with the batch flattened.
    /// With an epilogue, the elementwise work that consumed the product is
    /// applied to each result before it is stored.
    Matmul { a: View, b: View, batch: usize, m: usize, k: usize, n: usize, epilogue: Option<Epilogue> },
    Gather { dim: usize, input: View, index: View },
    ScatterAdd { dim: usize, input: View, index: View, src: View },
    IndexSelect { dim: usize, input: View, index: View },
    Cumsum { dim: usize, input: View },
    Cat { dim: usize, parts: Vec<View> },
    Unfold { input: View, params: UnfoldParams, pad: f64 },
    Fold { input: View, params: UnfoldParams, hw: [usize; 2] },
    /// Row-wise work in one pass (softmax, layer norm): for each of `outer`
    /// rows of `inner` elements, the `stages` in order, then `out` at every
    /// element of the row. A lowering of reductions and the elementwise work
    /// around them for executors that gain from it (the GPU: one read of the
    /// input from memory instead of one per reduction).
    Rows { outer: usize, inner: usize, stages: Vec<RowStage>, out: RowStage },
}

/// One kernel of a plan.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    pub kind: KernelKind,
    /// Slots read, indexed by `Load::input` / `View::input`.
    pub inputs: Vec<Slot>,
    pub out: Slot,
    pub dtype: DType,
    pub numel: usize,
    /// Names of the graph ops fused into this kernel, for schedules and profiles.
    pub ops: Vec<&'static str>,
}

impl std::hash::Hash for KernelKind {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match self {
            KernelKind::Elementwise { expr, shape } => (expr, shape).hash(h),
            KernelKind::Reduce { op, expr, shape, outer, inner } => (op, expr, shape, outer, inner).hash(h),
            KernelKind::Matmul { a, b, batch, m, k, n, epilogue } => (a, b, batch, m, k, n, epilogue).hash(h),
            KernelKind::Gather { dim, input, index } | KernelKind::IndexSelect { dim, input, index } => (dim, input, index).hash(h),
            KernelKind::ScatterAdd { dim, input, index, src } => (dim, input, index, src).hash(h),
            KernelKind::Cumsum { dim, input } => (dim, input).hash(h),
            KernelKind::Cat { dim, parts } => (dim, parts).hash(h),
            KernelKind::Unfold { input, params, pad } => (input, params, pad.to_bits()).hash(h),
            KernelKind::Fold { input, params, hw } => (input, params, hw).hash(h),
            KernelKind::Rows { outer, inner, stages, out } => (outer, inner, stages, out).hash(h),
        }
    }
}

impl KernelKind {
    /// A short kind name.
    pub fn name(&self) -> &'static str {
        match self {
            KernelKind::Elementwise { .. } => "elementwise",
            KernelKind::Reduce { .. } => "reduce",
            KernelKind::Matmul { .. } => "matmul",
            KernelKind::Gather { .. } => "gather",
            KernelKind::ScatterAdd { .. } => "scatter_add",
            KernelKind::IndexSelect { .. } => "index_select",
            KernelKind::Cumsum { .. } => "cumsum",
            KernelKind::Cat { .. } => "cat",
            KernelKind::Unfold { .. } => "unfold",
            KernelKind::Fold { .. } => "fold",
            KernelKind::Rows { .. } => "rows",
        }
    }
}
