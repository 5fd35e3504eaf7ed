//! The fused elementwise interpreter.
//!
//! A fused [`Expr`] runs over blocks of `BLOCK` elements: each instruction is
//! one tight loop over a block that stays in L1, monomorphised per op and
//! dtype so the compiler vectorises it. Intermediates never touch memory
//! beyond the block, and blocks run in parallel on rayon.

use super::simd::simd_fn;
use crate::dtype::DType;
use crate::ir::{Expr, Instr, Load};
use crate::layout::{unravel, Layout};
use crate::primitive::{binary_table, unary_table, BinaryKernel, BinaryOp, CmpOp, MapOp, UnaryKernel, UnaryOp};
use crate::storage::{map_storage, CpuStorage};
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements per block.
pub(crate) const BLOCK: usize = 1024;

/// One register: a block of values of one compute type.
#[derive(Default, Clone)]
pub(crate) enum Reg {
    #[default]
    Empty,
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    U32(Vec<u32>),
    Bool(Vec<bool>),
}

impl Reg {
    fn new(dt: DType) -> Reg {
        match dt.compute() {
            DType::F32 => Reg::F32(vec![0.0; BLOCK]),
            DType::F64 => Reg::F64(vec![0.0; BLOCK]),
            DType::I32 => Reg::I32(vec![0; BLOCK]),
            DType::U32 => Reg::U32(vec![0; BLOCK]),
            DType::Bool => Reg::Bool(vec![false; BLOCK]),
            _ => unreachable!(),
        }
    }
    fn fill(&mut self, c: f64, dt: DType) {
        match self {
            Reg::F32(v) => v.fill(c as f32),
            Reg::F64(v) => v.fill(c),
            Reg::I32(v) => v.fill(c as i32),
            Reg::U32(v) => v.fill(c as u32),
            Reg::Bool(v) => v.fill(c != 0.0),
            Reg::Empty => unreachable!("{dt}"),
        }
    }
}

/// An expression with registers assigned, ready to interpret block by block.
pub(crate) struct Interpreter<'a> {
    expr: &'a Expr,
    reg_of: Vec<usize>,
    reg_dtype: Vec<DType>,
    /// Constant instructions, filled once per register file.
    consts: Vec<(usize, f64, DType)>,
    /// The expression's loads, each with the dims it walks with one stride
    /// merged: a contiguous operand of a pooling window's iteration shape
    /// `[.., 2, 14, 2]` is then one run per block, not a run of 2 at a time.
    loads: Vec<Load>,
}

impl<'a> Interpreter<'a> {
    pub(crate) fn new(expr: &'a Expr) -> Interpreter<'a> {
        let n = expr.instrs.len();
        let mut last_use = vec![0usize; n];
        for (i, (ins, _)) in expr.instrs.iter().enumerate() {
            for &a in ins.operands() {
                last_use[a] = i;
            }
        }
        if n > 0 {
            last_use[n - 1] = usize::MAX;
        }
        let mut reg_of = vec![0; n];
        let mut reg_dtype: Vec<DType> = vec![];
        let mut free: Vec<usize> = vec![];
        let mut consts = vec![];
        for (i, (ins, dt)) in expr.instrs.iter().enumerate() {
            let cdt = dt.compute();
            let is_const = matches!(ins, Instr::Const(_));
            let r = match (is_const, free.iter().position(|&r| reg_dtype[r] == cdt)) {
                (false, Some(p)) => free.swap_remove(p),
                _ => {
                    reg_dtype.push(cdt);
                    reg_dtype.len() - 1
                }
            };
            reg_of[i] = r;
            if let Instr::Const(c) = ins {
                consts.push((r, expr.consts[*c], *dt));
            }
            for &a in ins.operands() {
                if last_use[a] == i && !matches!(expr.instrs[a].0, Instr::Const(_)) && !free.contains(&reg_of[a]) {
                    free.push(reg_of[a]);
                }
            }
        }
        let loads = expr
            .loads
            .iter()
            .map(|l| {
                let mut l = l.clone();
                let (_, merged) = Layout::coalesce(&[&l.path[0]], l.path[0].dims());
                l.path[0] = merged.into_iter().next().expect("one layout in, one out");
                l
            })
            .collect();
        Interpreter { expr, reg_of, reg_dtype, consts, loads }
    }

    /// A register file for one thread.
    pub(crate) fn regs(&self) -> Vec<Reg> {
        let mut regs: Vec<Reg> = self.reg_dtype.iter().map(|&d| Reg::new(d)).collect();
        for &(r, c, dt) in &self.consts {
            regs[r].fill(c, dt);
        }
        regs
    }

    /// Evaluate elements `start..start + n` (n <= BLOCK) of the kernel's
    /// iteration space; returns the register holding the result.
    pub(crate) fn eval(&self, regs: &mut [Reg], inputs: &[&CpuStorage], start: usize, n: usize, scratch: &mut Vec<usize>) -> usize {
        self.eval_with(regs, inputs, start, n, scratch, None)
    }

    /// [`Interpreter::eval`], with load `given.0` taking its `n` values
    /// from `given.1` instead of from an input.
    fn eval_with(&self, regs: &mut [Reg], inputs: &[&CpuStorage], start: usize, n: usize, scratch: &mut Vec<usize>, given: Option<(usize, &[f32])>) -> usize {
        for (i, (ins, dt)) in self.expr.instrs.iter().enumerate() {
            let r = self.reg_of[i];
            match ins {
                Instr::Const(_) => {}
                Instr::Load(l) if given.is_some_and(|(g, _)| g == *l) => match (&mut regs[r], given) {
                    (Reg::F32(d), Some((_, v))) => d[..n].copy_from_slice(&v[..n]),
                    _ => unreachable!("a given load is an f32 register"),
                },
                Instr::Load(l) => {
                    let load = &self.loads[*l];
                    load_block(load, inputs[load.input], start, n, &mut regs[r], scratch);
                }
                Instr::Map(op, args) => {
                    let mut o = std::mem::take(&mut regs[r]);
                    let reg = |k: usize| &regs[self.reg_of[args[k]]];
                    match op {
                        MapOp::Unary(u) => {
                            unary(*u, reg(0), &mut o, n);
                            round_half(&mut o, *dt, n);
                        }
                        MapOp::Binary(b) => {
                            binary(*b, reg(0), reg(1), &mut o, n);
                            round_half(&mut o, *dt, n);
                        }
                        MapOp::Cmp(c) => cmp(*c, reg(0), reg(1), &mut o, n),
                        MapOp::Where => select(reg(0), reg(1), reg(2), &mut o, n),
                        MapOp::Cast => cast(reg(0), &mut o, *dt, n),
                    }
                    regs[r] = o;
                }
            }
        }
        self.reg_of[self.expr.instrs.len() - 1]
    }
}

simd_fn! {
    /// Half types compute in f32 registers; round a result to its dtype so that a
    /// fused intermediate has the value it would have had if stored.
    fn round_half(r: &mut Reg, dt: DType, n: usize) {
        match (dt, r) {
            (DType::F16, Reg::F32(v)) => v[..n].iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
            (DType::BF16, Reg::F32(v)) => v[..n].iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
            _ => {}
        }
    }
}

/// Run a fused elementwise kernel over `dims`, producing `dtype`.
pub(crate) fn run(expr: &Expr, dims: &[usize], inputs: &[&CpuStorage], dtype: DType) -> CpuStorage {
    let numel: usize = dims.iter().product();
    let mut out = super::pool::take(dtype, numel);
    if numel == 0 {
        return out;
    }
    let prog = Interpreter::new(expr);
    // Big enough chunks to amortise task overhead, enough of them to balance.
    let chunk = (numel / (super::threads() * 4)).max(16 * BLOCK).div_ceil(BLOCK) * BLOCK;
    map_storage!(&mut out, v => {
        v.par_chunks_mut(chunk).enumerate().for_each(|(ci, dst)| {
            let mut regs = prog.regs();
            let mut scratch = Vec::new();
            let base = ci * chunk;
            for (bi, d) in dst.chunks_mut(BLOCK).enumerate() {
                let start = base + bi * BLOCK;
                let r = prog.eval(&mut regs, inputs, start, d.len(), &mut scratch);
                StoreElem::store(&regs[r], d);
            }
        })
    });
    out
}

/// The program of an epilogue that can run in place on an f32 result of
/// `numel` elements made block by block (see [`run_in_place`]): it reads
/// the result element for element and makes an f32 result of that shape.
/// `None` otherwise: the caller then runs it as a pass of its own.
pub(crate) fn in_place_program(e: &crate::ir::Epilogue, numel: usize, dtype: DType) -> Option<Interpreter<'_>> {
    let acc = &e.expr.loads[e.acc].path;
    let in_order = acc.len() == 1 && acc[0].offset() == 0 && acc[0].is_contiguous() && acc[0].numel() == numel;
    let fits = e.acc_dtype == DType::F32 && dtype == DType::F32 && e.shape.iter().product::<usize>() == numel;
    (in_order && fits).then(|| Interpreter::new(&e.expr))
}

/// Run `prog` over elements `start..start + block.len()` of its iteration
/// space in place: load `acc` reads `block` itself, and the results replace
/// it. A product's epilogue runs so on each batch's block while gemm's
/// output is still in cache, rather than as a pass over the whole product.
pub(crate) fn run_in_place(prog: &Interpreter, inputs: &[&CpuStorage], acc: usize, start: usize, block: &mut [f32]) {
    let mut regs = prog.regs();
    let mut scratch = Vec::new();
    for (bi, d) in block.chunks_mut(BLOCK).enumerate() {
        let r = prog.eval_with(&mut regs, inputs, start + bi * BLOCK, d.len(), &mut scratch, Some((acc, &*d)));
        StoreElem::store(&regs[r], d);
    }
}

/// Element types a reduction folds slices of.
pub(crate) trait FoldElem: Copy {
    /// Fold `x` into `init` with the primitive `K`, in independent lanes so
    /// that the loop vectorises, then fold the lanes.
    fn fold<K: BinaryKernel>(x: &[Self], init: Self) -> Self;
}
macro_rules! fold_elem {
    ($t:ty, $f:ident, $lanes:expr) => {
        impl FoldElem for $t {
            simd_fn! {
                fn fold<K: BinaryKernel>(x: &[$t], init: $t) -> $t {
                    let mut acc = [init; $lanes];
                    let mut chunks = x.chunks_exact($lanes);
                    for c in &mut chunks {
                        for l in 0..$lanes {
                            acc[l] = K::$f(acc[l], c[l]);
                        }
                    }
                    let mut r = init;
                    for a in acc {
                        r = K::$f(r, a);
                    }
                    for &v in chunks.remainder() {
                        r = K::$f(r, v);
                    }
                    r
                }
            }
        }
    };
}
fold_elem!(f32, f32, 16);
fold_elem!(f64, f64, 8);
fold_elem!(i32, i32, 16);
fold_elem!(u32, u32, 16);

/// Writing a register into an output slice of a storage type.
pub(crate) trait StoreElem: Sized {
    fn store(r: &Reg, dst: &mut [Self]);
}
macro_rules! store_elem {
    ($t:ty, $v:ident, |$x:ident| $conv:expr) => {
        impl StoreElem for $t {
            simd_fn! {
                fn store(r: &Reg, dst: &mut [$t]) {
                    match r {
                        Reg::$v(src) => {
                            for (d, &$x) in dst.iter_mut().zip(src.iter()) {
                                *d = $conv;
                            }
                        }
                        _ => unreachable!("register type matches the output dtype"),
                    }
                }
            }
        }
    };
}
store_elem!(f32, F32, |x| x);
store_elem!(f64, F64, |x| x);
store_elem!(i32, I32, |x| x);
store_elem!(u32, U32, |x| x);
store_elem!(bool, Bool, |x| x);
store_elem!(f16, F32, |x| f16::from_f32(x));
store_elem!(bf16, F32, |x| bf16::from_f32(x));

/// Walk `n` positions of a layout from linear position `start` of its shape
/// as runs along the innermost dim: `f(dst_start, len, src_offset, src_stride)`.
#[inline]
pub(crate) fn for_each_run(l: &Layout, start: usize, n: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let dims = l.dims();
    let r = dims.len();
    if r == 0 {
        if n > 0 {
            f(0, 1, l.offset, 0);
        }
        return;
    }
    let mut idx = [0usize; 16];
    let mut idxv;
    let idx: &mut [usize] = if r <= 16 {
        &mut idx[..r]
    } else {
        idxv = vec![0; r];
        &mut idxv
    };
    unravel(start, dims, idx);
    let mut off = l.offset_of(idx);
    let (inner, st) = (dims[r - 1], l.strides[r - 1]);
    let mut i = 0;
    while i < n {
        let run = (inner - idx[r - 1]).min(n - i);
        f(i, run, off, st);
        i += run;
        idx[r - 1] += run;
        off += run * st;
        if idx[r - 1] == inner {
            off -= inner * st;
            idx[r - 1] = 0;
            for k in (0..r - 1).rev() {
                idx[k] += 1;
                off += l.strides[k];
                if idx[k] < dims[k] {
                    break;
                }
                off -= dims[k] * l.strides[k];
                idx[k] = 0;
            }
        }
    }
}

/// Offsets `start..start + n` of layout `l`, in order, into `out`.
fn offsets_into(l: &Layout, start: usize, n: usize, out: &mut Vec<usize>) {
    out.clear();
    out.resize(n, 0);
    for_each_run(l, start, n, |d0, len, off, st| {
        for j in 0..len {
            out[d0 + j] = off + j * st;
        }
    });
}

/// The trailing dims of `l` to walk through a table of offsets, when its
/// innermost dim is too short for runs to pay (a pooling window's 2 taps):
/// as many as keep the table at most 256 entries, at least two. `None`
/// when runs are long enough, there is no second dim, or the rank passes
/// the 16 dims an index is kept in.
fn table_dims(l: &Layout) -> Option<usize> {
    let dims = l.dims();
    let r = dims.len();
    if !(2..=16).contains(&r) || dims[r - 1] >= 16 {
        return None;
    }
    let mut t = 0;
    let mut plane = 1;
    while t < r && plane * dims[r - 1 - t] <= 256 {
        plane *= dims[r - 1 - t];
        t += 1;
    }
    (t >= 2).then_some(t)
}

/// [`gather_into`] for one layout through a table of the offsets of its
/// last `t` dims (a plane): per element one table read, not one run.
#[inline]
fn gather_tabled<S: Copy, D: Copy>(src: &[S], l: &Layout, t: usize, start: usize, n: usize, dst: &mut [D], table: &mut Vec<usize>, conv: impl Fn(S) -> D) {
    let dims = l.dims();
    let r = dims.len();
    let inner = Layout { shape: crate::shape::Shape::new(&dims[r - t..]), strides: crate::shape::Dims::from_slice(&l.strides()[r - t..]), offset: 0 };
    let plane = inner.numel();
    offsets_into(&inner, 0, plane, table);
    let reach = table.iter().copied().max().unwrap_or(0);
    // The plane's own dims stay 0: `offset_of` then gives the plane's base.
    let mut idx = [0usize; 16];
    let mut i = 0;
    while i < n {
        let pos = start + i;
        let (pl, within) = (pos / plane, pos % plane);
        let len = (plane - within).min(n - i);
        unravel(pl, &dims[..r - t], &mut idx[..r - t]);
        let base = l.offset_of(&idx[..r]);
        // One bounds check per plane rather than per element, so the loop
        // below can run as vector gathers.
        let src = &src[base..=base + reach];
        for (d, &o) in dst[i..i + len].iter_mut().zip(&table[within..within + len]) {
            // SAFETY: every table entry is at most `reach`, and `src` holds `reach + 1` elements.
            *d = conv(unsafe { *src.get_unchecked(o) });
        }
        i += len;
    }
}

#[inline]
fn gather_into<S: Copy, D: Copy>(src: &[S], path: &[Layout], start: usize, n: usize, dst: &mut [D], scratch: &mut Vec<usize>, conv: impl Fn(S) -> D) {
    if path.len() == 1 {
        if let Some(t) = table_dims(&path[0]) {
            return gather_tabled(src, &path[0], t, start, n, dst, scratch, conv);
        }
        for_each_run(&path[0], start, n, |d0, len, off, st| {
            let dst = &mut dst[d0..d0 + len];
            if st == 1 {
                for (d, &s) in dst.iter_mut().zip(&src[off..off + len]) {
                    *d = conv(s);
                }
            } else if st == 0 {
                let v = conv(src[off]);
                dst.fill(v);
            } else {
                // One bounds check per run, so the loop can run as vector gathers.
                let src = &src[off..=off + (len - 1) * st];
                for (j, d) in dst.iter_mut().enumerate() {
                    // SAFETY: j < len, so j * st is within the slice just taken.
                    *d = conv(unsafe { *src.get_unchecked(j * st) });
                }
            }
        });
        return;
    }
    // Views that could not be composed: unravel through each step.
    offsets_into(&path[0], start, n, scratch);
    let mut idx = vec![0usize; 16];
    for p in scratch.iter_mut() {
        for l in &path[1..] {
            idx.resize(l.dims().len(), 0);
            unravel(*p, l.dims(), &mut idx);
            *p = l.offset_of(&idx);
        }
    }
    for (d, &p) in dst[..n].iter_mut().zip(scratch.iter()) {
        *d = conv(src[p]);
    }
}

simd_fn! {
    fn load_block(load: &Load, src: &CpuStorage, start: usize, n: usize, reg: &mut Reg, scratch: &mut Vec<usize>) {
        let p = &load.path;
        match (src, reg) {
            (CpuStorage::F32(s), Reg::F32(d)) => gather_into(s, p, start, n, d, scratch, |x| x),
            (CpuStorage::F16(s), Reg::F32(d)) => gather_into(s, p, start, n, d, scratch, |x| x.to_f32()),
            (CpuStorage::BF16(s), Reg::F32(d)) => gather_into(s, p, start, n, d, scratch, |x| x.to_f32()),
            (CpuStorage::F64(s), Reg::F64(d)) => gather_into(s, p, start, n, d, scratch, |x| x),
            (CpuStorage::I32(s), Reg::I32(d)) => gather_into(s, p, start, n, d, scratch, |x| x),
            (CpuStorage::U32(s), Reg::U32(d)) => gather_into(s, p, start, n, d, scratch, |x| x),
            (CpuStorage::Bool(s), Reg::Bool(d)) => gather_into(s, p, start, n, d, scratch, |x| x),
            _ => unreachable!("load register matches the buffer's compute type"),
        }
    }
}

/// `unary(op, ..)`: the op's kernel type, from the unary table.
macro_rules! unary_dispatch {
    ($( $(#[$m:meta])* $T:ident $method:ident $name:literal $dom:ident |$gx:tt, $gy:tt, $gg:ident| $grad:expr; { $($kernel:tt)* } )*) => {
        fn unary(op: UnaryOp, x: &Reg, o: &mut Reg, n: usize) {
            match op { $( UnaryOp::$T => unary_k::<crate::primitive::$T>(x, o, n), )* }
        }
    };
}
unary_table!(unary_dispatch);

#[inline(always)]
fn map1<T: Copy, U>(x: &[T], o: &mut [U], n: usize, f: impl Fn(T) -> U) {
    for (o, &x) in o[..n].iter_mut().zip(&x[..n]) {
        *o = f(x);
    }
}

simd_fn! {
    fn unary_k<K: UnaryKernel>(x: &Reg, o: &mut Reg, n: usize) {
        match (x, o) {
            (Reg::F32(x), Reg::F32(o)) => map1(x, o, n, K::f32),
            (Reg::F64(x), Reg::F64(o)) => map1(x, o, n, K::f64),
            (Reg::I32(x), Reg::I32(o)) => map1(x, o, n, K::i32),
            (Reg::U32(x), Reg::U32(o)) => map1(x, o, n, K::u32),
            (Reg::Bool(x), Reg::Bool(o)) => map1(x, o, n, K::bool),
            _ => unreachable!("dtypes are checked when the op is recorded"),
        }
    }
}

#[inline(always)]
fn map2<T: Copy, U>(a: &[T], b: &[T], o: &mut [U], n: usize, f: impl Fn(T, T) -> U) {
    for ((o, &a), &b) in o[..n].iter_mut().zip(&a[..n]).zip(&b[..n]) {
        *o = f(a, b);
    }
}

/// `binary(op, ..)` and `fold_f64(op, ..)`: the op's kernel type, from the binary table.
macro_rules! binary_dispatch {
    ($( $(#[$m:meta])* $T:ident $method:ident $name:literal $dom:ident |$ga:tt, $gb:tt, $gy:tt, $gg:ident| $grad:expr; { $($kernel:tt)* } )*) => {
        fn binary(op: BinaryOp, a: &Reg, b: &Reg, o: &mut Reg, n: usize) {
            match op { $( BinaryOp::$T => binary_k::<crate::primitive::$T>(a, b, o, n), )* }
        }
        /// Apply a binary primitive to two f64 values (reduction partials).
        pub(crate) fn fold_f64(op: BinaryOp, a: f64, b: f64) -> f64 {
            match op { $( BinaryOp::$T => <crate::primitive::$T as BinaryKernel>::f64(a, b), )* }
        }
        /// Apply a binary primitive to two i32 values.
        pub(crate) fn fold_i32(op: BinaryOp, a: i32, b: i32) -> i32 {
            match op { $( BinaryOp::$T => <crate::primitive::$T as BinaryKernel>::i32(a, b), )* }
        }
        /// Apply a binary primitive to two u32 values.
        pub(crate) fn fold_u32(op: BinaryOp, a: u32, b: u32) -> u32 {
            match op { $( BinaryOp::$T => <crate::primitive::$T as BinaryKernel>::u32(a, b), )* }
        }
        /// Fold a slice with a binary primitive, starting from `init`.
        pub(crate) fn fold_slice<T: FoldElem>(op: BinaryOp, x: &[T], init: T) -> T {
            match op { $( BinaryOp::$T => T::fold::<crate::primitive::$T>(x, init), )* }
        }
    };
}
binary_table!(binary_dispatch);

simd_fn! {
    fn binary_k<K: BinaryKernel>(a: &Reg, b: &Reg, o: &mut Reg, n: usize) {
        match (a, b, o) {
            (Reg::F32(a), Reg::F32(b), Reg::F32(o)) => map2(a, b, o, n, K::f32),
            (Reg::F64(a), Reg::F64(b), Reg::F64(o)) => map2(a, b, o, n, K::f64),
            (Reg::I32(a), Reg::I32(b), Reg::I32(o)) => map2(a, b, o, n, K::i32),
            (Reg::U32(a), Reg::U32(b), Reg::U32(o)) => map2(a, b, o, n, K::u32),
            (Reg::Bool(a), Reg::Bool(b), Reg::Bool(o)) => map2(a, b, o, n, K::bool),
            _ => unreachable!("dtypes are checked when the op is recorded"),
        }
    }
}

simd_fn! {
    fn cmp(op: CmpOp, a: &Reg, b: &Reg, o: &mut Reg, n: usize) {
        let Reg::Bool(o) = o else { unreachable!() };
        macro_rules! go {
            ($a:expr, $b:expr) => {
                match op {
                    CmpOp::Eq => map2($a, $b, o, n, |x, y| x == y),
                    CmpOp::Ne => map2($a, $b, o, n, |x, y| x != y),
                    CmpOp::Lt => map2($a, $b, o, n, |x, y| x < y),
                    CmpOp::Le => map2($a, $b, o, n, |x, y| x <= y),
                    CmpOp::Gt => map2($a, $b, o, n, |x, y| x > y),
                    CmpOp::Ge => map2($a, $b, o, n, |x, y| x >= y),
                }
            };
        }
        match (a, b) {
            (Reg::F32(a), Reg::F32(b)) => go!(a, b),
            (Reg::F64(a), Reg::F64(b)) => go!(a, b),
            (Reg::I32(a), Reg::I32(b)) => go!(a, b),
            (Reg::U32(a), Reg::U32(b)) => go!(a, b),
            (Reg::Bool(a), Reg::Bool(b)) => go!(a, b),
            _ => unreachable!("dtypes are checked when the op is recorded"),
        }
    }
}

simd_fn! {
    fn select(c: &Reg, a: &Reg, b: &Reg, o: &mut Reg, n: usize) {
        let Reg::Bool(c) = c else { unreachable!() };
        /// A blend of the values' bits by a mask made from the condition:
        /// written as `if c { a } else { b }`, LLVM selected the address and
        /// loaded one element at a time (a fifth of a KV-cache update's time).
        #[inline(always)]
        fn sel<T: bytemuck::Pod, U: Copy + std::ops::BitAnd<Output = U> + std::ops::BitOr<Output = U> + std::ops::Not<Output = U> + bytemuck::Pod>(c: &[bool], a: &[T], b: &[T], o: &mut [T], n: usize, mask: impl Fn(bool) -> U) {
            let (a, b): (&[U], &[U]) = (bytemuck::cast_slice(&a[..n]), bytemuck::cast_slice(&b[..n]));
            let o: &mut [U] = bytemuck::cast_slice_mut(&mut o[..n]);
            // Zipped slices: no bounds checks, so the loop vectorizes.
            for (((o, &c), &a), &b) in o.iter_mut().zip(&c[..n]).zip(a).zip(b) {
                let m = mask(c);
                *o = (a & m) | (b & !m);
            }
        }
        let m32 = |c: bool| 0u32.wrapping_sub(c as u32);
        let m64 = |c: bool| 0u64.wrapping_sub(c as u64);
        match (a, b, o) {
            (Reg::F32(a), Reg::F32(b), Reg::F32(o)) => sel(c, a, b, o, n, m32),
            (Reg::F64(a), Reg::F64(b), Reg::F64(o)) => sel(c, a, b, o, n, m64),
            (Reg::I32(a), Reg::I32(b), Reg::I32(o)) => sel(c, a, b, o, n, m32),
            (Reg::U32(a), Reg::U32(b), Reg::U32(o)) => sel(c, a, b, o, n, m32),
            (Reg::Bool(a), Reg::Bool(b), Reg::Bool(o)) => {
                for (((o, &c), &a), &b) in o[..n].iter_mut().zip(&c[..n]).zip(&a[..n]).zip(&b[..n]) {
                    *o = (c && a) || (!c && b);
                }
            }
            _ => unreachable!("dtypes are checked when the op is recorded"),
        }
    }
}

simd_fn! {
    fn cast(x: &Reg, o: &mut Reg, to: DType, n: usize) {
        macro_rules! from {
            ($x:expr, |$v:ident| $tof32:expr, $tof64:expr, $toi32:expr, $tou32:expr, $tobool:expr) => {
                match o {
                    Reg::F32(o) => match to {
                        DType::F16 => map1($x, o, n, |$v| f16::from_f32($tof32).to_f32()),
                        DType::BF16 => map1($x, o, n, |$v| bf16::from_f32($tof32).to_f32()),
                        _ => map1($x, o, n, |$v| $tof32),
                    },
                    Reg::F64(o) => map1($x, o, n, |$v| $tof64),
                    Reg::I32(o) => map1($x, o, n, |$v| $toi32),
                    Reg::U32(o) => map1($x, o, n, |$v| $tou32),
                    Reg::Bool(o) => map1($x, o, n, |$v| $tobool),
                    Reg::Empty => unreachable!(),
                }
            };
        }
        match x {
            Reg::F32(x) => from!(x, |v| v, v as f64, v as i32, v as u32, v != 0.0),
            Reg::F64(x) => from!(x, |v| v as f32, v, v as i32, v as u32, v != 0.0),
            Reg::I32(x) => from!(x, |v| v as f32, v as f64, v, v as u32, v != 0),
            Reg::U32(x) => from!(x, |v| v as f32, v as f64, v as i32, v, v != 0),
            Reg::Bool(x) => from!(x, |v| v as u8 as f32, v as u8 as f64, v as i32, v as u32, v),
            Reg::Empty => unreachable!(),
        }
    }
}
