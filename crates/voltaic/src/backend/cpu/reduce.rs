//! Reductions with a fused elementwise prologue.
//!
//! The scheduler orders the iteration space as kept dims then reduced dims,
//! so output `g` reduces the contiguous run `g*inner .. (g+1)*inner` of it.
//! The work is split into ranges of that space across threads; each block of
//! the prologue is folded segment by segment into per-output accumulators,
//! which are combined in order (so argmax keeps the first maximum). Every
//! fold is the reduction's combining primitive from the op table.

use super::elementwise::{fold_f64, fold_i32, fold_slice, fold_u32, Interpreter, Reg, BLOCK};
use crate::dtype::DType;
use crate::ir::Expr;
use crate::primitive::{BinaryOp, ReduceOp};
use crate::storage::CpuStorage;
use rayon::prelude::*;

/// How a reduction folds: its op, combining primitive and accumulator type.
struct Fold {
    op: ReduceOp,
    bin: BinaryOp,
    /// Floats fold in f64 across blocks; integers in their own type (wrapping).
    int: Option<DType>,
    /// The identity in the values' compute type.
    identity: f64,
}

impl Fold {
    fn new(op: ReduceOp, value_dtype: DType) -> Fold {
        let int = matches!(value_dtype, DType::I32 | DType::U32).then_some(value_dtype);
        Fold { op, bin: op.combine(), int, identity: op.identity_for(value_dtype) }
    }

    /// Does a later value `v` replace the running winner `a` of an arg
    /// reduction? When folding them moves the result to `v`; ties keep the
    /// earlier index. NaN wins through the primitive (maximum and minimum
    /// propagate it), the first NaN kept.
    fn wins(&self, a: f64, v: f64) -> bool {
        let same = |x: f64, y: f64| x == y || (x.is_nan() && y.is_nan());
        !same(a, v) && same(fold_f64(self.bin, a, v), v)
    }
}

/// A running reduction value: `v` for floats (and for the value of an arg
/// reduction, whose index is `i`), `i` for integers.
#[derive(Clone, Copy, Debug)]
struct Acc {
    v: f64,
    i: i64,
    has: bool,
}

impl Acc {
    fn empty() -> Acc {
        Acc { v: 0.0, i: -1, has: false }
    }

    /// Fold a later partial into this one.
    #[inline]
    fn combine(&mut self, f: &Fold, p: Acc) {
        if !p.has {
            return;
        }
        if !self.has {
            *self = p;
            return;
        }
        if f.op.is_arg() {
            if f.wins(self.v, p.v) {
                *self = p;
            }
            return;
        }
        match f.int {
            None => self.v = fold_f64(f.bin, self.v, p.v),
            Some(DType::I32) => self.i = fold_i32(f.bin, self.i as i32, p.i as i32) as i64,
            Some(_) => self.i = fold_u32(f.bin, self.i as u32, p.i as u32) as i64,
        }
    }
}

/// The first winner of values `x` (positions `base..` within their group).
fn scan_arg<T: Copy>(f: &Fold, x: &[T], base: usize, to: impl Fn(T) -> f64) -> Acc {
    let mut best = to(x[0]);
    let mut bi = 0;
    for (j, &v) in x.iter().enumerate().skip(1) {
        let v = to(v);
        if f.wins(best, v) {
            best = v;
            bi = j;
        }
    }
    Acc { v: best, i: (base + bi) as i64, has: true }
}

/// Reduce values `x` (positions `base..` within their group) to one partial.
trait Partial: Copy {
    fn partial(f: &Fold, x: &[Self], base: usize) -> Acc;
}

macro_rules! float_partial {
    ($t:ty) => {
        impl Partial for $t {
            #[inline]
            fn partial(f: &Fold, x: &[$t], base: usize) -> Acc {
                if f.op.is_arg() {
                    return scan_arg(f, x, base, |v| v as f64);
                }
                Acc { v: fold_slice(f.bin, x, f.identity as $t) as f64, i: -1, has: true }
            }
        }
    };
}
float_partial!(f32);
float_partial!(f64);

macro_rules! int_partial {
    ($t:ty) => {
        impl Partial for $t {
            #[inline]
            fn partial(f: &Fold, x: &[$t], base: usize) -> Acc {
                if f.op.is_arg() {
                    return scan_arg(f, x, base, |v| v as f64);
                }
                Acc { v: 0.0, i: fold_slice(f.bin, x, f.identity as $t) as i64, has: true }
            }
        }
    };
}
int_partial!(i32);
int_partial!(u32);

impl Partial for bool {
    fn partial(f: &Fold, x: &[bool], base: usize) -> Acc {
        // Only arg reductions see bool (the others count bools as i32).
        scan_arg(f, x, base, |v| v as u8 as f64)
    }
}

fn partial(f: &Fold, r: &Reg, a: usize, b: usize, base: usize) -> Acc {
    match r {
        Reg::F32(x) => f32::partial(f, &x[a..b], base),
        Reg::F64(x) => f64::partial(f, &x[a..b], base),
        Reg::I32(x) => i32::partial(f, &x[a..b], base),
        Reg::U32(x) => u32::partial(f, &x[a..b], base),
        Reg::Bool(x) => bool::partial(f, &x[a..b], base),
        Reg::Empty => unreachable!(),
    }
}

fn partial_storage(f: &Fold, s: &CpuStorage, a: usize, b: usize, base: usize) -> Acc {
    match s {
        CpuStorage::F32(x) => f32::partial(f, &x[a..b], base),
        CpuStorage::F64(x) => f64::partial(f, &x[a..b], base),
        CpuStorage::I32(x) => i32::partial(f, &x[a..b], base),
        CpuStorage::U32(x) => u32::partial(f, &x[a..b], base),
        CpuStorage::Bool(x) => bool::partial(f, &x[a..b], base),
        _ => unreachable!("half types are never read directly"),
    }
}

/// When the prologue is a plain contiguous read of a buffer in its compute
/// type, reduce straight from the buffer: the buffer and its start offset.
fn direct_source<'a>(expr: &Expr, inputs: &[&'a CpuStorage]) -> Option<(&'a CpuStorage, usize)> {
    // A lone constant (a reduction of `full`) has no load to read from.
    if expr.instrs.len() != 1 || expr.loads.len() != 1 {
        return None;
    }
    let load = &expr.loads[0];
    let ok = load.path.len() == 1 && load.path[0].is_contiguous() && load.dtype == load.dtype.compute();
    ok.then(|| (inputs[load.input], load.path[0].offset))
}

/// Run a reduction kernel.
pub(crate) fn run(op: ReduceOp, expr: &Expr, outer: usize, inner: usize, inputs: &[&CpuStorage], dtype: DType) -> CpuStorage {
    let f = Fold::new(op, expr.dtype().compute());
    let mut accs = vec![Acc::empty(); outer];
    if outer > 0 && inner > 0 {
        let prog = Interpreter::new(expr);
        let direct = direct_source(expr, inputs);
        let total = outer * inner;
        let tasks = (super::threads() * 4).min(total.div_ceil(BLOCK)).max(1);
        let per = total.div_ceil(tasks).div_ceil(BLOCK) * BLOCK;
        let parts: Vec<(usize, Vec<Acc>)> = (0..total.div_ceil(per))
            .into_par_iter()
            .map(|t| {
                let (s, e) = (t * per, ((t + 1) * per).min(total));
                let g0 = s / inner;
                let mut local = vec![Acc::empty(); (e - 1) / inner - g0 + 1];
                let mut regs = if direct.is_some() { vec![] } else { prog.regs() };
                let mut scratch = Vec::new();
                let mut pos = s;
                while pos < e {
                    let n = if direct.is_some() { 8 * BLOCK } else { BLOCK }.min(e - pos);
                    let r = match direct {
                        Some(_) => 0,
                        None => prog.eval(&mut regs, inputs, pos, n, &mut scratch),
                    };
                    let mut a = 0;
                    while a < n {
                        let g = (pos + a) / inner;
                        let b = ((g + 1) * inner - pos).min(n);
                        let p = match direct {
                            Some((src, off)) => partial_storage(&f, src, off + pos + a, off + pos + b, pos + a - g * inner),
                            None => partial(&f, &regs[r], a, b, pos + a - g * inner),
                        };
                        local[g - g0].combine(&f, p);
                        a = b;
                    }
                    pos += n;
                }
                (g0, local)
            })
            .collect();
        for (g0, local) in parts {
            for (j, p) in local.into_iter().enumerate() {
                accs[g0 + j].combine(&f, p);
            }
        }
    }
    let vals: Vec<f64> = accs
        .iter()
        .map(|a| match () {
            _ if op.is_arg() => a.i.max(0) as f64,
            // An empty reduction gives the identity (only sum and prod allow one).
            _ if !a.has => f.identity,
            _ if f.int.is_some() => a.i as f64,
            _ => a.v,
        })
        .collect();
    CpuStorage::from_f64(dtype, &vals)
}
