//! Pass 5, epilogue fusion: elementwise work after a matmul runs in the
//! matmul's stores, and after an index kernel that makes its result in
//! blocks, on each block, where the executor asks for it.

use crate::ir::{Epilogue, KernelKind, Plan, Slot};
use crate::primitive::IndexOp;
use foldhash::HashSet;

/// Fold an elementwise kernel into the matmul whose product it reads, when
/// it is that product's only reader, reads it element for element, and
/// nobody keeps the product: bias adds and activations after a Linear then
/// run in the matmul's stores, and the product never touches memory.
///
/// Not when the matmul would then read more than `max_inputs` buffers, nor
/// when the epilogue reads more than one other tensor of the product's size.
/// With `index_epilogues`, the same for max pooling's gradient and fold
/// (a ReLU's mask after them).
pub(crate) fn fuse_epilogues(plan: &mut Plan, kept: &HashSet<Slot>, max_inputs: usize, index_epilogues: bool) {
    let kept_slot = |s: Slot| kept.contains(&s);
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
            let plain = m.dtype.is_float()
                && match &m.kind {
                    KernelKind::Matmul { epilogue: None, .. } => true,
                    KernelKind::Index { op: IndexOp::MaxPoolGrad { .. } | IndexOp::Fold { .. }, epilogue: None, .. } => index_epilogues,
                    _ => false,
                };
            let extra = plan.kernels[k].inputs.iter().filter(|&&s| s != slot && !m.inputs.contains(&s)).count();
            let fits = m.inputs.len() + extra <= max_inputs;
            // Tensors as large as the product, besides it: one (a residual)
            // rides along; more (a GELU's backward reads three) make every
            // stored element wait on several loads of its own, which a
            // tiled product cannot hide: on the H100 such a tensor-core
            // product took 400 us against 45 us without its epilogue, where
            // an elementwise kernel after it takes about 25 us.
            let full = plan.kernels[k].inputs.iter().filter(|&&s| s != slot && plan.slots[s].numel >= numel).count();
            (identity && only_load && readers == 1 && plain && fits && full <= 1 && !kept_slot(slot)).then_some((li, mi))
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
        if let KernelKind::Matmul { epilogue, .. } | KernelKind::Index { epilogue, .. } = &mut m.kind {
            *epilogue = Some(Epilogue { expr, shape, acc, acc_dtype: m.dtype });
        }
        m.ops.extend(e.ops);
        m.out = e.out;
        m.dtype = e.dtype;
        // At the elementwise kernel's place: every epilogue input exists by then.
        plan.kernels.insert(k - 1, m);
    }
}

#[cfg(test)]
mod tests {
    use crate::graph::Value;
    use crate::primitive::{BinaryOp, UnaryOp};
    use crate::schedule::testing::*;

    #[test]
    fn bias_and_activation_after_a_matmul_become_its_epilogue() {
        let (x, w, b) = (input(&[4, 8]), input(&[8, 3]), input(&[1, 3]));
        let y = unary(&binary(&matmul(&x, &w), &broadcast(&b, &[4, 3]), BinaryOp::Add), UnaryOp::Relu);
        let ks = kinds(&[&y], false);
        assert_eq!(ks, vec!["matmul"]);
    }

    #[test]
    fn a_mask_after_fold_is_its_epilogue_where_the_executor_asks() {
        // A ReLU's backward after the input gradient of a convolution.
        let (patches, y) = (input(&[2, 3, 3, 3, 5, 4]), input(&[2, 3, 5, 4]));
        let g = binary(&fold(&patches), &unary(&y, UnaryOp::Relu), BinaryOp::Mul);
        assert_eq!(kinds(&[&g], false), vec!["fold"]);
        let caps = crate::backend::Capabilities { index_epilogues: false, ..cpu_caps() };
        let ks: Vec<_> = crate::schedule::summarize(&[&g], caps).into_iter().map(|k| k.kind).collect();
        assert_eq!(ks, vec!["fold", "elementwise"]);
        // Read through a view (not element for element): apart.
        let f = fold(&patches);
        let t = Value { node: f.node.clone(), layout: f.layout.permute(&[0, 1, 3, 2]) };
        let g = binary(&t, &input(&[2, 3, 4, 5]), BinaryOp::Mul);
        assert_eq!(kinds(&[&g], false), vec!["fold", "elementwise"]);
    }

    #[test]
    fn a_kept_product_is_not_fused() {
        let (x, w) = (input(&[4, 8]), input(&[8, 3]));
        let p = matmul(&x, &w);
        let y = unary(&p, UnaryOp::Relu);
        assert_eq!(kinds(&[&y, &p], false), vec!["matmul", "elementwise"]);
    }

    #[test]
    fn a_product_read_through_a_transpose_is_not_fused() {
        let (x, w) = (input(&[4, 8]), input(&[8, 4]));
        let p = matmul(&x, &w);
        let y = unary(&transpose(&p), UnaryOp::Relu);
        assert_eq!(kinds(&[&y], false), vec!["matmul", "elementwise"]);
    }

    #[test]
    fn an_epilogue_that_would_bind_too_many_buffers_stays_apart() {
        let (x, w) = (input(&[4, 8]), input(&[8, 3]));
        let bs: Vec<_> = (0..4).map(|_| input(&[1, 3])).collect();
        let mut y = matmul(&x, &w);
        for b in &bs {
            y = binary(&y, &broadcast(b, &[4, 3]), BinaryOp::Add);
        }
        let caps = crate::backend::Capabilities { max_inputs: 4, ..cpu_caps() };
        let ks = crate::schedule::summarize(&[&y], caps);
        assert!(ks.iter().all(|k| k.inputs <= 4), "{ks:?}");
        assert_eq!(crate::schedule::summarize(&[&y], cpu_caps()).len(), 1, "without a limit it is one kernel");
    }

    #[test]
    fn one_tensor_of_the_products_size_rides_in_the_epilogue_but_not_two() {
        let (x, w, b) = (input(&[4, 8]), input(&[8, 3]), input(&[1, 3]));
        let (r1, r2) = (input(&[4, 3]), input(&[4, 3]));
        let p = || binary(&matmul(&x, &w), &broadcast(&b, &[4, 3]), BinaryOp::Add);
        // A residual: one kernel (the intermediate is dropped before scheduling).
        let y1 = binary(&p(), &r1, BinaryOp::Add);
        assert_eq!(kinds(&[&y1], false), vec!["matmul"]);
        // Two more full-size reads (a GELU's backward reads three): apart.
        let y = binary(&binary(&p(), &r1, BinaryOp::Mul), &r2, BinaryOp::Add);
        assert_eq!(kinds(&[&y], false), vec!["matmul", "elementwise"]);
    }
}
