//! Pass 3, lower: one kernel per node that keeps a buffer (a target, or a
//! node that is not inlined), in topological order.
//!
//! Fused elementwise work becomes an [`Expr`]: an SSA list of loads,
//! constants and primitives. A load's *path* composes the views between the
//! kernel's index and the buffer it reads (see `refine::simplify`).
//! Reductions order their iteration space as kept dims then reduced dims.
//! Realized nodes that kernels read become the plan's input slots.

use super::collect::Dag;
use super::refine::simplify;
use crate::backend::Buffer;
use crate::dtype::DType;
use crate::graph::{OpKind, Value};
use crate::ir::{Expr, Instr, Kernel, KernelKind, Load, Plan, Slot, SlotInfo, SlotSource, Strided};
use crate::layout::Layout;
use foldhash::{HashMap, HashMapExt};

/// A plan before the later passes, with what links it to the graph.
pub(crate) struct Lowered {
    pub plan: Plan,
    /// The slot holding each node's output, if it has one.
    pub slot_of: Vec<Option<Slot>>,
    /// The buffers of the plan's input slots, in order.
    pub inputs: Vec<Buffer>,
    /// The graph positions of the nodes those buffers belong to.
    pub input_nodes: Vec<usize>,
}

/// Lower every node of `g` that `inline` does not fuse into a consumer.
pub(crate) fn lower(g: &Dag, inline: &[bool]) -> Lowered {
    let mut l = Lowered { plan: Plan::default(), slot_of: vec![None; g.nodes.len()], inputs: vec![], input_nodes: vec![] };
    for i in 0..g.nodes.len() {
        if g.ops[i].is_none() || inline[i] {
            continue;
        }
        let kernel = build_kernel(g, inline, &mut l, i);
        let node = &g.nodes[i];
        let out = l.plan.slots.len();
        l.plan.slots.push(SlotInfo { source: SlotSource::Kernel, dtype: node.dtype, numel: node.numel() });
        l.slot_of[i] = Some(out);
        l.plan.kernels.push(Kernel { out, ..kernel });
    }
    l
}

/// Slot of a node that is read as a whole buffer (realized, or computed by
/// an earlier kernel).
fn slot_for(g: &Dag, l: &mut Lowered, j: usize) -> Slot {
    if let Some(s) = l.slot_of[j] {
        return s;
    }
    let node = &g.nodes[j];
    let buf = node.buffer().expect("a node read as a buffer is realized or lowered before its consumers");
    let s = l.plan.slots.len();
    l.plan.slots.push(SlotInfo { source: SlotSource::Input(l.inputs.len()), dtype: node.dtype, numel: node.numel() });
    l.inputs.push(buf);
    l.input_nodes.push(j);
    l.slot_of[j] = Some(s);
    s
}

/// Builds one kernel: its inputs and, for fused work, its expression.
struct Builder<'a> {
    g: &'a Dag,
    inline: &'a [bool],
    l: &'a mut Lowered,
    kernel_dims: Vec<usize>,
    inputs: Vec<Slot>,
    expr: Expr,
    /// Instruction computing (node, path); realized reads use `usize::MAX - node`.
    memo: HashMap<(usize, Vec<Layout>), usize>,
    ops: Vec<&'static str>,
}

impl Builder<'_> {
    /// The kernel's input index for node `j`'s buffer.
    fn input(&mut self, j: usize) -> usize {
        let s = slot_for(self.g, self.l, j);
        match self.inputs.iter().position(|&x| x == s) {
            Some(p) => p,
            None => {
                self.inputs.push(s);
                self.inputs.len() - 1
            }
        }
    }

    /// A strided read of a whole value (matmul and index operands).
    fn strided(&mut self, v: &Value) -> Strided {
        let j = self.g.pos(v);
        Strided { input: self.input(j), layout: v.layout.clone() }
    }

    fn push(&mut self, i: Instr, dt: DType) -> usize {
        self.expr.instrs.push((i, dt));
        self.expr.instrs.len() - 1
    }

    /// The value `v` reads, at the position that `map` yields.
    fn value(&mut self, v: &Value, map: &[Layout]) -> usize {
        let j = self.g.pos(v);
        let mut path = map.to_vec();
        path.push(v.layout.clone());
        simplify(&mut path);
        if self.inline[j] {
            return self.node(j, path);
        }
        if let Some(&v) = self.memo.get(&(usize::MAX - j, path.clone())) {
            return v;
        }
        let input = self.input(j);
        let dtype = self.g.nodes[j].dtype;
        let anchored = anchor(path.clone(), &self.kernel_dims);
        self.expr.loads.push(Load { input, dtype, path: anchored });
        let v = self.push(Instr::Load(self.expr.loads.len() - 1), dtype);
        self.memo.insert((usize::MAX - j, path), v);
        v
    }

    /// The value of node `j`'s output at the linear position `map` yields.
    fn node(&mut self, j: usize, map: Vec<Layout>) -> usize {
        if let Some(&v) = self.memo.get(&(j, map.clone())) {
            return v;
        }
        let op = self.g.ops[j].as_ref().expect("inlined nodes are pending");
        let dt = self.g.nodes[j].dtype;
        self.ops.push(op.name());
        let v = match &op.kind {
            OpKind::Const(c) => {
                self.expr.consts.push(*c);
                self.expr.const_nodes.push(j);
                self.push(Instr::Const(self.expr.consts.len() - 1), dt)
            }
            OpKind::Map(m) => {
                let mut args = [0; 3];
                for (a, input) in args.iter_mut().zip(&op.inputs) {
                    *a = self.value(input, &map);
                }
                self.push(Instr::Map(*m, args), dt)
            }
            OpKind::Copy => self.value(&op.inputs[0], &map),
            _ => unreachable!("only elementwise nodes are inlined"),
        };
        self.memo.insert((j, map), v);
        v
    }
}

/// Make `path[0]` take the kernel's multi-index.
fn anchor(mut path: Vec<Layout>, kernel_dims: &[usize]) -> Vec<Layout> {
    if path.is_empty() {
        return vec![Layout::contiguous(kernel_dims)];
    }
    if path[0].dims() != kernel_dims {
        match path[0].reshape(kernel_dims) {
            Some(l) => path[0] = l,
            None => path.insert(0, Layout::contiguous(kernel_dims)),
        }
    }
    path
}

/// `[batch.., m, k] @ [batch.., k, n]` whose right operand is one matrix
/// shared by the batch (batch strides 0: a Linear layer on `[B, T, in]`) and
/// whose left operand's rows follow each other evenly across the batch, as
/// the single product `[batch * m, k] @ [k, n]`: the same outputs in the same
/// order, but one tall product, where an executor picks larger tiles and
/// packs or converts the shared matrix once instead of once per batch.
fn fold_shared_rhs(a: &Layout, b: &Layout) -> Option<(Layout, Layout)> {
    let r = a.dims().len();
    let batch: usize = a.dims()[..r - 2].iter().product();
    if batch < 2 || b.strides()[..r - 2].iter().any(|&s| s != 0) {
        return None;
    }
    let tall = a.reshape(&[batch * a.dims()[r - 2], a.dims()[r - 1]])?;
    let mut shared = Layout::contiguous(&b.dims()[r - 2..]);
    shared.strides = b.strides()[r - 2..].iter().copied().collect();
    shared.offset = b.offset();
    Some((tall, shared))
}

fn build_kernel(g: &Dag, inline: &[bool], l: &mut Lowered, i: usize) -> Kernel {
    let node = &g.nodes[i];
    let op = g.ops[i].as_ref().expect("lowered nodes are pending");
    let mut b = Builder { g, inline, l, kernel_dims: node.dims.clone(), inputs: vec![], expr: Expr::default(), memo: HashMap::new(), ops: vec![] };
    let kind = match &op.kind {
        _ if op.is_elementwise() => {
            b.node(i, vec![]);
            KernelKind::Elementwise { expr: std::mem::take(&mut b.expr), shape: node.dims.clone() }
        }
        OpKind::Reduce(rop, axes) => {
            b.ops.push(rop.name());
            let a = &op.inputs[0];
            let in_dims = a.layout.dims().to_vec();
            b.kernel_dims = in_dims.clone();
            b.value(a, &[]);
            let kept: Vec<usize> = (0..in_dims.len()).filter(|d| !axes.contains(d)).collect();
            let perm: Vec<usize> = kept.iter().chain(axes.iter()).copied().collect();
            for l in b.expr.loads.iter_mut() {
                l.path[0] = l.path[0].permute(&perm);
            }
            let shape: Vec<usize> = perm.iter().map(|&p| in_dims[p]).collect();
            let outer: usize = kept.iter().map(|&d| in_dims[d]).product();
            let inner: usize = axes.iter().map(|&d| in_dims[d]).product();
            KernelKind::Reduce { op: *rop, expr: std::mem::take(&mut b.expr), shape, outer, inner }
        }
        OpKind::Matmul => {
            b.ops.push("matmul");
            let (x, y) = (&op.inputs[0], &op.inputs[1]);
            let (mut a, mut bb) = (b.strided(x), b.strided(y));
            let r = x.layout.dims().len();
            let (mut m, k, n) = (x.layout.dims()[r - 2], x.layout.dims()[r - 1], y.layout.dims()[r - 1]);
            let mut batch = x.layout.dims()[..r - 2].iter().product();
            if let Some((tall, shared)) = fold_shared_rhs(&a.layout, &bb.layout) {
                (a.layout, bb.layout) = (tall, shared);
                (m, batch) = (m * batch, 1);
            }
            KernelKind::Matmul { a, b: bb, batch, m, k, n, epilogue: None, quant: None, prologue: None }
        }
        OpKind::QMatmul(q) => {
            b.ops.push("qmatmul");
            let (x, w) = (&op.inputs[0], &op.inputs[1]);
            let (a, bb) = (b.strided(x), b.strided(w));
            let (m, k, n) = (x.layout.dims()[0], x.layout.dims()[1], node.dims[1]);
            KernelKind::Matmul { a, b: bb, batch: 1, m, k, n, epilogue: None, quant: Some(*q), prologue: None }
        }
        OpKind::Index(iop) => {
            b.ops.push(iop.name());
            let args = op.inputs.iter().map(|v| b.strided(v)).collect();
            KernelKind::Index { op: *iop, args, prologues: vec![], epilogue: None }
        }
        OpKind::Const(_) | OpKind::Map(_) | OpKind::Copy => unreachable!("elementwise ops are matched first"),
    };
    Kernel { kind, inputs: b.inputs, out: 0, also: vec![], dtype: node.dtype, numel: node.numel(), ops: b.ops }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::primitive::{BinaryOp, MapOp, ReduceOp, UnaryOp};
    use crate::schedule::testing::*;
    use crate::schedule::{collect::collect, fuse::inline_decisions};

    fn lowered(targets: &[&Value]) -> Lowered {
        let g = collect(targets);
        let inl = inline_decisions(&g, usize::MAX);
        lower(&g, &inl)
    }

    #[test]
    fn a_fused_chain_is_one_expression_over_one_input() {
        let x = input(&[2, 3]);
        let y = binary(&unary(&x, UnaryOp::Exp), &constant_like(&x, 2.0), BinaryOp::Mul);
        let l = lowered(&[&y]);
        assert_eq!(l.plan.kernels.len(), 1);
        assert_eq!(l.inputs.len(), 1);
        assert_eq!(l.plan.input_count(), 1);
        let KernelKind::Elementwise { expr, shape } = &l.plan.kernels[0].kind else { panic!("elementwise") };
        assert_eq!(shape, &[2, 3]);
        assert_eq!(expr.loads.len(), 1);
        assert_eq!(expr.consts, vec![2.0]);
        let maps: Vec<MapOp> = expr.instrs.iter().filter_map(|(i, _)| if let Instr::Map(m, _) = i { Some(*m) } else { None }).collect();
        assert_eq!(maps, vec![MapOp::Unary(UnaryOp::Exp), MapOp::Binary(BinaryOp::Mul)]);
    }

    fn batched_matmul(a: &Value, b: &Value) -> Value {
        let r = a.layout.dims().len();
        let mut dims = a.layout.dims().to_vec();
        dims[r - 1] = b.layout.dims()[r - 1];
        let op = crate::graph::Op { kind: OpKind::Matmul, inputs: vec![a.clone(), b.clone()] };
        Value { node: crate::graph::Node::pending(op, DType::F32, crate::Device::Cpu, dims.clone()), layout: Layout::contiguous(&dims) }
    }

    fn matmul_dims(v: &Value) -> (usize, usize, Vec<usize>, Vec<usize>) {
        let l = lowered(&[v]);
        let KernelKind::Matmul { a, b, batch, m, .. } = &l.plan.kernels[0].kind else { panic!("matmul") };
        (*batch, *m, a.layout.dims().to_vec(), b.layout.strides().to_vec())
    }

    #[test]
    fn a_matrix_shared_by_the_batch_makes_one_tall_product() {
        // [2, 3, 4] @ [4, 5] broadcast to [2, 4, 5]: one [6, 4] @ [4, 5].
        let (x, w) = (input(&[2, 3, 4]), input(&[4, 5]));
        let (batch, m, a, b) = matmul_dims(&batched_matmul(&x, &broadcast(&w, &[2, 4, 5])));
        assert_eq!((batch, m, a, b), (1, 6, vec![6, 4], vec![5, 1]));
        // A transposed shared matrix keeps its strides.
        let wt = transpose(&input(&[5, 4]));
        let (batch, m, _, b) = matmul_dims(&batched_matmul(&x, &broadcast(&wt, &[2, 4, 5])));
        assert_eq!((batch, m, b), (1, 6, vec![1, 4]));
        // Rows that do not follow each other across the batch (each batch's
        // matrix transposed in place) and batched right operands stay batched.
        let xt = Value { node: input(&[2, 4, 3]).node, layout: Layout::contiguous(&[2, 4, 3]).permute(&[0, 2, 1]) };
        assert_eq!(matmul_dims(&batched_matmul(&xt, &broadcast(&w, &[2, 4, 5]))).0, 2);
        assert_eq!(matmul_dims(&batched_matmul(&x, &input(&[2, 4, 5]))).0, 2);
    }

    #[test]
    fn a_value_read_twice_through_one_path_is_loaded_once() {
        let x = input(&[5]);
        let y = binary(&x, &x, BinaryOp::Add);
        let l = lowered(&[&y]);
        let KernelKind::Elementwise { expr, .. } = &l.plan.kernels[0].kind else { panic!() };
        assert_eq!(expr.loads.len(), 1);
    }

    #[test]
    fn a_reduction_orders_kept_dims_before_reduced_ones() {
        let x = input(&[2, 3, 4]);
        let s = reduce(&unary(&x, UnaryOp::Exp), ReduceOp::Sum, &[1]);
        let l = lowered(&[&s]);
        assert_eq!(l.plan.kernels.len(), 1, "exp is the reduction's prologue");
        let KernelKind::Reduce { shape, outer, inner, expr, .. } = &l.plan.kernels[0].kind else { panic!("reduce") };
        assert_eq!((shape.as_slice(), *outer, *inner), (&[2, 4, 3][..], 8, 3));
        assert_eq!(expr.loads[0].path[0].strides(), &[12, 1, 4]);
    }

    #[test]
    fn an_intermediate_read_by_two_kernels_is_computed_before_them() {
        let x = input(&[4]);
        let a = unary(&x, UnaryOp::Exp);
        let s = reduce(&a, ReduceOp::Sum, &[0]);
        let m = reduce(&a, ReduceOp::Max, &[0]);
        let l = lowered(&[&s, &m]);
        assert_eq!(l.plan.kernels.len(), 3);
        let a_slot = l.plan.kernels[0].out;
        assert!(l.plan.kernels[1..].iter().all(|k| k.inputs == vec![a_slot]));
    }
}
