//! Pass 6, row fusion (for executors whose capabilities ask for it): a
//! reduction over rows and the elementwise work around it become one
//! `Rows` kernel that reads each row from memory once.

use crate::dtype::DType;
use crate::ir::{Expr, Kernel, KernelKind, Plan, RowStage, Slot};
use crate::layout::Layout;
use crate::primitive::ReduceOp;
use foldhash::{HashMap, HashSet};

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
pub(crate) fn fuse_rows(plan: &mut Plan, kept: &HashSet<Slot>, max_inputs: usize) {
    // Which kernel writes each slot; rebuilt only when a fusion moves kernels.
    let index = |plan: &Plan| -> HashMap<Slot, usize> { plan.kernels.iter().enumerate().map(|(i, k)| (k.out, i)).collect() };
    let mut writer = index(plan);
    let mut k = 0;
    while k < plan.kernels.len() {
        k = match fuse_rows_at(plan, k, kept, &writer, max_inputs) {
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
/// fused kernel's index. Not when it would read more than `max_inputs` buffers.
fn fuse_rows_at(plan: &mut Plan, k: usize, kept: &HashSet<Slot>, writer: &HashMap<Slot, usize>, max_inputs: usize) -> Option<usize> {
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
    if inputs.len() > max_inputs {
        return None;
    }
    let mut ops = vec![];
    for &m in &members {
        ops.extend(plan.kernels[m].ops.iter().copied());
    }
    let e = &plan.kernels[k];
    ops.extend(e.ops.iter().copied());
    let fused = Kernel { kind: KernelKind::Rows { outer, inner, stages, out }, inputs, out: e.out, also: vec![], dtype: e.dtype, numel: e.numel, ops };
    plan.kernels[k] = fused;
    for &m in members.iter().rev() {
        plan.kernels.remove(m);
    }
    Some(k - members.len())
}

#[cfg(test)]
mod tests {
    use crate::primitive::{BinaryOp, ReduceOp, UnaryOp};
    use crate::schedule::testing::*;

    /// softmax over the last dim of `x`, as the ops layer records it.
    fn softmax(x: &crate::graph::Value) -> crate::graph::Value {
        let d = x.layout.dims().to_vec();
        let m = broadcast(&reduce(x, ReduceOp::Max, &[1]), &d);
        let e = unary(&binary(x, &m, BinaryOp::Sub), UnaryOp::Exp);
        let s = broadcast(&reduce(&e, ReduceOp::Sum, &[1]), &d);
        let e2 = unary(&binary(x, &m, BinaryOp::Sub), UnaryOp::Exp);
        binary(&e2, &s, BinaryOp::Div)
    }

    #[test]
    fn softmax_is_one_rows_kernel_where_rows_are_asked_for() {
        let x = input(&[6, 40]);
        let y = softmax(&x);
        assert_eq!(kinds(&[&y], true), vec!["rows"]);
        assert_eq!(kinds(&[&y], false), vec!["reduce", "reduce", "elementwise"]);
    }

    #[test]
    fn a_kept_row_statistic_stays_its_own_kernel() {
        let x = input(&[6, 40]);
        let d = x.layout.dims().to_vec();
        let m = reduce(&x, ReduceOp::Max, &[1]);
        let y = binary(&x, &broadcast(&m, &d), BinaryOp::Sub);
        let ks = kinds(&[&y, &m], true);
        assert!(ks.contains(&"reduce"), "{ks:?}");
    }
}
