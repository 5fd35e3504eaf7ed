//! Pass 7, prologue fusion (for executors that ask for it,
//! `Capabilities::prologue_rows`): row-wise or elementwise work whose
//! result only a quantized GEMV reads is computed in the GEMV's loads, and
//! elementwise work whose result only an attention kernel reads as its
//! queries (a decoder's RoPE) in that kernel's query loads.
//!
//! A language model's decode step multiplies one row by each weight: the
//! RMS norm before the attention and feed-forward projections and
//! SwiGLU's `silu(gate) * up` before the down projection would each be a
//! kernel of a few microseconds that writes one short row, which the next
//! kernel reads back. Each workgroup of the GEMV recomputes that row
//! instead (the row is a few kilobytes and stays in cache), and the
//! dispatch, its barrier and the write disappear.

use crate::dtype::DType;
use crate::ir::{KernelKind, Plan, Prologue, RowStage, Slot};
use crate::primitive::IndexOp;
use foldhash::HashSet;

/// Outputs up to which a product takes a prologue: about one wave of
/// GEMV workgroups on a large GPU, so the prologue's latency is paid once.
/// Measured on the H100: SmolLM2's output head (49,152 outputs) took
/// 77-97 us with the final norm as its prologue against 55 us plus 10 us
/// for the norm's own kernel; the projections (576-3,072 outputs) gained.
const MAX_OUTPUTS: usize = 4096;

/// Fold into each quantized product of at most `max_rows` rows and
/// [`MAX_OUTPUTS`] columns the kernel that computes its left operand, when
/// the product is that kernel's only reader, reads it whole and in order,
/// and nobody keeps it. Not when the product would then read more than
/// `max_inputs` buffers.
pub(crate) fn fuse_prologues(plan: &mut Plan, kept: &HashSet<Slot>, max_inputs: usize, max_rows: usize) {
    if max_rows == 0 {
        return;
    }
    let mut k = 0;
    while k < plan.kernels.len() {
        if let Some(p) = producer(plan, k, kept, max_inputs, max_rows) {
            fuse(plan, p, k);
            // The producer came before the product, which moved down by one.
        } else if let Some(p) = query_producer(plan, k, kept, max_inputs) {
            fuse_queries(plan, p, k);
        } else {
            k += 1;
        }
    }
}

/// The index of the elementwise kernel whose result the attention kernel
/// at `ai` could compute in its query loads: read by nothing else (not
/// even the kernel's keys, values or mask), kept by nobody, f32.
fn query_producer(plan: &Plan, ai: usize, kept: &HashSet<Slot>, max_inputs: usize) -> Option<usize> {
    let ak = &plan.kernels[ai];
    let KernelKind::Index { op: IndexOp::Attention { .. }, args, prologue: None } = &ak.kind else { return None };
    let slot = ak.inputs[args[0].input];
    if args[1..].iter().any(|a| ak.inputs[a.input] == slot) || kept.contains(&slot) {
        return None;
    }
    if plan.kernels.iter().filter(|o| o.inputs.contains(&slot)).count() != 1 {
        return None;
    }
    let pi = plan.kernels[..ai].iter().position(|p| p.out == slot)?;
    let p = &plan.kernels[pi];
    if !matches!(p.kind, KernelKind::Elementwise { .. }) || !p.also.is_empty() || p.dtype != DType::F32 || p.inputs.is_empty() {
        return None;
    }
    fits(&ak.inputs, slot, &p.inputs, max_inputs).then_some(pi)
}

/// Move the elementwise kernel `pi` into the attention kernel at `ai` as
/// the prologue of its queries.
fn fuse_queries(plan: &mut Plan, pi: usize, ai: usize) {
    let p = plan.kernels.remove(pi);
    let ak = &mut plan.kernels[ai - 1];
    let KernelKind::Index { args, prologue, .. } = &mut ak.kind else { unreachable!("checked by `query_producer`") };
    let gone = args[0].input;
    ak.inputs.remove(gone);
    for a in args.iter_mut().skip(1) {
        if a.input > gone {
            a.input -= 1;
        }
    }
    // Not read when the prologue computes the queries; kept a valid index.
    args[0].input = args[1].input;
    let KernelKind::Elementwise { mut expr, shape } = p.kind else { unreachable!("checked by `query_producer`") };
    for l in expr.loads.iter_mut() {
        l.input = input_of(&mut ak.inputs, p.inputs[l.input]);
    }
    *prologue = Some(Prologue { stages: vec![], out: RowStage { op: None, expr, shape, from: vec![], dtype: p.dtype } });
    let mut ops = p.ops;
    ops.append(&mut ak.ops);
    ak.ops = ops;
}

/// The index of the kernel whose result the product at `mi` could compute in its loads.
fn producer(plan: &Plan, mi: usize, kept: &HashSet<Slot>, max_inputs: usize, max_rows: usize) -> Option<usize> {
    let mk = &plan.kernels[mi];
    let KernelKind::Matmul { a, b, batch: 1, m, k, n, quant: Some(_), prologue: None, epilogue } = &mk.kind else { return None };
    let (m, k) = (*m, *k);
    if m > max_rows || *n > MAX_OUTPUTS || !a.layout.is_contiguous() || a.layout.offset != 0 || a.layout.numel() != m * k || a.input == b.input {
        return None;
    }
    let slot = mk.inputs[a.input];
    // Read by the product's operand only: not by its epilogue, nor by anyone else.
    let in_epilogue = epilogue.as_ref().is_some_and(|e| e.expr.loads.iter().enumerate().any(|(i, l)| i != e.acc && mk.inputs[l.input] == slot));
    let readers = plan.kernels.iter().filter(|o| o.inputs.contains(&slot)).count();
    if in_epilogue || readers != 1 || kept.contains(&slot) {
        return None;
    }
    let pi = plan.kernels[..mi].iter().position(|p| p.out == slot)?;
    let p = &plan.kernels[pi];
    let shaped = match &p.kind {
        KernelKind::Elementwise { .. } => true,
        KernelKind::Rows { outer, inner, .. } => *outer == m && *inner == k,
        _ => false,
    };
    if !shaped || !p.also.is_empty() || p.dtype != DType::F32 || p.numel != m * k || p.inputs.is_empty() {
        return None;
    }
    fits(&mk.inputs, slot, &p.inputs, max_inputs).then_some(pi)
}

/// The index of `slot` among a kernel's `inputs`, added if missing.
fn input_of(inputs: &mut Vec<Slot>, slot: Slot) -> usize {
    match inputs.iter().position(|&s| s == slot) {
        Some(i) => i,
        None => {
            inputs.push(slot);
            inputs.len() - 1
        }
    }
}

/// Whether a kernel reading `inputs`, with `slot` computed in its loads from
/// `producer`'s inputs instead, reads at most `max_inputs` buffers.
fn fits(inputs: &[Slot], slot: Slot, producer: &[Slot], max_inputs: usize) -> bool {
    let mut all: Vec<Slot> = inputs.iter().copied().filter(|&s| s != slot).collect();
    all.extend(producer.iter().copied());
    all.sort_unstable();
    all.dedup();
    all.len() <= max_inputs
}

/// Move kernel `pi` into the product at `mi` as its prologue.
fn fuse(plan: &mut Plan, pi: usize, mi: usize) {
    let p = plan.kernels.remove(pi);
    let mk = &mut plan.kernels[mi - 1];
    let KernelKind::Matmul { a, b, epilogue, prologue, .. } = &mut mk.kind else { unreachable!("checked by `producer`") };
    // The operand's buffer is gone: drop its input and renumber the later ones.
    let gone = a.input;
    mk.inputs.remove(gone);
    let shift = |i: &mut usize| {
        if *i > gone {
            *i -= 1;
        }
    };
    shift(&mut b.input);
    if let Some(e) = epilogue {
        for l in e.expr.loads.iter_mut() {
            shift(&mut l.input);
        }
    }
    // Not read when a prologue computes the operand; kept a valid index.
    a.input = b.input;
    let (mut stages, mut out) = match p.kind {
        KernelKind::Rows { stages, out, .. } => (stages, out),
        KernelKind::Elementwise { expr, shape } => (vec![], RowStage { op: None, expr, shape, from: vec![], dtype: p.dtype }),
        _ => unreachable!("checked by `producer`"),
    };
    // The prologue's loads read the product's inputs (stage values stay stage reads).
    for st in stages.iter_mut().chain([&mut out]) {
        for li in 0..st.expr.loads.len() {
            if st.reads_stage(li) {
                continue;
            }
            st.expr.loads[li].input = input_of(&mut mk.inputs, p.inputs[st.expr.loads[li].input]);
        }
    }
    *prologue = Some(Prologue { stages, out });
    let mut ops = p.ops;
    ops.append(&mut mk.ops);
    mk.ops = ops;
}

/// Whether `k` is a product with a prologue (for tests of other passes).
#[cfg(test)]
pub(crate) fn has_prologue(k: &crate::ir::Kernel) -> bool {
    matches!(&k.kind, KernelKind::Matmul { prologue: Some(_), .. })
}

#[cfg(test)]
mod tests {
    use super::{has_prologue, KernelKind};
    use crate::primitive::{BinaryOp, ReduceOp, UnaryOp};
    use crate::quant::GgmlType;
    use crate::schedule::testing::*;

    fn caps(prologue_rows: usize) -> crate::backend::Capabilities {
        caps_with(prologue_rows, 8)
    }

    fn caps_with(prologue_rows: usize, max_inputs: usize) -> crate::backend::Capabilities {
        crate::backend::Capabilities { row_kernels: true, multi_output: true, max_inputs, prologue_rows, ..cpu_caps() }
    }

    /// `x * w / sqrt(mean(x^2) + eps)` over the rows of `x` `[m, k]`.
    fn rms_norm(x: &crate::graph::Value, w: &crate::graph::Value) -> crate::graph::Value {
        let d = x.layout.dims().to_vec();
        let ms = reduce(&binary(x, x, BinaryOp::Mul), ReduceOp::Sum, &[1]);
        let r = unary(&binary(&ms, &constant_like(&ms, 1e-5), BinaryOp::Add), UnaryOp::Rsqrt);
        binary(&binary(x, &broadcast(&r, &d), BinaryOp::Mul), &broadcast(w, &d), BinaryOp::Mul)
    }

    fn plan(targets: &[&crate::graph::Value], rows: usize) -> Vec<crate::ir::Kernel> {
        plan_with(targets, caps(rows))
    }

    fn plan_with(targets: &[&crate::graph::Value], caps: crate::backend::Capabilities) -> Vec<crate::ir::Kernel> {
        crate::schedule::schedule_dag(&crate::schedule::collect::collect(targets), caps).0.plan.kernels.clone()
    }

    #[test]
    fn a_residual_read_by_the_epilogue_and_the_prologue_is_bound_once() {
        // x + W norm(x): the norm reads x, the residual add after the GEMV reads it too.
        let (x, g) = (input(&[1, 64]), input(&[1, 64]));
        let w = qweight(GgmlType::Q8_0, 64, 64);
        let y = binary(&qmatmul(&rms_norm(&x, &g), &w, GgmlType::Q8_0, 64), &x, BinaryOp::Add);
        let ks = plan(&[&y], 8);
        assert_eq!(ks.len(), 1);
        assert!(has_prologue(&ks[0]));
        assert_eq!(ks[0].inputs.len(), 3, "x once, the norm's weight, the quantized weight");
        // Past the binding limit the norm stays a kernel of its own.
        let ks = plan_with(&[&y], caps_with(8, 2));
        assert!(!ks.iter().any(has_prologue));
        assert!(ks.iter().all(|k| k.inputs.len() <= 2));
    }

    #[test]
    fn a_norm_before_a_quantized_gemv_runs_in_its_loads() {
        let (x, g) = (input(&[2, 64]), input(&[1, 64]));
        let w = qweight(GgmlType::Q8_0, 16, 64);
        let y = qmatmul(&rms_norm(&x, &broadcast(&g, &[2, 64])), &w, GgmlType::Q8_0, 16);
        let ks = plan(&[&y], 8);
        assert_eq!(ks.len(), 1, "{:?}", ks.iter().map(|k| k.kind.name()).collect::<Vec<_>>());
        assert!(has_prologue(&ks[0]));
        assert_eq!(ks[0].inputs.len(), 3, "x, the norm's weight and the quantized weight");
        // Without the capability, or above its rows: the rows kernel stays.
        assert_eq!(plan(&[&y], 0).len(), 2);
        assert_eq!(plan(&[&y], 1).len(), 2);
        // Nor before a product as wide as a language model's output head.
        let head = qweight(GgmlType::Q8_0, super::MAX_OUTPUTS + 1, 64);
        let y = qmatmul(&rms_norm(&x, &broadcast(&g, &[2, 64])), &head, GgmlType::Q8_0, super::MAX_OUTPUTS + 1);
        assert_eq!(plan(&[&y], 8).len(), 2);
    }

    /// The prologue of the product in `ks`, if one has one.
    fn prologue_of(ks: &[crate::ir::Kernel]) -> Option<crate::ir::Prologue> {
        ks.iter().find_map(|k| match &k.kind {
            KernelKind::Matmul { prologue, .. } => prologue.clone(),
            _ => None,
        })
    }

    /// An RMS norm's operand is its row's factor times the rest, so a GEMV
    /// can add up the norm's sum beside its products; a softmax reduces a
    /// maximum first, and a square of the factor's product is not linear
    /// in it, so neither factors.
    #[test]
    fn an_rms_norm_prologue_factors_and_a_softmax_does_not() {
        let (x, g) = (input(&[2, 64]), input(&[1, 64]));
        let w = qweight(GgmlType::Q8_0, 16, 64);
        let y = qmatmul(&rms_norm(&x, &broadcast(&g, &[2, 64])), &w, GgmlType::Q8_0, 16);
        let f = prologue_of(&plan(&[&y], 8)).and_then(|p| p.factored()).expect("the RMS norm factors");
        assert_eq!(f.reduced, [0]);
        // (The intermediate values are dropped: a value still held is kept.)
        let y = {
            let mx = reduce(&x, ReduceOp::Max, &[1]);
            let e = unary(&binary(&x, &broadcast(&mx, &[2, 64]), BinaryOp::Sub), UnaryOp::Exp);
            let sum = reduce(&e, ReduceOp::Sum, &[1]);
            qmatmul(&binary(&e, &broadcast(&sum, &[2, 64]), BinaryOp::Div), &w, GgmlType::Q8_0, 16)
        };
        let p = prologue_of(&plan(&[&y], 8)).expect("the softmax runs in the GEMV's loads");
        assert_eq!(p.factored(), None);
        // (x * r)^2, r per row: a product of the factor's product with
        // itself, not linear in it.
        let y = {
            let ms = reduce(&binary(&x, &x, BinaryOp::Mul), ReduceOp::Sum, &[1]);
            let xr = binary(&x, &broadcast(&unary(&ms, UnaryOp::Rsqrt), &[2, 64]), BinaryOp::Mul);
            qmatmul(&binary(&xr, &xr, BinaryOp::Mul), &w, GgmlType::Q8_0, 16)
        };
        let p = prologue_of(&plan(&[&y], 8)).expect("the sum runs in the GEMV's loads");
        assert_eq!(p.factored(), None);
    }

    #[test]
    fn elementwise_work_before_the_gemv_runs_in_its_loads_but_not_a_kept_or_shared_operand() {
        let (gate, up) = (input(&[1, 64]), input(&[1, 64]));
        let (w, w2) = (qweight(GgmlType::Q4_0, 8, 64), qweight(GgmlType::Q4_0, 8, 64));
        let h = || binary(&unary(&gate, UnaryOp::Exp), &up, BinaryOp::Mul);
        // (A value the caller still holds is kept, so each case builds its own.)
        let y = qmatmul(&h(), &w, GgmlType::Q4_0, 8);
        let ks = plan(&[&y], 8);
        assert_eq!(ks.len(), 1);
        assert!(has_prologue(&ks[0]));
        // Kept (an output of the realization too): computed once, in memory.
        let hk = h();
        let y = qmatmul(&hk, &w, GgmlType::Q4_0, 8);
        assert_eq!(plan(&[&y, &hk], 8).len(), 2);
        // Read by two products: each reads it from memory.
        let (y, y2) = {
            let hs = h();
            (qmatmul(&hs, &w, GgmlType::Q4_0, 8), qmatmul(&hs, &w2, GgmlType::Q4_0, 8))
        };
        let ks = plan(&[&y, &y2], 8);
        assert_eq!(ks.len(), 3);
        assert!(!ks.iter().any(has_prologue));
    }
}
