//! Pass 2, fuse: which pending elementwise nodes are computed inside the
//! kernel of their consumers instead of getting a buffer of their own.
//!
//! An elementwise node is inlined when it is not asked for and every
//! consumer ends up in one and the same kernel (elementwise work, or the
//! prologue of a reduction): there the lowering computes it once however
//! many consumers read it. Constants are inlined wherever their consumers
//! fuse. A node that a consumer reads through a broadcast (a stride 0 over
//! a dim larger than 1) would be recomputed for each of its elements, so it
//! gets a buffer unless it is a constant.
//!
//! A kernel reads at most `max_inputs` buffers (an executor's binding
//! limit: 8 storage buffers per shader in WebGPU's defaults, 32 on Mesa's
//! lavapipe): a node whose inlining would make its kernel read more gets a
//! buffer instead. An optimizer's per-parameter sums over a hundred tensors
//! are then several kernels, not one that no GPU can bind.

use super::collect::Dag;
use crate::graph::{Op, OpKind};
use foldhash::{HashSet, HashSetExt};

/// Whether each node of `g` is inlined into its consumers' kernel, no
/// kernel reading more than `max_inputs` buffers.
pub(crate) fn inline_decisions(g: &Dag, max_inputs: usize) -> Vec<bool> {
    let n = g.nodes.len();
    let fuses_inputs = |op: &Option<Op>| matches!(op, Some(o) if o.is_elementwise() || matches!(o.kind, OpKind::Reduce(..)));
    let read_broadcast = |i: usize| {
        g.consumers[i].iter().any(|&c| {
            g.ops[c].as_ref().is_some_and(|op| {
                op.inputs.iter().any(|v| {
                    v.node.id == g.nodes[i].id && v.layout.dims().iter().zip(v.layout.strides()).any(|(&d, &s)| d > 1 && s == 0)
                })
            })
        })
    };
    // Consumers come after producers, so one pass from the end decides
    // every node: `root[i]` is the node whose kernel computes node `i`.
    let mut inline = vec![false; n];
    let mut root: Vec<usize> = (0..n).collect();
    // What each kernel (by its root) reads so far: the nodes below it not
    // yet decided, or decided to have buffers. Inlining a node replaces it
    // there by its inputs; undecided ones may still be inlined later, so
    // this bounds the kernel's buffers from above.
    let mut reads: Vec<HashSet<usize>> = vec![HashSet::new(); n];
    let inputs_of = |i: usize| -> Vec<usize> { g.ops[i].as_ref().map_or(vec![], |op| op.inputs.iter().map(|v| g.pos(v)).collect()) };
    for i in (0..n).rev() {
        match &g.ops[i] {
            Some(op) if matches!(op.kind, OpKind::Const(_)) && !g.target[i] => {
                inline[i] = g.consumers[i].iter().all(|&c| fuses_inputs(&g.ops[c]));
                if inline[i] {
                    for &c in &g.consumers[i] {
                        reads[root[c]].remove(&i);
                    }
                }
            }
            Some(op) if op.is_elementwise() && !g.target[i] => {
                let all_fuse = !g.consumers[i].is_empty() && g.consumers[i].iter().all(|&c| fuses_inputs(&g.ops[c]));
                let r = g.consumers[i].first().map(|&c| root[c]);
                let one_kernel = g.consumers[i].iter().all(|&c| Some(root[c]) == r);
                if all_fuse && one_kernel && !read_broadcast(i) {
                    let r = r.expect("has consumers");
                    let inputs = inputs_of(i);
                    let added = inputs.iter().filter(|&&p| !reads[r].contains(&p)).collect::<HashSet<_>>().len();
                    if reads[r].len() - reads[r].contains(&i) as usize + added <= max_inputs {
                        reads[r].remove(&i);
                        reads[r].extend(inputs);
                        inline[i] = true;
                        root[i] = r;
                    }
                }
            }
            _ => {}
        }
        if !inline[i] {
            reads[i].extend(inputs_of(i));
        }
    }
    inline
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::primitive::{BinaryOp, ReduceOp, UnaryOp};
    use crate::schedule::collect::collect;
    use crate::schedule::testing::*;

    #[test]
    fn a_chain_is_inlined_but_its_end_and_inputs_are_not() {
        let x = input(&[8]);
        let a = unary(&x, UnaryOp::Exp);
        let b = unary(&a, UnaryOp::Neg);
        let g = collect(&[&b]);
        let inl = inline_decisions(&g, usize::MAX);
        assert!(inl[g.pos(&a)]);
        assert!(!inl[g.pos(&b)], "a target keeps its buffer");
        assert!(!inl[g.pos(&x)], "a realized input is read, not inlined");
    }

    #[test]
    fn a_node_read_by_two_kernels_gets_a_buffer() {
        let x = input(&[8]);
        let a = unary(&x, UnaryOp::Exp);
        let s = reduce(&a, ReduceOp::Sum, &[0]);
        let m = reduce(&a, ReduceOp::Max, &[0]);
        let g = collect(&[&s, &m]);
        assert!(!inline_decisions(&g, usize::MAX)[g.pos(&a)]);
    }

    #[test]
    fn a_diamond_inside_one_kernel_is_inlined() {
        let x = input(&[8]);
        let a = unary(&x, UnaryOp::Exp);
        let y = binary(&unary(&a, UnaryOp::Neg), &unary(&a, UnaryOp::Sqrt), BinaryOp::Add);
        let g = collect(&[&y]);
        assert!(inline_decisions(&g, usize::MAX)[g.pos(&a)], "both readers are in y's kernel");
    }

    #[test]
    fn a_node_read_through_a_broadcast_gets_a_buffer_but_a_constant_does_not() {
        let x = input(&[4, 1]);
        let a = unary(&x, UnaryOp::Exp);
        let wide = broadcast(&a, &[4, 16]);
        let c = constant(2.0);
        let y = binary(&wide, &broadcast(&c, &[4, 16]), BinaryOp::Mul);
        let g = collect(&[&y]);
        let inl = inline_decisions(&g, usize::MAX);
        assert!(!inl[g.pos(&a)], "exp would run 16 times per element");
        assert!(inl[g.pos(&c)]);
    }

    #[test]
    fn a_matmul_operand_is_not_inlined() {
        let x = input(&[4, 4]);
        let a = unary(&x, UnaryOp::Exp);
        let y = matmul(&a, &x);
        let g = collect(&[&y]);
        assert!(!inline_decisions(&g, usize::MAX)[g.pos(&a)]);
    }

    #[test]
    fn no_kernel_reads_more_buffers_than_allowed() {
        // A sum of 40 inputs (an optimizer's count over its parameters).
        let xs: Vec<crate::graph::Value> = (0..40).map(|_| input(&[3])).collect();
        let mut acc = unary(&xs[0], UnaryOp::Neg);
        for x in &xs[1..] {
            acc = binary(&acc, x, BinaryOp::Add);
        }
        for max in [3, 5, 8, 28] {
            let caps = crate::backend::Capabilities { max_inputs: max, ..cpu_caps() };
            let ks = crate::schedule::summarize(&[&acc], caps);
            assert!(ks.iter().all(|k| k.inputs <= max), "max {max}: {:?}", ks.iter().map(|k| k.inputs).collect::<Vec<_>>());
            assert!(ks.len() <= 40_usize.div_ceil(max - 1) + 1, "max {max}: {} kernels, fusion still groups the chain", ks.len());
        }
        let ks = crate::schedule::summarize(&[&acc], cpu_caps());
        assert_eq!((ks.len(), ks[0].inputs), (1, 40), "no limit: one kernel");
    }
}
