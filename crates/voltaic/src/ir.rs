//! The kernel IR: what the scheduler hands to an executor.
//!
//! A [`Plan`] is a list of [`Kernel`]s over numbered buffer slots: some
//! slots are inputs (buffers the caller passes to the executor), the others
//! are written by one kernel each. A kernel writes one contiguous output.
//! Fused elementwise work is an [`Expr`] (a small SSA program over loads and
//! constants) that both the CPU interpreter and the WGSL code generator
//! consume. A plan names no device, buffer or graph node, so executors can
//! run it with any buffers of the right sizes.

use crate::dtype::DType;
use crate::layout::Layout;
use crate::primitive::{BinaryOp, IndexOp, MapOp, ReduceOp};

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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Instr {
    /// Load number `k` of the expression.
    Load(usize),
    /// Constant number `k` of the expression (its value is data, not structure).
    Const(usize),
    /// An elementwise primitive over the first `op.arity()` operands.
    Map(MapOp, [usize; 3]),
}

impl Instr {
    /// The operand instructions.
    pub fn operands(&self) -> &[usize] {
        match self {
            Instr::Load(_) | Instr::Const(_) => &[],
            Instr::Map(op, args) => &args[..op.arity()],
        }
    }
}

/// A fused elementwise program; the last instruction is the result.
///
/// Equality and hashing compare the structure (instructions, dtypes and
/// loads), not the constants' values: two kernels that differ only in a
/// constant (a learning rate that changes every step) compile to one
/// pipeline, which reads the values at run time.
#[derive(Clone, Debug, Default)]
pub(crate) struct Expr {
    /// Instructions and the dtype of each one's value.
    pub instrs: Vec<(Instr, DType)>,
    pub loads: Vec<Load>,
    /// Values of the constants, each already rounded to its dtype;
    /// `Instr::Const(k)` instructions number them 0, 1, ... in order.
    pub consts: Vec<f64>,
    /// For each constant, the position of the graph node it came from in the
    /// collected graph: a cached plan takes new values from there.
    pub const_nodes: Vec<usize>,
}

impl PartialEq for Expr {
    fn eq(&self, o: &Expr) -> bool {
        self.instrs == o.instrs && self.loads == o.loads
    }
}

impl std::hash::Hash for Expr {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (&self.instrs, &self.loads).hash(h)
    }
}

impl Expr {
    /// Dtype of the result.
    pub fn dtype(&self) -> DType {
        self.instrs.last().map(|i| i.1).unwrap_or(DType::F32)
    }
}

/// Elementwise work fused after a matmul (or an index kernel whose
/// executor runs it, see `Capabilities::index_epilogues`): `expr` over
/// `shape` (the result's elements in order), where load `acc` stands for
/// the result itself and the other loads read the kernel's inputs.
#[derive(Clone, Debug, PartialEq, Hash)]
pub(crate) struct Epilogue {
    pub expr: Expr,
    pub shape: Vec<usize>,
    pub acc: usize,
    /// The product's dtype (the value is rounded to it before the epilogue).
    pub acc_dtype: DType,
}

/// Row-wise or elementwise work fused before a quantized GEMV: it computes
/// the product's left operand `[m, k]` (element `l = i * k + c` of row `i`,
/// column `c`) where the product loads it, so the operand never reaches
/// memory. The stages are those of a [`KernelKind::Rows`] kernel with `m`
/// rows of `k` elements (none for elementwise work); their loads read the
/// matmul kernel's inputs.
#[derive(Clone, Debug, PartialEq, Hash)]
pub(crate) struct Prologue {
    pub stages: Vec<RowStage>,
    pub out: RowStage,
}

/// A prologue whose reductions read only the kernel's inputs (sums, not
/// over an earlier stage) and whose operand is one per-row stage value
/// times the rest, as in an RMS norm (`x * rsqrt(mean(x^2) + eps) * g`):
/// a product can fold the reductions into its loop over the weights and
/// multiply each row's sum by the factor at the end, `sum(w * (x * f) * g)
/// = f * sum(w * x * g)` (rounded differently). The weights' loads then no
/// longer wait for the reductions and their barriers.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Factored {
    /// The reduced stages.
    pub reduced: Vec<usize>,
    /// The stage whose value multiplies the operand.
    pub factor: usize,
}

impl Factored {
    /// The factored form of the stages `stages` before `out`, if it has one.
    fn of(stages: &[RowStage], out: &RowStage) -> Option<Factored> {
        let f32s = stages.iter().chain([out]).all(|st| st.dtype == DType::F32 && st.expr.dtype() == DType::F32);
        let plain = stages.iter().all(|st| st.op.is_none() || (st.op == Some(ReduceOp::Sum) && st.from.is_empty()));
        let reduced: Vec<usize> = stages.iter().enumerate().filter(|(_, st)| st.op.is_some()).map(|(s, _)| s).collect();
        if !f32s || !plain || reduced.is_empty() {
            return None;
        }
        let instrs = &out.expr.instrs;
        let is_stage = |i: usize| matches!(instrs[i].0, Instr::Load(l) if out.reads_stage(l));
        let [at] = (0..instrs.len()).filter(|&i| is_stage(i)).collect::<Vec<_>>()[..] else { return None };
        // Each instruction's operand uses, and whether it depends on the
        // stage's value (operands come before their users: one pass each).
        let mut uses = vec![0usize; instrs.len()];
        let mut reaches = vec![false; instrs.len()];
        for (i, (ins, _)) in instrs.iter().enumerate() {
            for &o in ins.operands() {
                uses[o] += 1;
            }
            reaches[i] = i == at || ins.operands().iter().any(|&o| reaches[o]);
        }
        // The path of f32 products from the result down to the stage's
        // value, each step used by the next alone.
        let mut path = vec![instrs.len() - 1];
        while let Some(&i) = path.last() {
            if i == at {
                break;
            }
            let next = match instrs[i] {
                (Instr::Map(MapOp::Binary(BinaryOp::Mul), [a, b, _]), DType::F32) => [a, b].into_iter().find(|&o| reaches[o]),
                _ => None,
            };
            path.push(next?);
        }
        if path[1..].iter().any(|&i| uses[i] != 1) {
            return None;
        }
        let Instr::Load(l) = instrs[at].0 else { return None };
        let factor = out.from.iter().find(|&&(load, _)| load == l)?.1;
        Some(Factored { reduced, factor })
    }

    /// Arguments for a function of the first `stages` stages: 1 for the
    /// factor's stage (`one`), 0 for the others (which it does not read).
    pub fn args(&self, stages: usize, one: Option<usize>) -> String {
        (0..stages).map(|s| if Some(s) == one { ", 1.0".to_string() } else { ", 0.0".to_string() }).collect()
    }
}

impl Prologue {
    /// Its stages, then the operand's stage.
    pub fn all_stages(&self) -> impl Iterator<Item = &RowStage> {
        self.stages.iter().chain([&self.out])
    }

    /// The prologue's factored form (see [`Factored`]), if it has one.
    pub fn factored(&self) -> Option<Factored> {
        Factored::of(&self.stages, &self.out)
    }
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

impl RowStage {
    /// Whether load `load` of the stage's expression stands for an earlier
    /// stage's value rather than reading one of the kernel's inputs.
    pub fn reads_stage(&self, load: usize) -> bool {
        self.from.iter().any(|&(l, _)| l == load)
    }
}

/// A strided read of a whole input buffer by a kernel that is not fused
/// elementwise work (matmul operands, index-like ops).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Strided {
    pub input: usize,
    pub layout: Layout,
}

/// What a kernel computes. Equal kinds generate equal code, so executors
/// cache compiled kernels by it.
// Inline layouts make the matmul variant large; kernels live once per
// cached plan, so boxing would buy nothing but an indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Hash)]
pub(crate) enum KernelKind {
    /// `out[i] = expr(i)` over `shape`.
    Elementwise { expr: Expr, shape: Vec<usize> },
    /// Reduce `expr` over the trailing `inner` elements of `shape` (kept dims
    /// first, reduced dims last), for each of `outer` outputs.
    Reduce { op: ReduceOp, expr: Expr, shape: Vec<usize>, outer: usize, inner: usize },
    /// `[batch, m, k] @ [batch, k, n]`; layouts are 3-D with the batch flattened.
    /// With an epilogue, the elementwise work that consumed the product is
    /// applied to each result before it is stored.
    /// With `quant`, `b` is a block-quantized `[n, k]` matrix (its padded
    /// blocks as u32 words, `[n, words per row]`) multiplied transposed.
    /// With a prologue (quantized GEMVs only), `a` is not read: the
    /// prologue computes each element of the left operand.
    Matmul {
        a: Strided,
        b: Strided,
        batch: usize,
        m: usize,
        k: usize,
        n: usize,
        epilogue: Option<Epilogue>,
        quant: Option<crate::quant::GgmlType>,
        prologue: Option<Prologue>,
    },
    /// An index-like primitive over its operands (see [`IndexOp`]). An
    /// attention kernel may compute its queries, keys or values in their
    /// loads: `prologues` is empty or holds one entry per arg, and an arg
    /// with a prologue (elementwise work over that arg's elements, in the
    /// order of its buffer) is not read from its input. An `epilogue`
    /// (see [`Epilogue`]) runs on the result as it is made.
    Index { op: IndexOp, args: Vec<Strided>, prologues: Vec<Option<Prologue>>, epilogue: Option<Epilogue> },
    /// Elementwise work with several outputs over one `shape`: output `j`
    /// (the kernel's `out` first, then its `also`) stores the value of
    /// instruction `stores[j]`, in that instruction's dtype. Made from
    /// elementwise kernels that read the same buffers or each other's
    /// results (an optimizer's new weight and moments), for executors that
    /// run them (`Capabilities::multi_output`): one pass over the shared
    /// inputs and one dispatch instead of several.
    Multi { expr: Expr, shape: Vec<usize>, stores: Vec<usize> },
    /// Row-wise work in one pass (softmax, layer norm): for each of `outer`
    /// rows of `inner` elements, the `stages` in order, then `out` at every
    /// element of the row. A lowering of reductions and the elementwise work
    /// around them for executors that gain from it (the GPU: one read of the
    /// input from memory instead of one per reduction).
    Rows { outer: usize, inner: usize, stages: Vec<RowStage>, out: RowStage },
}

impl KernelKind {
    /// A short kind name.
    pub fn name(&self) -> &'static str {
        match self {
            KernelKind::Elementwise { .. } | KernelKind::Multi { .. } => "elementwise",
            KernelKind::Reduce { .. } => "reduce",
            KernelKind::Matmul { .. } => "matmul",
            KernelKind::Index { op, .. } => op.name(),
            KernelKind::Rows { .. } => "rows",
        }
    }

    /// The kernel's expressions in a fixed order (a product's epilogue
    /// before its prologue's stages); their constants, in this order, are
    /// the kernel's constants.
    pub fn exprs(&self) -> Vec<&Expr> {
        match self {
            KernelKind::Elementwise { expr, .. } | KernelKind::Reduce { expr, .. } | KernelKind::Multi { expr, .. } => vec![expr],
            KernelKind::Matmul { epilogue, prologue, .. } => {
                let pro = prologue.iter().flat_map(Prologue::all_stages).map(|s| &s.expr);
                epilogue.iter().map(|e| &e.expr).chain(pro).collect()
            }
            KernelKind::Rows { stages, out, .. } => stages.iter().chain([out]).map(|s| &s.expr).collect(),
            KernelKind::Index { prologues, epilogue, .. } => {
                let pro = prologues.iter().flatten().flat_map(Prologue::all_stages).map(|s| &s.expr);
                epilogue.iter().map(|e| &e.expr).chain(pro).collect()
            }
        }
    }

    /// The kernel's expressions, mutably, in [`KernelKind::exprs`] order.
    pub fn exprs_mut(&mut self) -> Vec<&mut Expr> {
        match self {
            KernelKind::Elementwise { expr, .. } | KernelKind::Reduce { expr, .. } | KernelKind::Multi { expr, .. } => vec![expr],
            KernelKind::Matmul { epilogue, prologue, .. } => {
                let pro = prologue.iter_mut().flat_map(|p| p.stages.iter_mut().chain([&mut p.out])).map(|s| &mut s.expr);
                epilogue.iter_mut().map(|e| &mut e.expr).chain(pro).collect()
            }
            KernelKind::Rows { stages, out, .. } => stages.iter_mut().chain([out]).map(|s| &mut s.expr).collect(),
            KernelKind::Index { prologues, epilogue, .. } => {
                let pro = prologues.iter_mut().flatten().flat_map(|p| p.stages.iter_mut().chain([&mut p.out])).map(|s| &mut s.expr);
                epilogue.iter_mut().map(|e| &mut e.expr).chain(pro).collect()
            }
        }
    }

    /// Every constant of the kernel with its dtype, in [`KernelKind::exprs`] order.
    pub fn consts(&self) -> Vec<(f64, DType)> {
        let mut out = vec![];
        for e in self.exprs() {
            for (ins, dt) in &e.instrs {
                if let Instr::Const(k) = ins {
                    out.push((e.consts[*k], *dt));
                }
            }
        }
        out
    }
}

/// One kernel of a plan.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    pub kind: KernelKind,
    /// Slots read, indexed by `Load::input` / `Strided::input`.
    pub inputs: Vec<Slot>,
    pub out: Slot,
    /// Further outputs, of a [`KernelKind::Multi`] kernel (empty otherwise).
    pub also: Vec<Slot>,
    pub dtype: DType,
    pub numel: usize,
    /// Names of the graph ops fused into this kernel, for schedules and profiles.
    pub ops: Vec<&'static str>,
}

impl Kernel {
    /// The slots the kernel writes: `out`, then `also`.
    pub fn outputs(&self) -> impl Iterator<Item = Slot> + '_ {
        std::iter::once(self.out).chain(self.also.iter().copied())
    }
}

/// Where a slot's buffer comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotSource {
    /// Buffer number `k` of those the plan is run with.
    Input(usize),
    /// Written by a kernel of the plan.
    Kernel,
}

/// A buffer slot of a plan.
#[derive(Clone, Debug)]
pub(crate) struct SlotInfo {
    pub source: SlotSource,
    pub dtype: DType,
    pub numel: usize,
}

/// What an executor prepares once for a plan and reuses while the plan is
/// cached (compiled kernels, resolved variants); shared by the plan's clones.
pub(crate) type Prepared = std::sync::Arc<std::sync::Mutex<Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>>>;

/// The kernels of one realization, in order, with buffer lifetimes.
#[derive(Clone, Debug, Default)]
pub(crate) struct Plan {
    pub slots: Vec<SlotInfo>,
    pub kernels: Vec<Kernel>,
    /// Slots whose buffers can be dropped after kernel `i`.
    pub free_after: Vec<Vec<Slot>>,
    /// Slots whose buffers the run returns, in this order.
    pub outputs: Vec<Slot>,
    /// The executor's prepared state for this plan (see [`Prepared`]).
    pub prepared: Prepared,
}

impl Plan {
    /// Number of input buffers the plan is run with.
    pub fn input_count(&self) -> usize {
        self.slots.iter().filter(|s| matches!(s.source, SlotSource::Input(_))).count()
    }
}
