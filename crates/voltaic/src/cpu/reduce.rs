//! Reductions with a fused elementwise prologue.
//!
//! The scheduler orders the iteration space as kept dims then reduced dims,
//! so output `g` reduces the contiguous run `g*inner .. (g+1)*inner` of it.
//! The work is split into ranges of that space across threads; each block of
//! the prologue is folded segment by segment into per-output accumulators,
//! which are combined in order (so argmax keeps the first maximum).

use super::elementwise::{Program, Reg, BLOCK};
use crate::dtype::DType;
use crate::graph::kernel::Expr;
use crate::op::ReduceOp;
use crate::storage::CpuStorage;
use rayon::prelude::*;

/// A running reduction value. Sums and products accumulate in f64; integer
/// sums and products also in `i`, wrapping, which is the result for integer
/// dtypes (for arg reductions `i` is the index).
#[derive(Clone, Copy, Debug)]
struct Acc {
    v: f64,
    i: i64,
    has: bool,
}

impl Acc {
    fn init(op: ReduceOp) -> Acc {
        let (v, i) = match op {
            ReduceOp::Prod => (1.0, 1),
            ReduceOp::Sum => (0.0, 0),
            _ => (0.0, -1),
        };
        Acc { v, i, has: false }
    }

    /// Fold a later partial into this one.
    #[inline]
    fn combine(&mut self, op: ReduceOp, p: Acc) {
        if !p.has {
            return;
        }
        if !self.has {
            *self = p;
            return;
        }
        match op {
            ReduceOp::Sum => {
                self.v += p.v;
                self.i = self.i.wrapping_add(p.i);
            }
            ReduceOp::Prod => {
                self.v *= p.v;
                self.i = self.i.wrapping_mul(p.i);
            }
            ReduceOp::Max | ReduceOp::ArgMax => {
                if !self.v.is_nan() && (p.v > self.v || p.v.is_nan()) {
                    *self = p;
                }
            }
            ReduceOp::Min | ReduceOp::ArgMin => {
                if !self.v.is_nan() && (p.v < self.v || p.v.is_nan()) {
                    *self = p;
                }
            }
        }
    }
}

/// Reduce values `x` (positions `base..` within their group) to one partial.
trait Partial: Copy {
    fn partial(op: ReduceOp, x: &[Self], base: usize) -> Acc;
}

#[inline(always)]
fn scan_arg<T: Copy + PartialOrd>(x: &[T], base: usize, max: bool, to: impl Fn(T) -> f64) -> Acc {
    let mut best = to(x[0]);
    let mut bi = 0;
    if !best.is_nan() {
        for (j, &v) in x.iter().enumerate().skip(1) {
            let v = to(v);
            if v.is_nan() {
                best = v;
                bi = j;
                break;
            }
            if (max && v > best) || (!max && v < best) {
                best = v;
                bi = j;
            }
        }
    }
    Acc { v: best, i: (base + bi) as i64, has: true }
}

macro_rules! float_partial {
    ($t:ty, $lanes:expr) => {
        impl Partial for $t {
            #[inline]
            fn partial(op: ReduceOp, x: &[$t], base: usize) -> Acc {
                let v = match op {
                    ReduceOp::Sum => {
                        let mut acc = [0 as $t; $lanes];
                        let mut chunks = x.chunks_exact($lanes);
                        for c in &mut chunks {
                            for l in 0..$lanes {
                                acc[l] += c[l];
                            }
                        }
                        let mut s: f64 = chunks.remainder().iter().map(|&v| v as f64).sum();
                        for a in acc {
                            s += a as f64;
                        }
                        s
                    }
                    ReduceOp::Prod => x.iter().map(|&v| v as f64).product(),
                    ReduceOp::Max | ReduceOp::Min => {
                        // Lane-wise extremes and a NaN flag, so the loop vectorises.
                        let mut m = [x[0]; $lanes];
                        let mut nan = [false; $lanes];
                        let mut chunks = x.chunks_exact($lanes);
                        if op == ReduceOp::Max {
                            for c in &mut chunks {
                                for l in 0..$lanes {
                                    nan[l] |= c[l] != c[l];
                                    m[l] = if c[l] > m[l] { c[l] } else { m[l] };
                                }
                            }
                        } else {
                            for c in &mut chunks {
                                for l in 0..$lanes {
                                    nan[l] |= c[l] != c[l];
                                    m[l] = if c[l] < m[l] { c[l] } else { m[l] };
                                }
                            }
                        }
                        let max = op == ReduceOp::Max;
                        let mut best = m[0];
                        let mut any_nan = nan.iter().any(|&b| b);
                        for &v in m.iter().chain(chunks.remainder()) {
                            any_nan |= v != v;
                            best = if (max && v > best) || (!max && v < best) { v } else { best };
                        }
                        if any_nan {
                            f64::NAN
                        } else {
                            best as f64
                        }
                    }
                    ReduceOp::ArgMax => return scan_arg(x, base, true, |v| v as f64),
                    ReduceOp::ArgMin => return scan_arg(x, base, false, |v| v as f64),
                };
                Acc { v, i: -1, has: true }
            }
        }
    };
}
float_partial!(f32, 16);
float_partial!(f64, 8);

macro_rules! int_partial {
    ($t:ty, |$x:ident| $to:expr) => {
        impl Partial for $t {
            #[inline]
            fn partial(op: ReduceOp, x: &[$t], base: usize) -> Acc {
                let f = |$x: $t| -> f64 { $to };
                let v = match op {
                    ReduceOp::Sum => {
                        let i = x.iter().fold(0i64, |a, &v| a.wrapping_add(f(v) as i64));
                        return Acc { v: 0.0, i, has: true };
                    }
                    ReduceOp::Prod => {
                        let i = x.iter().fold(1i64, |a, &v| a.wrapping_mul(f(v) as i64));
                        return Acc { v: 0.0, i, has: true };
                    }
                    ReduceOp::Max => x.iter().map(|&v| f(v)).fold(f64::NEG_INFINITY, f64::max),
                    ReduceOp::Min => x.iter().map(|&v| f(v)).fold(f64::INFINITY, f64::min),
                    ReduceOp::ArgMax => return scan_arg(x, base, true, f),
                    ReduceOp::ArgMin => return scan_arg(x, base, false, f),
                };
                Acc { v, i: -1, has: true }
            }
        }
    };
}
int_partial!(i32, |v| v as f64);
int_partial!(u32, |v| v as f64);
int_partial!(bool, |v| v as u8 as f64);

fn partial(op: ReduceOp, r: &Reg, a: usize, b: usize, base: usize) -> Acc {
    match r {
        Reg::F32(x) => f32::partial(op, &x[a..b], base),
        Reg::F64(x) => f64::partial(op, &x[a..b], base),
        Reg::I32(x) => i32::partial(op, &x[a..b], base),
        Reg::U32(x) => u32::partial(op, &x[a..b], base),
        Reg::Bool(x) => bool::partial(op, &x[a..b], base),
        Reg::Empty => unreachable!(),
    }
}

fn partial_storage(op: ReduceOp, s: &CpuStorage, a: usize, b: usize, base: usize) -> Acc {
    match s {
        CpuStorage::F32(x) => f32::partial(op, &x[a..b], base),
        CpuStorage::F64(x) => f64::partial(op, &x[a..b], base),
        CpuStorage::I32(x) => i32::partial(op, &x[a..b], base),
        CpuStorage::U32(x) => u32::partial(op, &x[a..b], base),
        CpuStorage::Bool(x) => bool::partial(op, &x[a..b], base),
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
pub(crate) fn run(
    op: ReduceOp,
    expr: &Expr,
    dims: &[usize],
    outer: usize,
    inner: usize,
    inputs: &[&CpuStorage],
    dtype: DType,
) -> CpuStorage {
    let mut accs = vec![Acc::init(op); outer];
    if outer > 0 && inner > 0 {
        let prog = Program::new(expr);
        let direct = direct_source(expr, inputs);
        let total = outer * inner;
        let tasks = (crate::cpu::threads() * 4).min(total.div_ceil(BLOCK)).max(1);
        let per = total.div_ceil(tasks).div_ceil(BLOCK) * BLOCK;
        let parts: Vec<(usize, Vec<Acc>)> = (0..total.div_ceil(per))
            .into_par_iter()
            .map(|t| {
                let (s, e) = (t * per, ((t + 1) * per).min(total));
                let g0 = s / inner;
                let mut local = vec![Acc::init(op); (e - 1) / inner - g0 + 1];
                let mut regs = if direct.is_some() { vec![] } else { prog.regs() };
                let mut scratch = Vec::new();
                let mut pos = s;
                while pos < e {
                    let n = if direct.is_some() { 8 * BLOCK } else { BLOCK }.min(e - pos);
                    let r = match direct {
                        Some(_) => 0,
                        None => prog.eval(&mut regs, inputs, dims, pos, n, &mut scratch),
                    };
                    let mut a = 0;
                    while a < n {
                        let g = (pos + a) / inner;
                        let b = ((g + 1) * inner - pos).min(n);
                        let p = match direct {
                            Some((src, off)) => partial_storage(op, src, off + pos + a, off + pos + b, pos + a - g * inner),
                            None => partial(op, &regs[r], a, b, pos + a - g * inner),
                        };
                        local[g - g0].combine(op, p);
                        a = b;
                    }
                    pos += n;
                }
                (g0, local)
            })
            .collect();
        for (g0, local) in parts {
            for (j, p) in local.into_iter().enumerate() {
                accs[g0 + j].combine(op, p);
            }
        }
    }
    let int_acc = matches!(op, ReduceOp::Sum | ReduceOp::Prod) && matches!(dtype, DType::I32 | DType::U32);
    let vals: Vec<f64> = accs
        .iter()
        .map(|a| match () {
            _ if op.is_arg() => a.i.max(0) as f64,
            // Integer sums and products wrap (mod 2^32), as the elementwise integer ops do.
            _ if int_acc && dtype == DType::I32 => a.i as i32 as f64,
            _ if int_acc => a.i as u32 as f64,
            _ => a.v,
        })
        .collect();
    CpuStorage::from_f64(dtype, &vals)
}
