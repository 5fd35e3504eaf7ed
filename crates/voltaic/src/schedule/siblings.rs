//! Pass 8, sibling fusion: elementwise kernels over one shape (or shapes
//! of one element count that split to a common one) become one kernel with
//! several outputs, where the executor runs such kernels
//! (`Capabilities::multi_output`).
//!
//! The vertical fusion of pass 2 inlines a node into its consumers only
//! when that costs no second evaluation, so a value two outputs need (an
//! optimizer's new moment, which the new weight reads too) becomes a
//! kernel of its own, and outputs that read the same buffers (the weight,
//! both moments, all from one gradient) become one kernel each. Adam's
//! update was three to five dispatches per parameter, each reading the
//! gradient again. Here a kernel joins an earlier one of the same shape
//! when everything it reads exists at that earlier kernel's place: reads
//! of the earlier kernel's own results, element for element, become its
//! values instead of loads, shared inputs are loaded once, and results
//! nobody else reads or keeps are no longer stored. A kernel whose results
//! nothing in the plan reads (a KV cache's write, once the attention
//! computes the cache in its loads) may also move down to a later sibling:
//! a decoder's 16 layers of cache writes are one dispatch, not 16.

use super::refine::{common_refinement, split_expr};
use crate::ir::{Expr, Instr, Kernel, KernelKind, Load, Plan, Slot};
use foldhash::{HashMap, HashMapExt, HashSet};

/// How far back a kernel looks for a sibling to join.
const WINDOW: usize = 32;
/// Kernels this large join only siblings they share a buffer with: on their
/// own they are bound by memory, not by the dispatch.
const SMALL: usize = 1 << 16;
/// The most instructions a merged expression may hold.
const MAX_INSTRS: usize = 512;

/// Merge elementwise kernels into earlier ones of the same shape (see the
/// module docs); a merged kernel reads at most `max_inputs` buffers, its
/// extra outputs counted among them.
pub(crate) fn fuse_siblings(plan: &mut Plan, kept: &HashSet<Slot>, max_inputs: usize) {
    let kernels = std::mem::take(&mut plan.kernels);
    // Slots some kernel reads: a kernel none of whose results is among them
    // may run later than its place.
    let read: HashSet<Slot> = kernels.iter().flat_map(|k| k.inputs.iter().copied()).collect();
    let mut out: Vec<Kernel> = Vec::with_capacity(kernels.len());
    // Which kernel of `out` writes each slot.
    let mut writer: HashMap<Slot, usize> = HashMap::with_capacity(kernels.len() * 2);
    for k in kernels {
        let target = match &k.kind {
            KernelKind::Elementwise { .. } => best_sibling(plan, &out, &writer, &read, &k, max_inputs).map(|(a, moves)| {
                if !moves {
                    return a;
                }
                move_to_end(&mut out, &mut writer, a);
                out.len() - 1
            }),
            _ => None,
        };
        match target {
            Some(a) => {
                writer.insert(k.out, a);
                let mut k = k;
                walk_finer(&mut out[a], &mut k);
                merge(plan, &mut out[a], k);
            }
            None => {
                writer.insert(k.out, out.len());
                out.push(k);
            }
        }
    }
    drop_unread_outputs(&mut out, kept);
    plan.kernels = out;
}

/// The kernel of `out` that `k` can join with the most shared buffers, and
/// whether that kernel must first move down to `k`'s place. A kernel joins
/// an earlier one where everything it reads exists; failing that, an
/// earlier kernel whose results nothing reads (`read` holds the slots some
/// kernel reads) may run later and join it there (a KV cache's writes,
/// which the attention kernels compute in their own loads: each layer's
/// write joins the earlier layers', one dispatch instead of one a layer).
fn best_sibling(plan: &Plan, out: &[Kernel], writer: &HashMap<Slot, usize>, read: &HashSet<Slot>, k: &Kernel, max_inputs: usize) -> Option<(usize, bool)> {
    let KernelKind::Elementwise { expr, shape } = &k.kind else { return None };
    if expr.dtype() != k.dtype || plan.slots[k.out].dtype != k.dtype {
        return None;
    }
    let most_shared = |candidates: &mut dyn Iterator<Item = usize>| {
        let mut best: Option<(usize, usize)> = None;
        for a in candidates {
            let Some(shared) = joinable(plan, &out[a], a, writer, k, expr, shape, max_inputs) else { continue };
            if (shared > 0 || k.numel < SMALL) && best.is_none_or(|(s, _)| shared > s) {
                best = Some((shared, a));
            }
        }
        best.map(|(_, a)| a)
    };
    // Everything `k` reads exists from kernel `first` on.
    let first = k.inputs.iter().filter_map(|s| writer.get(s)).max().map_or(0, |&w| w);
    let lo = first.max(out.len().saturating_sub(WINDOW));
    if let Some(a) = most_shared(&mut (lo..out.len()).rev()) {
        return Some((a, false));
    }
    let unread = |a: &usize| !out[*a].outputs().any(|s| read.contains(&s));
    most_shared(&mut (0..out.len()).filter(unread)).map(|a| (a, true))
}

/// Move kernel `a` of `out` to the end, renumbering the writers.
fn move_to_end(out: &mut Vec<Kernel>, writer: &mut HashMap<Slot, usize>, a: usize) {
    let k = out.remove(a);
    for w in writer.values_mut() {
        if *w > a {
            *w -= 1;
        }
    }
    for s in k.outputs() {
        writer.insert(s, out.len());
    }
    out.push(k);
}

/// Whether `k` (with `expr` over `shape`) can join kernel `a` of `out`
/// within `max_inputs` bindings besides the first output, and if so how
/// many buffers they share.
#[allow(clippy::too_many_arguments)]
fn joinable(plan: &Plan, a: &Kernel, ai: usize, writer: &HashMap<Slot, usize>, k: &Kernel, expr: &Expr, shape: &[usize], max_inputs: usize) -> Option<usize> {
    let (a_expr, a_shape) = match &a.kind {
        KernelKind::Elementwise { expr, shape } | KernelKind::Multi { expr, shape, .. } => (expr, shape),
        _ => return None,
    };
    if a.numel != k.numel || a_expr.instrs.len() + expr.instrs.len() > MAX_INSTRS || common_shape(a_expr, a_shape, expr, shape).is_none() {
        return None;
    }
    if matches!(a.kind, KernelKind::Elementwise { .. }) && (a_expr.dtype() != a.dtype || plan.slots[a.out].dtype != a.dtype) {
        return None;
    }
    let mut shared = 0;
    // Bindings, counting a buffer larger than one binding may cover as
    // several (see `bindings`): what `max_inputs` bounds on the executor.
    let mut binds: usize = a.inputs.iter().chain(&a.also).map(|&s| bindings(plan, s)).sum();
    binds += bindings(plan, k.out);
    for (i, &s) in k.inputs.iter().enumerate() {
        if writer.get(&s) == Some(&ai) {
            // A result of `a`: read element for element in its own dtype, it
            // is a value of the merged kernel; any other read would race
            // with the store of another thread.
            let ok = expr.loads.iter().filter(|l| l.input == i).all(|l| identity(l) && l.dtype == plan.slots[s].dtype);
            if !ok {
                return None;
            }
            shared += 1;
        } else if a.inputs.contains(&s) {
            shared += 1;
        } else {
            binds += bindings(plan, s);
        }
    }
    (binds <= max_inputs).then_some(shared)
}

/// The shape two kernels of one element count can both walk: theirs if
/// equal, else the finest that splits both (a key rotated in its pairs'
/// shape `[h, n, d / 2, 2]` and a value written as `[h, n, d]`), if every
/// load of both splits to it.
fn common_shape(a_expr: &Expr, a_shape: &[usize], expr: &Expr, shape: &[usize]) -> Option<Vec<usize>> {
    if a_shape == shape {
        return Some(shape.to_vec());
    }
    let fine = common_refinement(a_shape, shape)?;
    split_expr(a_expr, &fine)?;
    split_expr(expr, &fine)?;
    Some(fine)
}

/// Both kernels walking their common shape, which `joinable` checked
/// exists (see [`common_shape`]).
fn walk_finer(a: &mut Kernel, k: &mut Kernel) {
    let (KernelKind::Elementwise { expr: ae, shape: ash } | KernelKind::Multi { expr: ae, shape: ash, .. }) = &mut a.kind else { return };
    let KernelKind::Elementwise { expr: ke, shape: ksh } = &mut k.kind else { return };
    if ash == ksh {
        return;
    }
    let fine = common_refinement(ash, ksh).expect("checked by `joinable`");
    *ae = split_expr(ae, &fine).expect("checked by `joinable`");
    *ke = split_expr(ke, &fine).expect("checked by `joinable`");
    *ash = fine.clone();
    *ksh = fine;
}

/// The bindings a GPU kernel may need for slot `s`: one per 128 MiB (the
/// smallest storage-binding size adapters commonly offer: WebGPU's default,
/// lavapipe's), at least one.
fn bindings(plan: &Plan, s: Slot) -> usize {
    let slot = &plan.slots[s];
    let bytes = slot.numel * slot.dtype.size_in_bytes().max(4);
    bytes.div_ceil(128 << 20).max(1)
}

/// A load of element `i` at element `i`: one contiguous layout, no offset.
fn identity(l: &Load) -> bool {
    l.path.len() == 1 && l.path[0].is_contiguous() && l.path[0].offset() == 0
}

/// Append kernel `k`'s work to `a`, which becomes (or stays) a `Multi` kernel.
fn merge(plan: &Plan, a: &mut Kernel, k: Kernel) {
    let old = std::mem::replace(&mut a.kind, KernelKind::Multi { expr: Expr::default(), shape: vec![], stores: vec![] });
    let (mut expr, shape, mut stores) = match old {
        KernelKind::Elementwise { expr, shape } => {
            let last = expr.instrs.len() - 1;
            (expr, shape, vec![last])
        }
        KernelKind::Multi { expr, shape, stores } => (expr, shape, stores),
        _ => unreachable!("only elementwise kernels are joined"),
    };
    let KernelKind::Elementwise { expr: kx, .. } = k.kind else { unreachable!("only elementwise kernels join") };
    // The instruction that holds each output slot of `a`.
    let outputs: Vec<Slot> = a.outputs().collect();
    let value_of = |s: Slot| outputs.iter().position(|&o| o == s).map(|j| stores[j]);
    // Instructions already present, to share equal ones (loads of one
    // element of one buffer, the same operation on the same operands).
    let mut known: HashMap<(Instr, crate::dtype::DType), usize> = HashMap::with_capacity(expr.instrs.len());
    for (i, &(ins, dt)) in expr.instrs.iter().enumerate() {
        if !matches!(ins, Instr::Const(_)) {
            known.entry((ins, dt)).or_insert(i);
        }
    }
    let mut map: Vec<usize> = Vec::with_capacity(kx.instrs.len());
    for &(ins, dt) in &kx.instrs {
        let new = match ins {
            Instr::Load(l) => {
                let load = &kx.loads[l];
                let slot = k.inputs[load.input];
                if let Some(v) = value_of(slot) {
                    map.push(v);
                    continue;
                }
                let input = match a.inputs.iter().position(|&s| s == slot) {
                    Some(p) => p,
                    None => {
                        a.inputs.push(slot);
                        a.inputs.len() - 1
                    }
                };
                let load = Load { input, dtype: load.dtype, path: load.path.clone() };
                match expr.loads.iter().position(|l| *l == load) {
                    Some(p) => Instr::Load(p),
                    None => {
                        expr.loads.push(load);
                        Instr::Load(expr.loads.len() - 1)
                    }
                }
            }
            Instr::Const(c) => {
                // Constants stay apart: their values are data that a cached
                // plan replaces, each from its own graph node.
                expr.consts.push(kx.consts[c]);
                expr.const_nodes.push(kx.const_nodes[c]);
                expr.instrs.push((Instr::Const(expr.consts.len() - 1), dt));
                map.push(expr.instrs.len() - 1);
                continue;
            }
            Instr::Map(op, args) => {
                let mut args2 = [0; 3];
                for (j, &x) in args[..op.arity()].iter().enumerate() {
                    args2[j] = map[x];
                }
                Instr::Map(op, args2)
            }
        };
        let i = *known.entry((new, dt)).or_insert_with(|| {
            expr.instrs.push((new, dt));
            expr.instrs.len() - 1
        });
        map.push(i);
    }
    stores.push(map[kx.instrs.len() - 1]);
    a.also.push(k.out);
    a.ops.extend(k.ops);
    debug_assert_eq!(plan.slots[k.out].dtype, expr.instrs[*stores.last().expect("pushed")].1);
    a.kind = KernelKind::Multi { expr, shape, stores };
}

/// Outputs of `Multi` kernels that no kernel reads and nothing keeps
/// (results that only fed their siblings) are no longer stored.
fn drop_unread_outputs(kernels: &mut [Kernel], kept: &HashSet<Slot>) {
    let read: HashSet<Slot> = kernels.iter().flat_map(|k| k.inputs.iter().copied()).collect();
    for k in kernels.iter_mut() {
        let slots: Vec<Slot> = k.outputs().collect();
        let KernelKind::Multi { stores, expr, .. } = &mut k.kind else { continue };
        let keep: Vec<bool> = slots.iter().map(|s| read.contains(s) || kept.contains(s)).collect();
        if keep.iter().all(|&x| !x) {
            continue;
        }
        let (mut s2, mut st2) = (vec![], vec![]);
        for ((s, st), keep) in slots.iter().zip(stores.iter()).zip(&keep) {
            if *keep {
                s2.push(*s);
                st2.push(*st);
            }
        }
        *stores = st2;
        k.out = s2[0];
        k.also = s2[1..].to_vec();
        k.dtype = expr.instrs[stores[0]].1;
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::Capabilities;
    use crate::ir::KernelKind;
    use crate::primitive::{BinaryOp, UnaryOp};
    use crate::schedule::testing::*;
    use crate::schedule::{schedule, Scheduled};

    fn gpu_like(max_inputs: usize) -> Capabilities {
        Capabilities { multi_output: true, max_inputs, ..cpu_caps() }
    }

    /// An Adam-shaped update: two moments from one gradient, and a weight
    /// that reads both.
    fn adam_like() -> [crate::graph::Value; 3] {
        adam_of(&[4, 8])
    }

    fn adam_of(dims: &[usize]) -> [crate::graph::Value; 3] {
        let (w0, m0, v0, g) = (input(dims), input(dims), input(dims), input(dims));
        let m = binary(&binary(&m0, &constant_like(&m0, 0.9), BinaryOp::Mul), &binary(&g, &constant_like(&g, 0.1), BinaryOp::Mul), BinaryOp::Add);
        let gg = binary(&g, &g, BinaryOp::Mul);
        let v = binary(&binary(&v0, &constant_like(&v0, 0.99), BinaryOp::Mul), &binary(&gg, &constant_like(&g, 0.01), BinaryOp::Mul), BinaryOp::Add);
        let w = binary(&w0, &binary(&m, &unary(&v, UnaryOp::Sqrt), BinaryOp::Div), BinaryOp::Sub);
        [w, m, v]
    }

    #[test]
    fn an_optimizer_update_is_one_kernel_with_three_outputs() {
        let [w, m, v] = adam_like();
        let separate = schedule(&[&w, &m, &v], cpu_caps()).plan;
        assert_eq!(separate.kernels.len(), 3, "{:?}", separate.kernels.iter().map(|k| &k.ops).collect::<Vec<_>>());
        let Scheduled { plan, store, .. } = schedule(&[&w, &m, &v], gpu_like(27));
        assert_eq!(plan.kernels.len(), 1);
        let k = &plan.kernels[0];
        let KernelKind::Multi { stores, .. } = &k.kind else { panic!("{:?}", k.kind.name()) };
        assert_eq!(stores.len(), 3);
        assert_eq!(k.also.len(), 2);
        // Four buffers read once each: the weight, both moments, the gradient.
        assert_eq!(k.inputs.len(), 4);
        let mut written: Vec<_> = k.outputs().collect();
        let mut outs = plan.outputs.clone();
        written.sort();
        outs.sort();
        assert_eq!(written, outs);
        assert_eq!(store.len(), 3);
    }

    /// A kernel that walks `[6, 4]` (a transposed read, which does not
    /// flatten) and one that walks `[24]` join over `[6, 4]`, each result
    /// where it was.
    #[test]
    fn kernels_of_one_size_and_different_shapes_join_over_a_common_one() {
        let (x, y) = (input(&[6, 4]), input(&[4, 6]));
        let a = unary(&x, UnaryOp::Exp);
        let b = unary(&transpose(&y), UnaryOp::Exp);
        assert_eq!(schedule(&[&a, &b], cpu_caps()).plan.kernels.len(), 2);
        let Scheduled { plan, .. } = schedule(&[&a, &b], gpu_like(27));
        assert_eq!(plan.kernels.len(), 1);
        let KernelKind::Multi { shape, expr, .. } = &plan.kernels[0].kind else { panic!("{:?}", plan.kernels[0].kind.name()) };
        assert_eq!(shape, &vec![6, 4]);
        let strides: Vec<Vec<usize>> = expr.loads.iter().map(|l| l.path[0].strides().to_vec()).collect();
        assert!(strides.contains(&vec![4, 1]) && strides.contains(&vec![1, 6]), "{strides:?}");
    }

    #[test]
    fn a_result_only_siblings_read_is_not_stored() {
        let x = input(&[16]);
        // `e` feeds two outputs: computed once, never stored (nothing
        // outside the graph holds it once the block ends).
        let (a, b) = {
            let e = unary(&x, UnaryOp::Exp);
            (binary(&e, &constant_like(&e, 2.0), BinaryOp::Mul), binary(&e, &x, BinaryOp::Add))
        };
        let ka = schedule(&[&a, &b], cpu_caps()).plan.kernels.len();
        let Scheduled { plan, .. } = schedule(&[&a, &b], gpu_like(27));
        assert!(ka >= 2, "{ka}");
        assert_eq!(plan.kernels.len(), 1);
        assert_eq!(1 + plan.kernels[0].also.len(), 2, "only a and b are stored");
    }

    #[test]
    fn a_transposed_read_of_a_sibling_result_does_not_join_it() {
        let x = input(&[8, 8]);
        let e = unary(&x, UnaryOp::Exp);
        // Reads `e` transposed: thread i would read what thread j writes.
        let t = binary(&transpose(&e), &x, BinaryOp::Add);
        let Scheduled { plan, .. } = schedule(&[&e, &t], gpu_like(27));
        assert_eq!(plan.kernels.len(), 2);
        assert!(plan.kernels.iter().all(|k| k.also.is_empty()));
    }

    #[test]
    fn merging_stops_at_the_binding_limit_and_at_other_shapes() {
        let [w, m, v] = adam_like();
        // Three inputs at most: the update cannot become one kernel.
        let plan = schedule(&[&w, &m, &v], gpu_like(3)).plan;
        assert!(plan.kernels.len() >= 2);
        assert!(plan.kernels.iter().all(|k| k.inputs.len() + k.also.len() <= 3));
        // Transposed reads walk [4, 6] and [6, 4], which no shape splits
        // both of (see `kernels_of_one_size_and_different_shapes_join_over_a_common_one`).
        let (x, y) = (input(&[6, 4]), input(&[4, 6]));
        let a = unary(&transpose(&x), UnaryOp::Exp);
        let b = unary(&transpose(&y), UnaryOp::Exp);
        assert_eq!(schedule(&[&a, &b], gpu_like(27)).plan.kernels.len(), 2);
    }

    #[test]
    fn buffers_larger_than_a_binding_count_as_several() {
        // Seven bindings allow the whole update at this size (four inputs,
        // two more outputs)...
        let [w, m, v] = adam_like();
        assert_eq!(schedule(&[&w, &m, &v], gpu_like(7)).plan.kernels.len(), 1);
        // ...but not when every buffer takes two 128 MiB bindings.
        let [w, m, v] = adam_of(&[(128 << 20) / 4 + 1]);
        let plan = schedule(&[&w, &m, &v], gpu_like(7)).plan;
        assert!(plan.kernels.len() >= 2, "{}", plan.kernels.len());
        assert!(plan.kernels.iter().all(|k| 2 * (k.inputs.len() + k.also.len()) <= 7 || k.also.is_empty()));
    }

    /// `a` comes first and could join `b` only where `b`'s input exists:
    /// nothing reads `a`, so it moves down to `b` (a KV cache's write of one
    /// layer joining the next layer's). Read by a later kernel, it stays.
    #[test]
    fn a_kernel_nothing_reads_moves_down_to_join_a_later_sibling() {
        let (x, y) = (input(&[64]), input(&[64]));
        let a = unary(&x, UnaryOp::Exp);
        let s = reduce(&unary(&y, UnaryOp::Neg), crate::primitive::ReduceOp::Sum, &[0]);
        let b = binary(&y, &broadcast(&s, &[64]), BinaryOp::Mul);
        let names = |p: &crate::ir::Plan| p.kernels.iter().map(|k| (k.kind.name(), 1 + k.also.len())).collect::<Vec<_>>();
        let plan = schedule(&[&b, &s, &a], gpu_like(27)).plan;
        assert_eq!(names(&plan), [("reduce", 1), ("elementwise", 2)]);
        let plan = schedule(&[&b, &s, &a], cpu_caps()).plan;
        assert_eq!(names(&plan), [("elementwise", 1), ("reduce", 1), ("elementwise", 1)], "the order it moves from");
        // Read by a later kernel, `a` cannot move below it.
        let c = reduce(&a, crate::primitive::ReduceOp::Max, &[0]);
        let plan = schedule(&[&b, &s, &a, &c], gpu_like(27)).plan;
        let at = |slot| plan.kernels.iter().position(|k| k.outputs().any(|o| o == slot)).unwrap();
        let reads_a = plan.kernels.iter().position(|k| k.kind.name() == "reduce" && at(k.inputs[0]) == 0).expect("c reads a");
        assert_eq!(plan.kernels[0].also.len(), 0, "a is alone");
        assert!(reads_a > 0);
    }

    #[test]
    fn a_kernel_never_moves_above_the_kernel_that_writes_its_input() {
        let x = input(&[64]);
        let a = unary(&x, UnaryOp::Exp);
        // A reduction between: `c` needs its result and cannot join `a`.
        let s = reduce(&a, crate::primitive::ReduceOp::Sum, &[0]);
        let c = binary(&x, &broadcast(&s, &[64]), BinaryOp::Mul);
        let plan = schedule(&[&a, &c], gpu_like(27)).plan;
        let pos = |slot| plan.kernels.iter().position(|k| k.out == slot || k.also.contains(&slot)).unwrap();
        let reduce_at = plan.kernels.iter().position(|k| k.kind.name() == "reduce").unwrap();
        let c_slot = *plan.outputs.iter().find(|&&o| pos(o) > reduce_at).expect("c comes after the reduction");
        assert!(pos(c_slot) > reduce_at);
    }
}
