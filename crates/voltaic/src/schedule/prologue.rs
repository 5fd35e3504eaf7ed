//! Pass 7, prologue fusion (for executors that ask for it,
//! `Capabilities::prologue_rows`): row-wise or elementwise work whose
//! result only a quantized GEMV reads is computed in the GEMV's loads, and
//! elementwise work whose result an attention kernel reads as its queries
//! (a decoder's RoPE), keys or values (a KV cache with the new token
//! written in) in that kernel's loads.
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
        } else if matches!(plan.kernels[k].kind, KernelKind::Index { op: IndexOp::Attention { .. }, .. }) {
            k = fuse_attention(plan, k, kept, max_inputs) + 1;
        } else {
            k += 1;
        }
    }
}

/// Query rows up to which each key and value element is recomputed in an
/// attention kernel's loads (a decode step of a grouped-query model: one
/// token times the query heads of a key head). A prompt's dozens of rows
/// would each redo the work.
const MAX_KEY_READERS: usize = 8;

/// The attention kernel at `ai` computing its operands in their loads:
/// each of its queries, keys and values that an elementwise kernel makes
/// becomes a prologue (see [`attention_producer`]). Returns where the
/// attention kernel is afterwards.
fn fuse_attention(plan: &mut Plan, mut ai: usize, kept: &HashSet<Slot>, max_inputs: usize) -> usize {
    for arg in 0..3 {
        if let Some((pi, stays)) = attention_producer(plan, ai, arg, kept, max_inputs) {
            fuse_attention_arg(plan, pi, ai, arg, stays);
            ai -= usize::from(!stays);
        }
    }
    ai
}

/// The index of the elementwise kernel whose result the attention kernel at
/// `ai` could compute in the loads of its operand `arg` (queries, keys or
/// values; f32, read by no other operand), and whether that kernel must
/// stay. The queries' kernel goes, so it may be neither kept nor read
/// elsewhere (a decoder's RoPE of the queries). The keys' and values' may
/// be both (a KV cache's write of the new token, which the caller keeps):
/// computed again in the attention's loads, they no longer hold the
/// attention back, and the write can join other layers' writes at the end
/// of the plan (see `siblings`). Not for more than [`MAX_KEY_READERS`]
/// query rows, each of which would compute every key again.
fn attention_producer(plan: &Plan, ai: usize, arg: usize, kept: &HashSet<Slot>, max_inputs: usize) -> Option<(usize, bool)> {
    let ak = &plan.kernels[ai];
    let KernelKind::Index { op: IndexOp::Attention { .. }, args, prologues, .. } = &ak.kind else { return None };
    let with_prologue = |j: usize| prologues.get(j).is_some_and(Option::is_some);
    if with_prologue(arg) {
        return None;
    }
    let slot = ak.inputs[args[arg].input];
    // Read by another operand, or by an earlier prologue's loads (queries
    // computed from the keys), the buffer stays.
    let loaded = prologues.iter().flatten().any(|p| p.out.expr.loads.iter().any(|l| ak.inputs[l.input] == slot));
    if loaded || args.iter().enumerate().any(|(j, a)| j != arg && !with_prologue(j) && ak.inputs[a.input] == slot) {
        return None;
    }
    let elsewhere = kept.contains(&slot) || plan.kernels.iter().filter(|o| o.inputs.contains(&slot)).count() != 1;
    let qd = args[0].layout.dims();
    let rows = qd.get(qd.len().wrapping_sub(2)).copied().unwrap_or(1);
    if (arg == 0 && elsewhere) || (arg > 0 && rows > MAX_KEY_READERS) {
        return None;
    }
    let pi = plan.kernels[..ai].iter().position(|p| p.out == slot)?;
    let p = &plan.kernels[pi];
    if !matches!(p.kind, KernelKind::Elementwise { .. }) || !p.also.is_empty() || p.dtype != DType::F32 || p.inputs.is_empty() {
        return None;
    }
    fits(&ak.inputs, slot, &p.inputs, max_inputs).then_some((pi, elsewhere))
}

/// Compute operand `arg` of the attention kernel at `ai` in its loads with
/// the elementwise kernel `pi`'s expression; `pi` is moved into it, or
/// copied when it `stays`.
fn fuse_attention_arg(plan: &mut Plan, pi: usize, ai: usize, arg: usize, stays: bool) {
    let (p, ai) = if stays { (plan.kernels[pi].clone(), ai) } else { (plan.kernels.remove(pi), ai - 1) };
    let ak = &mut plan.kernels[ai];
    let KernelKind::Index { args, prologues, .. } = &mut ak.kind else { unreachable!("checked by `attention_producer`") };
    // The operand's buffer is no longer read (`attention_producer` checked
    // that nothing else in the kernel reads it): drop it and renumber the
    // later inputs, in the other operands and in earlier prologues' loads.
    let gone = args[arg].input;
    ak.inputs.remove(gone);
    for (j, a) in args.iter_mut().enumerate() {
        if j != arg && a.input > gone {
            a.input -= 1;
        }
    }
    for l in prologues.iter_mut().flatten().flat_map(|p| p.out.expr.loads.iter_mut()) {
        if l.input > gone {
            l.input -= 1;
        }
    }
    let KernelKind::Elementwise { mut expr, shape } = p.kind else { unreachable!("checked by `attention_producer`") };
    for l in expr.loads.iter_mut() {
        l.input = input_of(&mut ak.inputs, p.inputs[l.input]);
    }
    // Not read when the prologue computes the operand; kept a valid index.
    args[arg].input = expr.loads[0].input;
    prologues.resize(args.len(), None);
    prologues[arg] = Some(Prologue { stages: vec![], out: RowStage { op: None, expr, shape, from: vec![], dtype: p.dtype } });
    if !stays {
        let mut ops = p.ops;
        ops.append(&mut ak.ops);
        ak.ops = ops;
    }
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

    /// One layer of a decode step over a KV cache: the key and value
    /// caches `[b, n, d]` with the new token's `[b, 1, d]` written where
    /// `at` `[n]` holds (broadcast, as a decoder writes them), and the
    /// attention of `rows` query rows over them. Returns the attention and
    /// both written caches.
    fn cache_layer(rows: usize, d: usize) -> [crate::graph::Value; 3] {
        let (b, n) = (2, 16);
        let (q, at, mask) = (input(&[b, rows, d]), input(&[1, n, 1]), input(&[rows, n]));
        let write = |cache: &crate::graph::Value| {
            let new = input(&[b, 1, d]);
            let keep = broadcast(&at, &[b, n, d]);
            crate::graph::Value { node: crate::graph::Node::pending(crate::graph::Op { kind: crate::graph::OpKind::Map(crate::primitive::MapOp::Where), inputs: vec![keep, broadcast(&new, &[b, n, d]), cache.clone()] }, crate::dtype::DType::F32, crate::device::Device::Cpu, vec![b, n, d]), layout: crate::layout::Layout::contiguous(&[b, n, d]) }
        };
        let (k, v) = (write(&input(&[b, n, d])), write(&input(&[b, n, d])));
        [attention(&q, &k, &v, &mask), k, v]
    }

    /// The attention prologues of the kernels `ks` (queries, keys, values).
    fn attention_prologues(ks: &[crate::ir::Kernel]) -> Vec<bool> {
        ks.iter()
            .find_map(|k| match &k.kind {
                KernelKind::Index { prologues, .. } => Some((0..3).map(|i| prologues.get(i).is_some_and(Option::is_some)).collect()),
                _ => None,
            })
            .expect("an attention kernel")
    }

    /// A decode step's cache writes, which the caller keeps, are computed
    /// in the attention's loads as well: the attention no longer waits for
    /// them, and they stay kernels of their own. A prompt's many query
    /// rows would each compute every key, so there the attention reads
    /// the written cache.
    #[test]
    fn kept_cache_writes_run_in_the_attention_loads_too_for_a_few_rows() {
        let [a, k, v] = cache_layer(3, 8);
        let ks = plan(&[&a, &k, &v], 8);
        assert_eq!(attention_prologues(&ks), [false, true, true]);
        let att = ks.iter().find(|k| k.kind.name() == "attention").unwrap();
        let written: Vec<_> = ks.iter().filter(|k| k.kind.name() != "attention").flat_map(|k| k.outputs()).collect();
        assert!(written.iter().all(|s| !att.inputs.contains(s)), "the attention reads none of the written caches");
        assert_eq!(written.len(), 2, "both caches are still written");
        // Written caches only the attention reads move into it.
        let [a, _, _] = cache_layer(3, 8);
        assert_eq!(plan(&[&a], 8).iter().map(|k| k.kind.name()).collect::<Vec<_>>(), ["attention"]);
        // Not for many query rows, nor without the capability.
        let [a, k, v] = cache_layer(super::MAX_KEY_READERS + 1, 8);
        assert_eq!(attention_prologues(&plan(&[&a, &k, &v], 8)), [false, false, false]);
        let [a, k, v] = cache_layer(3, 8);
        assert_eq!(attention_prologues(&plan(&[&a, &k, &v], 0)), [false, false, false]);
    }

    /// Keys that the queries' prologue reads (queries computed from the
    /// keys) stay a kernel and a buffer: the keys' producer would otherwise
    /// move into the attention, and the queries' loads read a buffer that
    /// nothing writes.
    #[test]
    fn keys_the_query_prologue_reads_stay_a_buffer() {
        let (b, m, n, d) = (2, 3, 16, 8);
        // (The intermediate values are dropped: a value still held is kept.)
        let a = {
            let k = unary(&unary(&input(&[b, n, d]), UnaryOp::Neg), UnaryOp::Sqrt);
            let first = crate::graph::Value { node: k.node.clone(), layout: k.layout.slice(1, 0, m, 1) };
            attention(&unary(&first, UnaryOp::Exp), &k, &input(&[b, n, d]), &input(&[m, n]))
        };
        let ks = plan(&[&a], 8);
        assert_eq!(attention_prologues(&ks), [true, false, false]);
        let att = ks.iter().find(|k| k.kind.name() == "attention").expect("an attention kernel");
        let KernelKind::Index { prologues, args, .. } = &att.kind else { unreachable!() };
        let k_slot = ks.iter().find(|k| k.ops.contains(&"sqrt")).expect("the keys are a kernel").out;
        let q_reads: Vec<_> = prologues[0].as_ref().unwrap().out.expr.loads.iter().map(|l| att.inputs[l.input]).collect();
        assert_eq!((q_reads, att.inputs[args[1].input]), (vec![k_slot], k_slot));
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
