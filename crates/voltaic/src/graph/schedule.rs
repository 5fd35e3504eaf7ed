//! The scheduler: turns the pending graph below some tensors into a [`Plan`]
//! of kernels.
//!
//! Chains of elementwise nodes (and the views between them) are fused into
//! one kernel; an elementwise producer read by a reduction becomes the
//! reduction's prologue. A pending node gets a buffer of its own only when it
//! is asked for, has several consumers, or feeds a kernel that cannot fuse it.
//! Each buffer is freed after its last consumer unless a tensor outside the
//! plan still refers to its node.

use super::kernel::{Expr, Instr, Kernel, KernelKind, Load, RowStage, Slot, View};
use super::{Buffer, Node, Op, State};
use crate::dtype::DType;
use crate::layout::Layout;
use crate::tensor::Tensor;
// Maps keyed by node ids and layouts are rebuilt on every realization: a
// fast hasher, not SipHash (whose DoS resistance these keys do not need).
use foldhash::{HashMap, HashMapExt, HashSet};
use std::sync::Arc;

/// Where a slot's buffer comes from.
#[derive(Debug)]
pub(crate) enum SlotSource {
    /// An already realized node.
    External(Buffer),
    /// Written by a kernel of the plan.
    Kernel,
}

/// A buffer slot of a plan.
#[derive(Debug)]
pub(crate) struct SlotInfo {
    pub source: SlotSource,
    pub dtype: DType,
    pub numel: usize,
}

/// The kernels of one realization, in order, with buffer lifetimes.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub slots: Vec<SlotInfo>,
    pub kernels: Vec<Kernel>,
    /// Slots whose buffers can be dropped after kernel `i`.
    pub free_after: Vec<Vec<Slot>>,
    /// Slots whose buffers become their node's result.
    pub store: Vec<(Slot, Arc<Node>)>,
}

/// A summary of a plan, for tests and tools: one entry per kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSummary {
    /// Kernel kind (`elementwise`, `reduce`, `matmul`, ...).
    pub kind: &'static str,
    /// Graph ops fused into it, in build order.
    pub ops: Vec<&'static str>,
    /// Number of buffers it reads.
    pub inputs: usize,
    /// Number of output elements.
    pub numel: usize,
}

struct Graph {
    nodes: Vec<Arc<Node>>,
    ops: Vec<Option<Op>>,
    index: HashMap<u64, usize>,
    consumers: Vec<Vec<usize>>,
    edges_in: Vec<usize>,
    target: Vec<bool>,
}

/// Collect the pending subgraph below `targets` in topological order.
fn collect(targets: &[&Tensor]) -> Graph {
    let mut g = Graph {
        nodes: vec![],
        ops: vec![],
        index: HashMap::new(),
        consumers: vec![],
        edges_in: vec![],
        target: vec![],
    };
    // Iterative post-order DFS; an expanded entry carries its node's op.
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
                    Some(op) => op.inputs().into_iter().rev().filter(|t| !g.index.contains_key(&t.node.id)).map(|t| t.node.clone()).collect(),
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
            for t in op.inputs() {
                let j = g.index[&t.node.id];
                g.edges_in[j] += 1;
                if !g.consumers[j].contains(&i) {
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

/// Build the plan that realizes `targets`. `rows` lowers row-wise work
/// (reductions and the elementwise work around them, as in softmax and
/// layer norm) to one-pass [`KernelKind::Rows`] kernels, for executors
/// that run those.
pub(crate) fn schedule(targets: &[&Tensor], rows: bool) -> Plan {
    let g = collect(targets);
    let n = g.nodes.len();
    let fuses_inputs = |op: &Option<Op>| matches!(op, Some(o) if o.is_elementwise() || matches!(o, Op::Reduce(..)));
    // Decide which pending nodes are inlined into their consumer.
    // A consumer that reads a node through a broadcast (a stride 0 over a dim
    // larger than 1) would recompute each of its elements many times if it
    // were inlined; such nodes get a buffer unless they are constants.
    let read_broadcast = |i: usize| {
        g.consumers[i].iter().any(|&c| {
            g.ops[c].as_ref().is_some_and(|op| {
                op.inputs().iter().any(|t| {
                    t.node.id == g.nodes[i].id && t.layout.dims().iter().zip(t.layout.strides()).any(|(&d, &s)| d > 1 && s == 0)
                })
            })
        })
    };
    // An elementwise node is inlined when every consumer ends up in one and
    // the same kernel (`root`): there, the builder computes it once however
    // many consumers read it. Consumers come after producers, so one pass
    // from the end decides every node.
    let mut inline = vec![false; n];
    let mut root: Vec<usize> = (0..n).collect();
    for i in (0..n).rev() {
        match &g.ops[i] {
            Some(Op::Const(_)) if !g.target[i] => inline[i] = g.consumers[i].iter().all(|&c| fuses_inputs(&g.ops[c])),
            Some(op) if op.is_elementwise() && !g.target[i] => {
                let all_fuse = !g.consumers[i].is_empty() && g.consumers[i].iter().all(|&c| fuses_inputs(&g.ops[c]));
                let r = g.consumers[i].first().map(|&c| root[c]);
                let one_kernel = g.consumers[i].iter().all(|&c| Some(root[c]) == r);
                if all_fuse && one_kernel && !read_broadcast(i) {
                    inline[i] = true;
                    root[i] = r.expect("has consumers");
                }
            }
            _ => {}
        }
    }

    let mut plan = Plan::default();
    let mut slot_of: Vec<Option<Slot>> = vec![None; n];
    for i in 0..n {
        let Some(op) = &g.ops[i] else { continue };
        if inline[i] {
            continue;
        }
        let node = &g.nodes[i];
        let kernel = build_kernel(&g, &inline, &mut slot_of, &mut plan, i, op);
        let out = plan.slots.len();
        plan.slots.push(SlotInfo { source: SlotSource::Kernel, dtype: node.dtype, numel: node.numel() });
        slot_of[i] = Some(out);
        plan.kernels.push(Kernel { out, ..kernel });
    }

    // Which nodes stay referenced after this realization: held from outside
    // the graph, or consumed by a pending node that itself stays.
    let external: Vec<bool> = (0..n)
        .map(|i| {
            // Our own references: `g.nodes`, and each edge twice (the node's op and our clone of it).
            let internal = 1 + 2 * g.edges_in[i];
            g.target[i] || Arc::strong_count(&g.nodes[i]) > internal
        })
        .collect();
    let mut survives = external.clone();
    for i in (0..n).rev() {
        if survives[i] {
            continue;
        }
        survives[i] = g.consumers[i].iter().any(|&c| inline[c] && survives[c]);
    }
    fuse_epilogues(&mut plan, &slot_of, &survives);
    if rows {
        fuse_rows(&mut plan, &slot_of, &survives);
    }

    // Lifetimes.
    let mut last_use: Vec<Option<usize>> = vec![None; plan.slots.len()];
    for (k, kern) in plan.kernels.iter().enumerate() {
        for &s in &kern.inputs {
            last_use[s] = Some(k);
        }
    }
    plan.free_after = vec![vec![]; plan.kernels.len()];
    let mut kept = vec![false; plan.slots.len()];
    for i in 0..n {
        if let (Some(s), Some(_)) = (slot_of[i], &g.ops[i]) {
            if survives[i] {
                kept[s] = true;
                plan.store.push((s, g.nodes[i].clone()));
            }
        }
    }
    for (s, lu) in last_use.iter().enumerate() {
        if let (Some(k), false) = (lu, kept[s]) {
            plan.free_after[*k].push(s);
        }
    }
    // Kernel outputs nobody reads and nobody keeps are still computed (they were
    // asked for), so nothing more to do for them.
    plan
}

/// The kernel summaries of the plan that would realize `tensors`, without
/// running it. Lets tests and tools see what fuses.
///
/// The plan is the one the tensors' device would run: on a GPU, row-wise
/// work such as softmax is one kernel.
pub fn inspect(tensors: &[&Tensor]) -> Vec<KernelSummary> {
    let gpu = tensors.first().is_some_and(|t| t.device().is_gpu());
    schedule(tensors, gpu)
        .kernels
        .iter()
        .map(|k| KernelSummary { kind: k.kind.name(), ops: k.ops.clone(), inputs: k.inputs.len(), numel: k.numel })
        .collect()
}

/// Slot of a node that is read as a whole buffer (realized or materialized).
fn slot_for(g: &Graph, slot_of: &mut [Option<Slot>], plan: &mut Plan, j: usize) -> Slot {
    if let Some(s) = slot_of[j] {
        return s;
    }
    let node = &g.nodes[j];
    let buf = node.buffer().expect("a node read as a buffer is realized or scheduled before its consumers");
    let s = plan.slots.len();
    plan.slots.push(SlotInfo { source: SlotSource::External(buf), dtype: node.dtype, numel: node.numel() });
    slot_of[j] = Some(s);
    s
}

struct Builder<'a> {
    g: &'a Graph,
    inline: &'a [bool],
    slot_of: &'a mut [Option<Slot>],
    plan: &'a mut Plan,
    kernel_dims: Vec<usize>,
    inputs: Vec<Slot>,
    expr: Expr,
    memo: HashMap<(usize, Vec<Layout>), usize>,
    ops: Vec<&'static str>,
}

impl Builder<'_> {
    fn input(&mut self, j: usize) -> usize {
        let s = slot_for(self.g, self.slot_of, self.plan, j);
        match self.inputs.iter().position(|&x| x == s) {
            Some(p) => p,
            None => {
                self.inputs.push(s);
                self.inputs.len() - 1
            }
        }
    }

    fn view(&mut self, t: &Tensor) -> View {
        let j = self.g.index[&t.node.id];
        View { input: self.input(j), layout: t.layout.clone() }
    }

    fn push(&mut self, i: Instr, dt: DType) -> usize {
        self.expr.instrs.push((i, dt));
        self.expr.instrs.len() - 1
    }

    /// The value of tensor `t` at the position that `map` yields.
    fn tensor(&mut self, t: &Tensor, map: &[Layout]) -> usize {
        let j = self.g.index[&t.node.id];
        let mut path = map.to_vec();
        path.push(t.layout.clone());
        simplify(&mut path);
        if self.inline[j] {
            self.node(j, path)
        } else {
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
    }

    /// The value of node `j`'s output at the linear position `map` yields.
    fn node(&mut self, j: usize, map: Vec<Layout>) -> usize {
        if let Some(&v) = self.memo.get(&(j, map.clone())) {
            return v;
        }
        let op = self.g.ops[j].as_ref().expect("inlined nodes are pending");
        let dt = self.g.nodes[j].dtype;
        self.ops.push(op.name());
        let v = match op {
            Op::Const(c) => self.push(Instr::Const(*c), dt),
            Op::Unary(u, a) => {
                let a = self.tensor(a, &map);
                self.push(Instr::Unary(*u, a), dt)
            }
            Op::Binary(b, x, y) => {
                let (x, y) = (self.tensor(x, &map), self.tensor(y, &map));
                self.push(Instr::Binary(*b, x, y), dt)
            }
            Op::Cmp(c, x, y) => {
                let (x, y) = (self.tensor(x, &map), self.tensor(y, &map));
                self.push(Instr::Cmp(*c, x, y), dt)
            }
            Op::Where(c, x, y) => {
                let (c, x, y) = (self.tensor(c, &map), self.tensor(x, &map), self.tensor(y, &map));
                self.push(Instr::Where(c, x, y), dt)
            }
            Op::Cast(a) => {
                let a = self.tensor(a, &map);
                self.push(Instr::Cast(a), dt)
            }
            Op::Copy(a) => self.tensor(a, &map),
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

/// Shorten a path: drop identity steps and merge neighbours that compose.
pub(crate) fn simplify(path: &mut Vec<Layout>) {
    loop {
        path.retain(|l| !l.is_identity());
        let mut changed = false;
        let mut k = 0;
        while k + 1 < path.len() {
            let merged = Layout::compose(&path[k], &path[k + 1]).or_else(|| {
                // A contiguous run of the inner output: read it as a flat slice.
                let (a, b) = (&path[k], &path[k + 1]);
                if !a.is_contiguous() {
                    return None;
                }
                let flat = b.reshape(&[b.numel()])?;
                flat.slice(0, a.offset, a.numel(), 1).reshape(a.dims())
            });
            if let Some(m) = merged {
                path[k] = m;
                path.remove(k + 1);
                changed = true;
            } else {
                k += 1;
            }
        }
        if !changed {
            return;
        }
    }
}

fn build_kernel(
    g: &Graph,
    inline: &[bool],
    slot_of: &mut [Option<Slot>],
    plan: &mut Plan,
    i: usize,
    op: &Op,
) -> Kernel {
    let node = &g.nodes[i];
    let mut b = Builder {
        g,
        inline,
        slot_of,
        plan,
        kernel_dims: node.dims.clone(),
        inputs: vec![],
        expr: Expr::default(),
        memo: HashMap::new(),
        ops: vec![],
    };
    let kind = match op {
        _ if op.is_elementwise() => {
            b.node_root(i);
            let (shape, expr) = refine_expr(b.expr.clone(), &node.dims);
            let (shape, expr) = coalesce_expr(expr, &shape, &[shape.len()]);
            b.expr = expr;
            KernelKind::Elementwise { expr: b.expr.clone(), shape }
        }
        Op::Reduce(rop, a, axes) => {
            b.ops.push(rop.name());
            let in_dims = a.dims().to_vec();
            b.kernel_dims = in_dims.clone();
            b.tensor(a, &[]);
            let kept: Vec<usize> = (0..in_dims.len()).filter(|d| !axes.contains(d)).collect();
            let perm: Vec<usize> = kept.iter().chain(axes.iter()).copied().collect();
            for l in b.expr.loads.iter_mut() {
                l.path[0] = l.path[0].permute(&perm);
            }
            let pshape: Vec<usize> = perm.iter().map(|&p| in_dims[p]).collect();
            let outer: usize = kept.iter().map(|&d| in_dims[d]).product();
            let inner: usize = axes.iter().map(|&d| in_dims[d]).product();
            let (shape, expr) = coalesce_expr(b.expr.clone(), &pshape, &[kept.len(), axes.len()]);
            KernelKind::Reduce { op: *rop, expr, shape, outer, inner }
        }
        Op::Matmul(x, y) => {
            b.ops.push("matmul");
            let (a, bb) = (b.view(x), b.view(y));
            let r = x.rank();
            let (m, k, n) = (x.dims()[r - 2], x.dims()[r - 1], y.dims()[r - 1]);
            let batch = x.dims()[..r - 2].iter().product();
            KernelKind::Matmul { a, b: bb, batch, m, k, n, epilogue: None }
        }
        Op::Gather(d, x, idx) => {
            b.ops.push("gather");
            KernelKind::Gather { dim: *d, input: b.view(x), index: b.view(idx) }
        }
        Op::ScatterAdd(d, x, idx, src) => {
            b.ops.push("scatter_add");
            KernelKind::ScatterAdd { dim: *d, input: b.view(x), index: b.view(idx), src: b.view(src) }
        }
        Op::IndexSelect(d, x, idx) => {
            b.ops.push("index_select");
            KernelKind::IndexSelect { dim: *d, input: b.view(x), index: b.view(idx) }
        }
        Op::Cumsum(d, x) => {
            b.ops.push("cumsum");
            KernelKind::Cumsum { dim: *d, input: b.view(x) }
        }
        Op::Cat(d, xs) => {
            b.ops.push("cat");
            KernelKind::Cat { dim: *d, parts: xs.iter().map(|x| b.view(x)).collect() }
        }
        Op::Unfold(x, p, pad) => {
            b.ops.push("unfold");
            KernelKind::Unfold { input: b.view(x), params: *p, pad: *pad }
        }
        Op::Fold(x, p, hw) => {
            b.ops.push("fold");
            KernelKind::Fold { input: b.view(x), params: *p, hw: *hw }
        }
        _ => unreachable!(),
    };
    Kernel { kind, inputs: b.inputs, out: 0, dtype: node.dtype, numel: node.numel(), ops: b.ops }
}

impl Builder<'_> {
    /// The expression of a materialized elementwise node itself.
    fn node_root(&mut self, i: usize) {
        self.node(i, vec![]);
    }
}

/// Fold an elementwise kernel into the matmul whose product it reads, when
/// it is that product's only reader, reads it element for element, and
/// nobody keeps the product: bias adds and activations after a Linear then
/// run in the matmul's stores, and the product never touches memory.
fn fuse_epilogues(plan: &mut Plan, slot_of: &[Option<Slot>], survives: &[bool]) {
    use super::kernel::Epilogue;
    let kept_slot = |s: Slot| slot_of.iter().zip(survives).any(|(o, &keep)| *o == Some(s) && keep);
    let mut k = 0;
    while k < plan.kernels.len() {
        let KernelKind::Elementwise { expr, .. } = &plan.kernels[k].kind else {
            k += 1;
            continue;
        };
        let numel = plan.kernels[k].numel;
        // The matmul this kernel reads element for element, if any.
        let found = expr.loads.iter().enumerate().find_map(|(li, l)| {
            let slot = plan.kernels[k].inputs[l.input];
            let mi = plan.kernels[..k].iter().position(|m| m.out == slot)?;
            let m = &plan.kernels[mi];
            let identity = l.path.len() == 1 && l.path[0].is_contiguous() && l.path[0].offset == 0 && m.numel == numel;
            let only_load = expr.loads.iter().filter(|o| o.input == l.input).count() == 1;
            let readers = plan.kernels.iter().filter(|o| o.inputs.contains(&slot)).count();
            let plain = matches!(m.kind, KernelKind::Matmul { epilogue: None, .. }) && m.dtype.is_float();
            (identity && only_load && readers == 1 && plain && !kept_slot(slot)).then_some((li, mi))
        });
        let Some((acc, mi)) = found else {
            k += 1;
            continue;
        };
        let e = plan.kernels.remove(k);
        let mut m = plan.kernels.remove(mi);
        let KernelKind::Elementwise { mut expr, shape } = e.kind else { unreachable!("matched above") };
        // Epilogue loads read the matmul kernel's inputs, the product's load included
        // (its input index is never used: `acc` stands for it).
        let acc_slot = e.inputs[expr.loads[acc].input];
        for l in expr.loads.iter_mut() {
            let slot = e.inputs[l.input];
            l.input = match m.inputs.iter().position(|&s| s == slot) {
                Some(p) => p,
                None if slot == acc_slot => 0,
                None => {
                    m.inputs.push(slot);
                    m.inputs.len() - 1
                }
            };
        }
        if let KernelKind::Matmul { epilogue, .. } = &mut m.kind {
            *epilogue = Some(Epilogue { expr, shape, acc, acc_dtype: m.dtype });
        }
        m.ops.extend(e.ops);
        m.out = e.out;
        m.dtype = e.dtype;
        // At the elementwise kernel's place: every epilogue input exists by then.
        plan.kernels.insert(k - 1, m);
    }
}

/// The finest shape whose dims split both `a` and `b` (same element count),
/// if one exists: the union of their suffix-product breakpoints must form a
/// divisibility chain. `[14, 14]` and `[7, 2, 7, 2]` give `[7, 2, 7, 2]`.
fn common_refinement(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    if a.contains(&0) || b.contains(&0) {
        return None;
    }
    let points = |d: &[usize]| -> Vec<usize> {
        let mut p = vec![1usize];
        for &x in d.iter().rev() {
            if x != 1 {
                p.push(p[p.len() - 1].saturating_mul(x));
            }
        }
        p
    };
    let (pa, pb) = (points(a), points(b));
    if pa.last() != pb.last() {
        return None;
    }
    let mut all: Vec<usize> = pa.into_iter().chain(pb).collect();
    all.sort_unstable();
    all.dedup();
    let mut dims = Vec::with_capacity(all.len());
    for w in all.windows(2) {
        if w[1] % w[0] != 0 {
            return None;
        }
        dims.push(w[1] / w[0]);
    }
    dims.reverse();
    Some(dims)
}

/// `l` (over `l.dims()`) as a layout over the finer shape `fine`, each of
/// its dims split into the consecutive dims of `fine` that multiply to it.
fn split_layout(l: &Layout, fine: &[usize]) -> Option<Layout> {
    let mut strides = Vec::with_capacity(fine.len());
    let mut j = 0;
    for (&d, &s) in l.dims().iter().zip(l.strides()) {
        if d == 1 {
            continue;
        }
        let start = j;
        let mut prod = 1;
        while prod < d {
            prod *= *fine.get(j)?;
            j += 1;
        }
        if prod != d {
            return None;
        }
        let mut st = s;
        let mut part = vec![0; j - start];
        for k in (start..j).rev() {
            part[k - start] = st;
            st *= fine[k];
        }
        strides.extend(part);
    }
    if j != fine.len() {
        return None;
    }
    Some(Layout { shape: crate::shape::Shape(fine.to_vec()), strides, offset: l.offset })
}

/// Iterate an elementwise kernel over a finer shape when that lets a load
/// whose views could not be composed (a reshape that splits dims, as in
/// pooling windows) read through one strided layout: no per-element index
/// arithmetic. Other loads are split the same way.
fn refine_expr(mut expr: Expr, dims: &[usize]) -> (Vec<usize>, Expr) {
    let mut shape = dims.to_vec();
    for _ in 0..4 {
        let target = expr.loads.iter().find_map(|l| {
            let (a, b) = (l.path.first()?, l.path.get(1)?);
            (a.is_contiguous() && a.offset == 0 && a.numel() == b.numel()).then(|| b.dims().to_vec())
        });
        let Some(target) = target else { break };
        let Some(fine) = common_refinement(&shape, &target) else { break };
        let mut ok = true;
        let mut loads = expr.loads.clone();
        for l in loads.iter_mut() {
            let Some(first) = l.path[0].reshape(&shape).and_then(|f| split_layout(&f, &fine)) else {
                ok = false;
                break;
            };
            l.path[0] = first;
            if l.path.len() >= 2 && l.path[0].is_contiguous() && l.path[0].offset == 0 && l.path[1].numel() == l.path[0].numel() {
                if let Some(second) = split_layout(&l.path[1], &fine) {
                    l.path.remove(0);
                    l.path[0] = second;
                }
            }
            simplify(&mut l.path);
            if l.path.is_empty() {
                l.path.push(Layout::contiguous(&fine));
            }
        }
        if !ok {
            break;
        }
        expr.loads = loads;
        shape = fine;
    }
    (shape, expr)
}

/// Merge iteration dims that every load's first layout can walk with one
/// stride; `groups` gives the sizes of runs of dims that must not merge with
/// each other (kept vs reduced dims of a reduction).
fn coalesce_expr(mut expr: Expr, shape: &[usize], groups: &[usize]) -> (Vec<usize>, Expr) {
    let mut new_shape = vec![];
    let mut new_firsts: Vec<Layout> =
        expr.loads.iter().map(|l| Layout { shape: crate::shape::Shape(vec![]), strides: vec![], offset: l.path[0].offset }).collect();
    let mut start = 0;
    for &gsize in groups {
        let dims = &shape[start..start + gsize];
        let sub: Vec<Layout> = expr
            .loads
            .iter()
            .map(|l| Layout {
                shape: crate::shape::Shape(dims.to_vec()),
                strides: l.path[0].strides[start..start + gsize].to_vec(),
                offset: 0,
            })
            .collect();
        let refs: Vec<&Layout> = sub.iter().collect();
        let (d, merged) = if gsize == 0 { (vec![], sub.clone()) } else { Layout::coalesce(&refs, dims) };
        // Keep a reduction's groups non-empty so `outer`/`inner` stay meaningful.
        new_shape.extend(&d);
        for (f, m) in new_firsts.iter_mut().zip(&merged) {
            f.shape.0.extend(&d);
            f.strides.extend(&m.strides);
        }
        start += gsize;
    }
    if expr.loads.is_empty() {
        // Nothing to walk: any shape with the same element count will do.
        let n: usize = shape.iter().product();
        let _ = n;
        return (shape.to_vec(), expr);
    }
    for (l, f) in expr.loads.iter_mut().zip(new_firsts) {
        l.path[0] = f;
    }
    (new_shape, expr)
}

/// Does `l` (over a kernel's iteration dims) read element `p / inner` of a
/// contiguous buffer at each linear position `p`? That is how a consumer
/// reads the per-row values of a reduction over rows of `inner` elements
/// (with `inner = 1`: element for element).
fn reads_by_row(l: &Layout, inner: usize) -> bool {
    if l.offset != 0 {
        return false;
    }
    let (dims, strides) = (l.dims(), l.strides());
    let mut k = dims.len();
    let mut acc = 1;
    while k > 0 && acc < inner {
        k -= 1;
        if dims[k] != 1 && strides[k] != 0 {
            return false;
        }
        acc *= dims[k];
    }
    if acc != inner {
        return false;
    }
    let mut expect = 1;
    for d in (0..k).rev() {
        if dims[d] != 1 && strides[d] != expect {
            return false;
        }
        expect *= dims[d];
    }
    true
}

/// Lower row-wise work to one-pass kernels: an elementwise kernel over
/// `outer x inner` elements that reads reductions over rows of `inner`
/// (and small per-row elementwise kernels between them) absorbs them when
/// nobody else reads or keeps their results. Softmax (max, sum of exp,
/// divide) and layer norm (mean, variance, normalise) become one kernel
/// that reads its input from memory once; the re-reads of a row hit cache.
fn fuse_rows(plan: &mut Plan, slot_of: &[Option<Slot>], survives: &[bool]) {
    let kept: HashSet<Slot> =
        slot_of.iter().zip(survives).filter_map(|(o, &keep)| if keep { *o } else { None }).collect();
    // Which kernel writes each slot; rebuilt only when a fusion moves kernels.
    let index = |plan: &Plan| -> HashMap<Slot, usize> { plan.kernels.iter().enumerate().map(|(i, k)| (k.out, i)).collect() };
    let mut writer = index(plan);
    let mut k = 0;
    while k < plan.kernels.len() {
        k = match fuse_rows_at(plan, k, &kept, &writer) {
            Some(at) => {
                writer = index(plan);
                at + 1
            }
            None => k + 1,
        };
    }
}

/// The expression and iteration shape of an elementwise or reduce kernel.
fn expr_of(k: &Kernel) -> Option<(&Expr, &[usize])> {
    match &k.kind {
        KernelKind::Elementwise { expr, shape } | KernelKind::Reduce { expr, shape, .. } => Some((expr, shape)),
        _ => None,
    }
}

/// Try to make kernel `k` the output stage of a rows kernel; returns the
/// fused kernel's index.
fn fuse_rows_at(plan: &mut Plan, k: usize, kept: &HashSet<Slot>, writer: &HashMap<Slot, usize>) -> Option<usize> {
    use crate::op::ReduceOp;
    let KernelKind::Elementwise { expr, .. } = &plan.kernels[k].kind else { return None };
    let numel = plan.kernels[k].numel;
    let producer = |slot: Slot, before: usize| writer.get(&slot).copied().filter(|&i| i < before);
    let row_reduce = |m: &Kernel| match &m.kind {
        KernelKind::Reduce { op, expr, outer, inner, .. } => {
            let float = m.dtype.is_float() && m.dtype != DType::F64 && expr.dtype().is_float() && expr.dtype() != DType::F64;
            matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min | ReduceOp::Prod).then_some((*outer, *inner)).filter(|_| float)
        }
        _ => None,
    };
    // Only an output that reads something broadcast can read per-row values.
    if !expr.loads.iter().any(|l| l.path[0].strides().contains(&0)) {
        return None;
    }
    // The row split comes from a reduction the output reads, directly or
    // through small elementwise kernels (layer norm's mean and 1/std).
    let mut split = None;
    let mut frontier = vec![k];
    for _ in 0..4 {
        let mut next = vec![];
        for &c in &frontier {
            let Some((e, _)) = expr_of(&plan.kernels[c]) else { continue };
            for l in &e.loads {
                let Some(p) = producer(plan.kernels[c].inputs[l.input], c) else { continue };
                let m = &plan.kernels[p];
                if let Some((o, i)) = row_reduce(m).filter(|&(o, i)| o * i == numel && i >= 2) {
                    split = split.or(Some((o, i)));
                } else if matches!(m.kind, KernelKind::Elementwise { .. }) && m.numel < numel {
                    next.push(p);
                }
            }
        }
        if split.is_some() || next.is_empty() {
            break;
        }
        frontier = next;
    }
    let (outer, inner) = split?;
    // One workgroup per row: few long rows are better served by split reductions.
    if outer < 128 && inner > 16384 {
        return None;
    }
    // Candidates: reductions over the same rows and per-row elementwise
    // kernels, reachable from the output through loads.
    let mut members: Vec<usize> = vec![];
    let mut queue = vec![k];
    while let Some(c) = queue.pop() {
        let (e, _) = expr_of(&plan.kernels[c])?;
        for l in &e.loads {
            let Some(p) = producer(plan.kernels[c].inputs[l.input], c) else { continue };
            if members.contains(&p) {
                continue;
            }
            let m = &plan.kernels[p];
            let per_row = matches!(m.kind, KernelKind::Elementwise { .. }) && m.numel == outer && m.dtype != DType::F64;
            if row_reduce(m) == Some((outer, inner)) || per_row {
                members.push(p);
                queue.push(p);
            }
        }
    }
    // Drop candidates that someone else reads or keeps, or that a member
    // reads other than row by row, until what is left is closed.
    loop {
        let before = members.len();
        let consumers: Vec<usize> = members.iter().copied().chain([k]).collect();
        let mut bad: Vec<usize> = vec![];
        for &m in &members {
            let slot = plan.kernels[m].out;
            let outside = plan.kernels.iter().enumerate().any(|(i, o)| o.inputs.contains(&slot) && !consumers.contains(&i));
            if outside || kept.contains(&slot) {
                bad.push(m);
            }
        }
        for &c in &consumers {
            let (e, _) = expr_of(&plan.kernels[c])?;
            let per_elem = if c == k || matches!(plan.kernels[c].kind, KernelKind::Reduce { .. }) { inner } else { 1 };
            for l in &e.loads {
                let slot = plan.kernels[c].inputs[l.input];
                if let Some(&m) = members.iter().find(|&&m| plan.kernels[m].out == slot) {
                    if l.path.len() != 1 || !reads_by_row(&l.path[0], per_elem) {
                        bad.push(m);
                    }
                }
            }
        }
        members.retain(|m| !bad.contains(m));
        if members.len() == before {
            break;
        }
    }
    if !members.iter().any(|&m| matches!(plan.kernels[m].kind, KernelKind::Reduce { .. })) {
        return None;
    }
    members.sort_unstable();
    // Build the stages; loads of member results become stage reads.
    let mut inputs: Vec<Slot> = vec![];
    let stage_of = |slot: Slot, members: &[usize], plan: &Plan| members.iter().position(|&m| plan.kernels[m].out == slot);
    let mut stage = |plan: &Plan, c: usize, op: Option<ReduceOp>| -> Option<RowStage> {
        let (e, shape) = expr_of(&plan.kernels[c])?;
        let mut expr = e.clone();
        let mut from = vec![];
        for (li, l) in expr.loads.iter_mut().enumerate() {
            let slot = plan.kernels[c].inputs[l.input];
            if let Some(s) = stage_of(slot, &members, plan) {
                from.push((li, s));
                l.input = 0;
            } else {
                l.input = match inputs.iter().position(|&x| x == slot) {
                    Some(p) => p,
                    None => {
                        inputs.push(slot);
                        inputs.len() - 1
                    }
                };
            }
        }
        Some(RowStage { op, expr, shape: shape.to_vec(), from, dtype: plan.kernels[c].dtype })
    };
    let mut stages = vec![];
    for &m in &members {
        let op = match &plan.kernels[m].kind {
            KernelKind::Reduce { op, .. } => Some(*op),
            _ => None,
        };
        stages.push(stage(plan, m, op)?);
    }
    let out = stage(plan, k, None)?;
    let mut ops = vec![];
    for &m in &members {
        ops.extend(plan.kernels[m].ops.iter().copied());
    }
    let e = &plan.kernels[k];
    ops.extend(e.ops.iter().copied());
    let fused = Kernel { kind: KernelKind::Rows { outer, inner, stages, out }, inputs, out: e.out, dtype: e.dtype, numel: e.numel, ops };
    plan.kernels[k] = fused;
    for &m in members.iter().rev() {
        plan.kernels.remove(m);
    }
    Some(k - members.len())
}
