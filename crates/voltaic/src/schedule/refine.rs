//! Pass 4, refine layouts: make each kernel's loads as cheap to walk as
//! possible.
//!
//! An elementwise kernel whose load reshapes by splitting dims (pooling
//! windows) iterates over the finer shape, so every load is one strided
//! layout with no per-element index arithmetic. Then iteration dims that
//! every load walks with one stride are merged (a reduction's kept and
//! reduced dims never merge with each other).

use crate::ir::{Expr, KernelKind, Plan};
use crate::layout::Layout;

/// Refine every elementwise and reduction kernel of `plan`.
pub(crate) fn refine(plan: &mut Plan) {
    for k in plan.kernels.iter_mut() {
        match &mut k.kind {
            KernelKind::Elementwise { expr, shape } => {
                let (fine, e) = refine_expr(std::mem::take(expr), shape);
                let (s, e) = coalesce_expr(e, &fine, &[fine.len()]);
                *expr = e;
                *shape = s;
            }
            KernelKind::Reduce { expr, shape, outer, inner, .. } => {
                if *outer == 0 || *inner == 0 {
                    continue;
                }
                // Kept dims come first: the split is where their product reaches `outer`.
                let mut kept = 0;
                let mut prod = 1;
                while prod != *outer {
                    prod *= shape[kept];
                    kept += 1;
                }
                let (s, e) = coalesce_expr(std::mem::take(expr), shape, &[kept, shape.len() - kept]);
                *expr = e;
                *shape = s;
            }
            _ => {}
        }
    }
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

/// The finest shape whose dims split both `a` and `b` (same element count),
/// if one exists: the union of their suffix-product breakpoints must form a
/// divisibility chain. `[14, 14]` and `[7, 2, 7, 2]` give `[7, 2, 7, 2]`.
pub(crate) fn common_refinement(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
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
    Some(Layout { shape: crate::shape::Shape::new(fine), strides: strides.into(), offset: l.offset })
}

/// `expr` (whose loads' first layouts walk the kernel's shape) walking the
/// finer shape `fine` instead, if every load's layout splits that way.
pub(crate) fn split_expr(expr: &Expr, fine: &[usize]) -> Option<Expr> {
    let mut e = expr.clone();
    for l in e.loads.iter_mut() {
        l.path[0] = split_layout(&l.path[0], fine)?;
    }
    Some(e)
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
        expr.loads.iter().map(|l| Layout { shape: crate::shape::Shape::default(), strides: Default::default(), offset: l.path[0].offset }).collect();
    let mut start = 0;
    for &gsize in groups {
        let dims = &shape[start..start + gsize];
        let sub: Vec<Layout> = expr
            .loads
            .iter()
            .map(|l| Layout {
                shape: crate::shape::Shape::new(dims),
                strides: crate::shape::Dims::from_slice(&l.path[0].strides[start..start + gsize]),
                offset: 0,
            })
            .collect();
        let refs: Vec<&Layout> = sub.iter().collect();
        let (d, merged) = if gsize == 0 { (vec![], sub.clone()) } else { Layout::coalesce(&refs, dims) };
        // Keep a reduction's groups non-empty so `outer`/`inner` stay meaningful.
        new_shape.extend(&d);
        for (f, m) in new_firsts.iter_mut().zip(&merged) {
            f.shape.0.extend_from_slice(&d);
            f.strides.extend_from_slice(&m.strides);
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


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_refinement_splits_both_shapes() {
        assert_eq!(common_refinement(&[14, 14], &[7, 2, 7, 2]), Some(vec![7, 2, 7, 2]));
        assert_eq!(common_refinement(&[6, 4], &[4, 6]), None, "6*4 vs 4*6 do not nest");
        assert_eq!(common_refinement(&[2, 3], &[6]), Some(vec![2, 3]));
        assert_eq!(common_refinement(&[0, 3], &[3, 0]), None);
    }

    #[test]
    fn simplify_composes_views_and_drops_identities() {
        let inner = Layout::contiguous(&[4, 6]);
        let t = inner.permute(&[1, 0]);
        let mut path = vec![Layout::contiguous(&[6, 4]), t.clone()];
        simplify(&mut path);
        assert_eq!(path, vec![t], "an identity step before a view is dropped");
        // A narrow of a transpose composes into one strided layout.
        let mut path = vec![Layout::contiguous(&[6, 4]).slice(0, 1, 3, 1), Layout::contiguous(&[6, 4])];
        simplify(&mut path);
        assert_eq!(path.len(), 1);
        assert_eq!((path[0].offset(), path[0].strides()), (4, &[4usize, 1][..]));
    }

    #[test]
    fn coalesce_merges_dims_every_load_walks_with_one_stride() {
        use crate::dtype::DType;
        use crate::ir::{Instr, Load};
        let load = |l: Layout| Load { input: 0, dtype: DType::F32, path: vec![l] };
        let expr = Expr { instrs: vec![(Instr::Load(0), DType::F32)], loads: vec![load(Layout::contiguous(&[2, 3, 4]))], consts: vec![], const_nodes: vec![] };
        let (shape, e) = coalesce_expr(expr, &[2, 3, 4], &[3]);
        assert_eq!(shape, vec![24]);
        assert_eq!(e.loads[0].path[0].strides(), &[1]);
        // A transposed load keeps the dims it walks out of order.
        let t = Layout::contiguous(&[4, 6]).permute(&[1, 0]);
        let expr = Expr { instrs: vec![(Instr::Load(0), DType::F32)], loads: vec![load(t)], consts: vec![], const_nodes: vec![] };
        let (shape, _) = coalesce_expr(expr, &[6, 4], &[2]);
        assert_eq!(shape, vec![6, 4]);
    }

    #[test]
    fn refine_iterates_a_pooling_window_read_over_the_finer_shape() {
        use crate::dtype::DType;
        use crate::ir::{Instr, Load};
        // out[i] reads in[14 x 14] viewed as [7, 2, 7, 2] and narrowed to one tap per window.
        let split = Layout::contiguous(&[7, 2, 7, 2]).slice(1, 0, 1, 1).slice(3, 0, 1, 1).reshape(&[7, 1, 7, 1]).unwrap();
        let path = vec![Layout::contiguous(&[7, 7]).reshape(&[7, 1, 7, 1]).unwrap(), split, Layout::contiguous(&[14, 14])];
        let mut p = path.clone();
        simplify(&mut p);
        let expr = Expr { instrs: vec![(Instr::Load(0), DType::F32)], loads: vec![Load { input: 0, dtype: DType::F32, path: p }], consts: vec![], const_nodes: vec![] };
        let (shape, e) = refine_expr(expr, &[7, 7]);
        assert_eq!(e.loads[0].path.len(), 1, "one strided layout: {:?} over {shape:?}", e.loads[0].path);
    }
}
