//! The index-like kernels: gather, scatter_add, index_select, cumsum, cat,
//! unfold, fold, and max pooling with its gradient.

use super::{input, maxpool2x2};
use super::simd::simd_fn;
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::ir::Strided as View;
use crate::layout::{unravel, Layout};
use crate::primitive::{IndexOp, UnfoldParams};
use crate::storage::{map_storage, CpuStorage, StorageElem};
use half::{bf16, f16};

/// Run an index-like kernel over its operands.
pub(crate) fn run(op: &IndexOp, args: &[View], inputs: &[&CpuStorage], dtype: DType, numel: usize) -> Result<CpuStorage> {
    Ok(match *op {
        IndexOp::Gather { dim, caller } => gather(caller.name(), dim, &args[0], &args[1], inputs)?,
        IndexOp::ScatterAdd { dim, caller } => scatter_add(caller.name(), dim, &args[0], &args[1], &args[2], inputs)?,
        IndexOp::IndexSelect { dim, caller } => index_select(caller.name(), dim, &args[0], &args[1], inputs)?,
        IndexOp::Cumsum { dim } => cumsum(dim, &args[0], inputs),
        IndexOp::Cat { dim } => cat(dim, args, inputs, dtype, numel),
        IndexOp::Unfold { params, pad, by_tap } => unfold(&args[0], &params, pad, by_tap, inputs),
        IndexOp::Fold { params, hw } => fold(&args[0], &params, hw, inputs),
        IndexOp::MaxPool { params } => max_pool(&args[0], &params, inputs),
        IndexOp::MaxPoolGrad { params, .. } => max_pool_grad(&args[0], &args[1], &params, inputs),
        IndexOp::Dequantize { qtype, cols, caller } => super::quant::dequantize_rows(caller.name(), qtype, cols, &args[0], &args[1], inputs)?,
        IndexOp::Attention { scale } => attention(scale, args, inputs, dtype),
    })
}

/// `softmax(q @ k^T * scale + mask) @ v` row by row (see `IndexOp::Attention`),
/// in f32 as the GPU kernel computes it; a task per query row.
fn attention(scale: f64, args: &[View], inputs: &[&CpuStorage], dtype: DType) -> CpuStorage {
    let [q, k, v, mask] = args else { unreachable!("attention has four inputs") };
    let (qd, kd, vd) = (q.layout.dims(), k.layout.dims(), v.layout.dims());
    // Leading dims in row-major order, as the dense copies below hold them.
    let r = qd.len();
    let (b, m, d, n, e) = (qd[..r - 2].iter().product::<usize>(), qd[r - 2], qd[r - 1], kd[r - 2], vd[r - 1]);
    let (qv, kv, vv, mv) = (dense_f32(q, inputs), dense_f32(k, inputs), dense_f32(v, inputs), dense_f32(mask, inputs));
    let mut out = vec![0f32; b * m * e];
    use rayon::prelude::*;
    let row = |w: &mut Vec<f32>, (r, o): (usize, &mut [f32])| {
        let bi = r / m.max(1);
        w.resize(n, 0.0);
        attention_row(&qv[r * d..][..d], &kv[bi * n * d..][..n * d], &vv[bi * n * e..][..n * e], &mv[r * n..][..n], scale as f32, w, o);
    };
    // A decode step's few rows take microseconds, less than handing them
    // to the pool's other threads costs.
    if b * m * n * (d + e) < SERIAL_WORK {
        let mut w = Vec::new();
        out.chunks_mut(e.max(1)).enumerate().for_each(|x| row(&mut w, x));
    } else {
        out.par_chunks_mut(e.max(1)).enumerate().for_each_init(Vec::new, row);
    }
    match dtype {
        DType::F32 => CpuStorage::F32(out),
        _ => CpuStorage::from_f64(dtype, &out.iter().map(|&x| x as f64).collect::<Vec<_>>()),
    }
}

/// Multiply-adds below which attention runs on the calling thread.
const SERIAL_WORK: usize = 1 << 21;

simd_fn!(
    /// One query row against `n = w.len()` keys (`[n, d]`) and values
    /// (`[n, e]`): scores into `w`, their softmax, the weighted sum into `o`
    /// (zeroed by the caller). A row masked everywhere with -inf gives NaN,
    /// as PyTorch's does; one masked with f32::MIN averages the values.
    fn attention_row(row: &[f32], keys: &[f32], values: &[f32], mask: &[f32], scale: f32, w: &mut [f32], o: &mut [f32]) {
        let (d, e) = (row.len(), o.len());
        for (j, wj) in w.iter_mut().enumerate() {
            *wj = dot(row, &keys[j * d..][..d]) * scale + mask[j];
        }
        let max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Eight partial sums, so that the exponentials vectorize.
        let mut total = [0f32; 8];
        let mut chunks = w.chunks_exact_mut(8);
        for c in &mut chunks {
            for l in 0..8 {
                c[l] = crate::primitive::fastmath::exp_f32(c[l] - max);
                total[l] += c[l];
            }
        }
        for wj in chunks.into_remainder() {
            *wj = crate::primitive::fastmath::exp_f32(*wj - max);
            total[0] += *wj;
        }
        let inv = 1.0 / total.iter().sum::<f32>();
        for (j, &wj) in w.iter().enumerate() {
            let wj = wj * inv;
            for (x, &val) in o.iter_mut().zip(&values[j * e..][..e]) {
                *x += wj * val;
            }
        }
    }
);

/// An f32 dot product in eight lanes (so that it vectorizes).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The elements of a view in row-major order as f32: the buffer itself
/// where it is f32 and contiguous, else gathered.
fn dense_f32<'a>(x: &View, inputs: &[&'a CpuStorage]) -> std::borrow::Cow<'a, [f32]> {
    let s = input(x, inputs);
    let l = &x.layout;
    match s {
        CpuStorage::F32(v) if l.is_contiguous() => std::borrow::Cow::Borrowed(&v[l.offset()..][..l.numel()]),
        CpuStorage::F32(v) => std::borrow::Cow::Owned(l.gather(v)),
        _ => {
            let mut out = Vec::with_capacity(l.numel());
            l.for_each_offset(|o| out.push(s.get_f64(o) as f32));
            std::borrow::Cow::Owned(out)
        }
    }
}

/// Index values of an i32 or u32 tensor, in layout order.
fn indices(v: &View, inputs: &[&CpuStorage]) -> Vec<i64> {
    let s = input(v, inputs);
    let mut out = Vec::with_capacity(v.layout.numel());
    match s {
        CpuStorage::I32(x) => v.layout.for_each_offset(|o| out.push(x[o] as i64)),
        CpuStorage::U32(x) => v.layout.for_each_offset(|o| out.push(x[o] as i64)),
        _ => unreachable!("index dtype is checked when the op is recorded"),
    }
    out
}

fn check(op: &'static str, i: i64, size: usize, dim: usize) -> Result<usize> {
    if i < 0 || i as usize >= size {
        bail!(Index, op, "index {i} is out of range for dimension {dim} of size {size}");
    }
    Ok(i as usize)
}

fn typed<T: StorageElem>(s: &CpuStorage) -> &[T] {
    T::slice(s).expect("dtype matches")
}

/// `out[p] = input[p with p[dim] = index[p]]`, `out` shaped like `index`.
fn gather(op: &'static str, dim: usize, inp: &View, index: &View, inputs: &[&CpuStorage]) -> Result<CpuStorage> {
    let idx = indices(index, inputs);
    let src = input(inp, inputs);
    let dims = index.layout.dims();
    let size = inp.layout.dims()[dim];
    let mut pos = vec![0; dims.len()];
    let mut offs = Vec::with_capacity(idx.len());
    for (i, &ix) in idx.iter().enumerate() {
        unravel(i, dims, &mut pos);
        pos[dim] = check(op, ix, size, dim)?;
        offs.push(inp.layout.offset_of(&pos));
    }
    Ok(map_storage!(src, s => StorageElem::wrap(offs.iter().map(|&o| s[o]).collect())))
}

/// Rows of `input` along `dim` chosen by a 1-D index.
fn index_select(op: &'static str, dim: usize, inp: &View, index: &View, inputs: &[&CpuStorage]) -> Result<CpuStorage> {
    let idx = indices(index, inputs);
    let l = &inp.layout;
    let size = l.dims()[dim];
    for &i in &idx {
        check(op, i, size, dim)?;
    }
    let mut out_dims = l.dims().to_vec();
    out_dims[dim] = idx.len();
    let src = input(inp, inputs);
    let n: usize = out_dims.iter().product();
    let mut pos = vec![0; out_dims.len()];
    let offs: Vec<usize> = (0..n)
        .map(|i| {
            unravel(i, &out_dims, &mut pos);
            pos[dim] = idx[pos[dim]] as usize;
            l.offset_of(&pos)
        })
        .collect();
    Ok(map_storage!(src, s => StorageElem::wrap(offs.iter().map(|&o| s[o]).collect())))
}

/// Addition for every storage type (bool: or).
trait AddElem: Copy {
    fn add(self, o: Self) -> Self;
}
impl AddElem for f32 {
    #[inline]
    fn add(self, o: f32) -> f32 {
        self + o
    }
}
impl AddElem for f64 {
    #[inline]
    fn add(self, o: f64) -> f64 {
        self + o
    }
}
impl AddElem for i32 {
    #[inline]
    fn add(self, o: i32) -> i32 {
        self.wrapping_add(o)
    }
}
impl AddElem for u32 {
    #[inline]
    fn add(self, o: u32) -> u32 {
        self.wrapping_add(o)
    }
}
impl AddElem for bool {
    #[inline]
    fn add(self, o: bool) -> bool {
        self | o
    }
}
impl AddElem for f16 {
    #[inline]
    fn add(self, o: f16) -> f16 {
        f16::from_f32(self.to_f32() + o.to_f32())
    }
}
impl AddElem for bf16 {
    #[inline]
    fn add(self, o: bf16) -> bf16 {
        bf16::from_f32(self.to_f32() + o.to_f32())
    }
}

fn copy_out<T: Copy>(s: &[T], l: &Layout) -> Vec<T> {
    l.gather(s)
}

/// `out = input; out[p with p[dim] = index[p]] += src[p]` for every `p` of `index`.
fn scatter_add(op: &'static str, dim: usize, inp: &View, index: &View, src: &View, inputs: &[&CpuStorage]) -> Result<CpuStorage> {
    let idx = indices(index, inputs);
    let out_dims = inp.layout.dims().to_vec();
    let ostrides = crate::shape::Shape::new(&out_dims).contiguous_strides();
    let size = out_dims[dim];
    let dims = index.layout.dims();
    let mut pos = vec![0; dims.len()];
    let mut pairs = Vec::with_capacity(idx.len());
    for (i, &ix) in idx.iter().enumerate() {
        unravel(i, dims, &mut pos);
        let soff = src.layout.offset_of(&pos);
        pos[dim] = check(op, ix, size, dim)?;
        let doff: usize = pos.iter().zip(&ostrides).map(|(p, s)| p * s).sum();
        pairs.push((doff, soff));
    }
    fn go<T: AddElem + StorageElem>(base: &[T], l: &Layout, s: &[T], pairs: &[(usize, usize)]) -> CpuStorage {
        let mut out = copy_out(base, l);
        for &(d, so) in pairs {
            out[d] = out[d].add(s[so]);
        }
        T::wrap(out)
    }
    let (b, s) = (input(inp, inputs), input(src, inputs));
    Ok(map_storage!(b, bv => go(bv, &inp.layout, typed(s), &pairs)))
}

/// Inclusive prefix sum along `dim`.
fn cumsum(dim: usize, inp: &View, inputs: &[&CpuStorage]) -> CpuStorage {
    let l = &inp.layout;
    let dims = l.dims();
    let len = dims[dim];
    let n: usize = dims.iter().product();
    let inner: usize = dims[dim + 1..].iter().product();
    let outer = n.checked_div(len * inner).unwrap_or(0);
    fn go<T: AddElem + StorageElem + Default>(s: &[T], l: &Layout, outer: usize, len: usize, inner: usize) -> CpuStorage {
        let mut out = copy_out(s, l);
        for o in 0..outer {
            for i in 1..len {
                for j in 0..inner {
                    let at = (o * len + i) * inner + j;
                    out[at] = out[at - inner].add(out[at]);
                }
            }
        }
        T::wrap(out)
    }
    let s = input(inp, inputs);
    match s {
        // Accumulate bools as counts: the op layer casts bool to i32 first.
        CpuStorage::Bool(_) => unreachable!("cumsum of bool is cast to i32 first"),
        CpuStorage::F32(v) => go(v, l, outer, len, inner),
        CpuStorage::F64(v) => go(v, l, outer, len, inner),
        CpuStorage::I32(v) => go(v, l, outer, len, inner),
        CpuStorage::U32(v) => go(v, l, outer, len, inner),
        // Half types accumulate in f32 and round each stored sum (as PyTorch):
        // a running sum kept in f16 stalls once its ulp outgrows the terms.
        CpuStorage::F16(v) => {
            let f: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
            let CpuStorage::F32(r) = go(&f, l, outer, len, inner) else { unreachable!() };
            CpuStorage::F16(r.into_iter().map(f16::from_f32).collect())
        }
        CpuStorage::BF16(v) => {
            let f: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
            let CpuStorage::F32(r) = go(&f, l, outer, len, inner) else { unreachable!() };
            CpuStorage::BF16(r.into_iter().map(bf16::from_f32).collect())
        }
    }
}

/// Concatenate along `dim`.
/// The output comes from the pool, as every kernel's does: every element is
/// written (a fresh buffer per cat went back to the pool when freed and was
/// never taken again, so a loop of cats filled the pool to its cap).
fn cat(dim: usize, parts: &[View], inputs: &[&CpuStorage], dtype: DType, numel: usize) -> CpuStorage {
    let mut out = super::pool::take(dtype, numel);
    let first = parts[0].layout.dims();
    let outer: usize = first[..dim].iter().product();
    let total_dim: usize = parts.iter().map(|p| p.layout.dims()[dim]).sum();
    let inner: usize = first[dim + 1..].iter().product();
    map_storage!(&mut out, o => {
        let mut at = 0usize;
        for p in parts {
            let v = copy_out(typed(input(p, inputs)), &p.layout);
            let w = p.layout.dims()[dim] * inner;
            for k in 0..outer {
                let row = k * total_dim * inner + at;
                o[row..row + w].copy_from_slice(&v[k * w..(k + 1) * w]);
            }
            at += w;
        }
    });
    out
}

/// im2col: `[N, C, H, W]` to `[N, C, kh, kw, oh, ow]` (with `by_tap`,
/// `[C, kh, kw, N, oh, ow]`), out-of-range reads give `pad`. Each tap of
/// each image plane (an `oh x ow` block of the output) is one parallel
/// task; rows are copied as runs.
fn unfold(inp: &View, p: &UnfoldParams, pad: f64, by_tap: bool, inputs: &[&CpuStorage]) -> CpuStorage {
    let l = &inp.layout;
    let d = l.dims();
    let [oh, ow] = p.out_hw(d[2], d[3]).expect("checked when the op is recorded");
    let dims = [d[0], d[1], d[2], d[3], p.kernel[0], p.kernel[1], oh, ow];
    fn go<T: StorageElem>(s: &[T], l: &Layout, dims: [usize; 8], p: &UnfoldParams, pad: f64, by_tap: bool) -> CpuStorage {
        use rayon::prelude::*;
        let pad = T::from_f64(pad);
        let [nb, c, h, w, kh, kw, oh, ow] = dims;
        let st = l.strides();
        // From the pool, so a training loop reuses the (large) patch buffer
        // rather than faulting in fresh pages every step. Each element is
        // written once below: filling the buffer with `pad` first was a
        // second pass over it (the CNN's 14 MB of patches at batch 64).
        let mut out = T::unwrap(super::pool::take(T::DTYPE, nb * c * kh * kw * oh * ow)).expect("the pool returns the dtype asked for");
        if oh * ow == 0 {
            return T::wrap(out);
        }
        out.par_chunks_mut(oh * ow).with_min_len(16).enumerate().for_each(|(i, tap)| {
            // Which image plane and tap this block holds, in either order.
            let (n, ci, ki, kj) = if by_tap {
                let t = i / nb;
                (i % nb, t / (kh * kw), t / kw % kh, t % kw)
            } else {
                let t = i % (kh * kw);
                (i / (c * kh * kw), i / (kh * kw) % c, t / kw, t % kw)
            };
            let base = l.offset + n * st[0] + ci * st[1];
            let (x0, x1, off_x) = inside_cols(p, kj, w, ow);
            let sx = p.stride[1] as isize;
            for (y, dst_row) in tap.chunks_exact_mut(ow).enumerate() {
                let iy = (y * p.stride[0] + ki * p.dilation[0]) as isize - p.padding[0] as isize;
                if iy < 0 || iy as usize >= h || x0 >= x1 {
                    dst_row.fill(pad);
                    continue;
                }
                dst_row[..x0].fill(pad);
                dst_row[x1..].fill(pad);
                let row = base + iy as usize * st[2];
                if sx == 1 && st[3] == 1 {
                    // The common case (stride 1, contiguous rows): one copy per row.
                    let ix0 = (x0 as isize + off_x) as usize;
                    dst_row[x0..x1].copy_from_slice(&s[row + ix0..row + ix0 + (x1 - x0)]);
                    continue;
                }
                for (x, d) in (x0..x1).zip(&mut dst_row[x0..x1]) {
                    let ix = (x as isize * sx + off_x) as usize;
                    *d = s[row + ix * st[3]];
                }
            }
        });
        T::wrap(out)
    }
    map_storage!(input(inp, inputs), s => go(s, l, dims, p, pad, by_tap))
}

/// The output columns `x0..x1` (of `ow`) whose tap column `kj` reads inside
/// an image `w` wide, `0 <= x * stride + o < w`, and that tap's offset
/// `o = kj * dilation - padding`: unfold, fold and pooling work out once
/// per row which columns to copy, add or compare, not per element.
fn inside_cols(p: &UnfoldParams, kj: usize, w: usize, ow: usize) -> (usize, usize, isize) {
    let (s, o) = (p.stride[1] as isize, (kj * p.dilation[1]) as isize - p.padding[1] as isize);
    let x0 = if o >= 0 { 0 } else { ((-o + s - 1) / s) as usize };
    let x1 = if (w as isize) <= o { 0 } else { ((w as isize - o + s - 1) / s) as usize }.min(ow);
    (x0, x1, o)
}

/// Work applied in place to each block of an index kernel's result right
/// after it is made (the block's first element, the block): a fused
/// epilogue (see `Capabilities::index_epilogues`).
type Finish<'a, T> = Option<&'a (dyn Fn(usize, &mut [T]) + Sync)>;

/// An index kernel with its epilogue applied to each block of the result
/// as it is made (max pooling's gradient and fold, f32, each image plane a
/// block); `None` where the epilogue does not read the result element for
/// element into an f32 result of its own shape (the caller then runs it as
/// a pass of its own).
pub(crate) fn run_with_epilogue(op: &IndexOp, args: &[View], inputs: &[&CpuStorage], e: &crate::ir::Epilogue, dtype: DType, numel: usize) -> Option<CpuStorage> {
    let prog = super::elementwise::in_place_program(e, numel, dtype)?;
    let finish = |start: usize, block: &mut [f32]| super::elementwise::run_in_place(&prog, inputs, e.acc, start, block);
    match (*op, input(&args[0], inputs)) {
        (IndexOp::MaxPoolGrad { params, .. }, CpuStorage::F32(s)) => {
            let CpuStorage::F32(x) = input(&args[1], inputs) else { return None };
            Some(max_pool_grad_f32(s, &args[0].layout, x, &args[1].layout, &params, Some(&finish)))
        }
        (IndexOp::Fold { params, hw }, CpuStorage::F32(s)) => Some(fold_of(s, &args[0].layout, &params, hw, Some(&finish))),
        _ => None,
    }
}

/// col2im: add each patch entry `[N, C, kh, kw, oh, ow]` back at the input
/// position it was read from, into `[N, C, H, W]` (padding reads are dropped).
fn fold(inp: &View, p: &UnfoldParams, hw: [usize; 2], inputs: &[&CpuStorage]) -> CpuStorage {
    let l = &inp.layout;
    map_storage!(input(inp, inputs), s => fold_of(s, l, p, hw, None))
}

/// [`fold`] of one storage type, `finish` applied to each task's planes.
/// Each task adds into planes of its own, so no two write one element.
fn fold_of<T: StorageElem + AddElem>(s: &[T], l: &Layout, p: &UnfoldParams, [h, w]: [usize; 2], finish: Finish<T>) -> CpuStorage {
    let (d, st) = (l.dims(), l.strides());
    let (nb, c, kh, kw, oh, ow) = (d[0], d[1], d[2], d[3], d[4], d[5]);
    by_planes(nb * c, h * w, || (), |_, nc, plane| fold_plane(s, l.offset + nc / c * st[0] + nc % c * st[1], st, p, [kh, kw, oh, ow, h, w], plane), finish)
}

simd_fn! {
    /// The patches at `base` of `s` (strides `st`, `[N, C, kh, kw, oh, ow]`)
    /// added into one image `plane`; `d` is `[kh, kw, oh, ow, h, w]`. The
    /// columns that land inside the image are worked out once per row, not
    /// tested per element, so a stride-1 row with contiguous patches is a
    /// slice added to a slice, which vectorizes (the CNN's 64x32 14x14 input
    /// gradient: 9.0 -> 4.8 ms on 2 cores, profiled; AVX2 here, as fold's
    /// rows of 14 left most of each SSE loop to its scalar tail).
    fn fold_plane<T: AddElem>(s: &[T], base: usize, st: &[usize], p: &UnfoldParams, d: [usize; 6], plane: &mut [T]) {
        let [kh, kw, oh, ow, h, w] = d;
        let s1 = p.stride[1] as isize;
        for ki in 0..kh {
            for kj in 0..kw {
                let (x0, x1, o) = inside_cols(p, kj, w, ow);
                if x0 >= x1 {
                    continue;
                }
                for y in 0..oh {
                    let iy = (y * p.stride[0] + ki * p.dilation[0]) as isize - p.padding[0] as isize;
                    if iy < 0 || iy as usize >= h {
                        continue;
                    }
                    let src = base + ki * st[2] + kj * st[3] + y * st[4];
                    let row = &mut plane[iy as usize * w..(iy as usize + 1) * w];
                    let first = (x0 as isize * s1 + o) as usize;
                    if s1 == 1 && st[5] == 1 {
                        let len = x1 - x0;
                        for (d, v) in row[first..first + len].iter_mut().zip(&s[src + x0..src + x0 + len]) {
                            *d = d.add(*v);
                        }
                    } else {
                        for (i, x) in (x0..x1).enumerate() {
                            let d = &mut row[first + i * s1 as usize];
                            *d = d.add(s[src + x * st[5]]);
                        }
                    }
                }
            }
        }
    }
}

/// The order max pooling compares in, for every storage type: halves as
/// f32, bool as 0 and 1. A key unequal to itself is a NaN.
pub(crate) trait MaxKey: Copy {
    type K: Copy + PartialOrd;
    /// A key no value is below.
    const LOWEST: Self::K;
    fn key(self) -> Self::K;
    /// The value of a key this type's `key` made (exact).
    fn from_key(k: Self::K) -> Self;
}
macro_rules! max_key {
    ($($t:ty => $k:ty, $lowest:expr, $to:expr, $from:expr;)*) => {$(
        impl MaxKey for $t {
            type K = $k;
            const LOWEST: $k = $lowest;
            #[inline(always)]
            fn key(self) -> $k {
                $to(self)
            }
            #[inline(always)]
            fn from_key(k: $k) -> $t {
                $from(k)
            }
        }
    )*};
}
max_key! {
    f32 => f32, f32::NEG_INFINITY, |x| x, |k| k;
    f64 => f64, f64::NEG_INFINITY, |x| x, |k| k;
    i32 => i32, i32::MIN, |x| x, |k| k;
    u32 => u32, 0, |x| x, |k| k;
    f16 => f32, f32::NEG_INFINITY, |x: f16| x.to_f32(), f16::from_f32;
    bf16 => f32, f32::NEG_INFINITY, |x: bf16| x.to_f32(), bf16::from_f32;
    bool => u8, 0, |x| x as u8, |k| k != 0;
}

/// Whether tap `k` replaces the running maximum `best`: it is greater, or
/// the first NaN (a key unequal to itself; nothing replaces a NaN).
#[inline(always)]
#[allow(clippy::eq_op)]
pub(crate) fn replaces<K: PartialOrd>(k: K, best: K) -> bool {
    (k > best) | ((k != k) & (best == best))
}

/// One tap of a row of windows: window `i` reads `src[i * step]` (at
/// position `at0 + i * sx` of its image), and takes it over its running
/// maximum `best[i]` where it [`replaces`] it; with `AT`, `pos` follows,
/// starting at -1 (no tap yet). `STEP`
/// is the step when known (1 or 2, so the loop vectorizes), else 0.
#[inline(always)]
fn pool_tap<T: MaxKey, const STEP: usize, const AT: bool>(src: &[T], step: usize, best: &mut [T::K], pos: &mut [i32], at0: i32, sx: i32) {
    let step = if STEP == 0 { step } else { STEP };
    let n = best.len();
    assert!(n == 0 || src.len() > (n - 1) * step, "max_pool2d: a row of taps runs past its input");
    for i in 0..n {
        // SAFETY: i < n, and src holds (n - 1) * step + 1 elements (asserted).
        let k = unsafe { src.get_unchecked(i * step) }.key();
        let b = best[i];
        let take = (AT && pos[i] < 0) | replaces(k, b);
        best[i] = if take { k } else { b };
        if AT {
            pos[i] = if take { at0 + i as i32 * sx } else { pos[i] };
        }
    }
}

/// [`pool_tap`] over a whole plane of windows: window `j` reads
/// `s[base + offs[j]]` (`reach` the largest offset), at position
/// `at0[j] + q`. The `FIRST` tap of every
/// window (all are inside the image) starts its maximum: no test of
/// whether it has one, so the loop has no branch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pool_tap_tabled<T: MaxKey, const FIRST: bool, const AT: bool>(s: &[T], base: usize, (offs, reach): (&[usize], usize), best: &mut [T::K], pos: &mut [i32], at0: &[i32], q: i32) {
    let src = &s[base..=base + reach];
    let n = offs.len();
    let (best, pos, at0) = (&mut best[..n], &mut pos[..n], &at0[..n]);
    for j in 0..n {
        // SAFETY: every offset is at most `reach`, and `src` holds `reach + 1` elements.
        let k = unsafe { src.get_unchecked(offs[j]) }.key();
        let b = best[j];
        let take = FIRST | replaces(k, b);
        best[j] = if take { k } else { b };
        if AT {
            pos[j] = if take { at0[j] + q } else { pos[j] };
        }
    }
}

/// Where the windows of a max pooling sit over an image plane.
struct PoolGeom {
    p: UnfoldParams,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    /// Strides of the image's rows and columns.
    st: [usize; 2],
    /// Per tap column kj: the output columns `x0..x1` whose tap is inside
    /// the image, and the image column `ix0` that `x0`'s tap reads.
    cols: Vec<(usize, usize, usize)>,
    /// Without padding every tap is inside the image: then per output of
    /// the plane, the offset of its first tap and that tap's position
    /// `iy * w + ix`, so that each tap is one pass over the whole plane;
    /// and the largest offset.
    table: Option<(Vec<usize>, Vec<i32>, usize)>,
}

impl PoolGeom {
    fn new(p: &UnfoldParams, h: usize, w: usize, st: [usize; 2]) -> PoolGeom {
        let [oh, ow] = p.out_hw(h, w).expect("checked when the op is recorded");
        let cols = (0..p.kernel[1])
            .map(|kj| {
                let (x0, x1, o) = inside_cols(p, kj, w, ow);
                (x0, x1, (x0 as isize * p.stride[1] as isize + o).max(0) as usize)
            })
            .collect();
        let table = (p.padding == [0, 0]).then(|| {
            let firsts = (0..oh).flat_map(|y| (0..ow).map(move |x| (y * p.stride[0], x * p.stride[1])));
            let (offs, at0): (Vec<usize>, Vec<i32>) = firsts.map(|(iy, ix)| (iy * st[0] + ix * st[1], (iy * w + ix) as i32)).unzip();
            let reach = offs.iter().copied().max().unwrap_or(0);
            (offs, at0, reach)
        });
        PoolGeom { p: *p, h, w, oh, ow, st, cols, table }
    }
}

simd_fn! {
    /// The running maxima of one image plane's windows (at `base` of `s`)
    /// into `best`, and with `at` their positions into `pos` (both a
    /// plane of outputs long).
    fn pool_plane<T: MaxKey>(s: &[T], base: usize, g: &PoolGeom, at: bool, best: &mut [T::K], pos: &mut [i32]) {
        best.fill(T::LOWEST);
        pos.fill(-1);
        let (p, ow) = (&g.p, g.ow);
        if let Some((offs, at0, reach)) = &g.table {
            let offs = (offs.as_slice(), *reach);
            for ki in 0..p.kernel[0] {
                for kj in 0..p.kernel[1] {
                    let (dy, dx) = (ki * p.dilation[0], kj * p.dilation[1]);
                    let first = base + dy * g.st[0] + dx * g.st[1];
                    let (off, q) = (first, (dy * g.w + dx) as i32);
                    match (ki + kj == 0, at) {
                        (true, false) => pool_tap_tabled::<T, true, false>(s, off, offs, best, pos, at0, q),
                        (true, true) => pool_tap_tabled::<T, true, true>(s, off, offs, best, pos, at0, q),
                        (false, false) => pool_tap_tabled::<T, false, false>(s, off, offs, best, pos, at0, q),
                        (false, true) => pool_tap_tabled::<T, false, true>(s, off, offs, best, pos, at0, q),
                    }
                }
            }
            return;
        }
        let (step, sx) = (p.stride[1] * g.st[1], p.stride[1] as i32);
        for y in 0..g.oh {
            let (brow, prow) = (&mut best[y * ow..(y + 1) * ow], &mut pos[y * ow..(y + 1) * ow]);
            for ki in 0..p.kernel[0] {
                let iy = (y * p.stride[0] + ki * p.dilation[0]) as isize - p.padding[0] as isize;
                if iy < 0 || iy as usize >= g.h {
                    continue;
                }
                let iy = iy as usize;
                for &(x0, x1, ix0) in &g.cols {
                    if x0 >= x1 {
                        continue;
                    }
                    let first = base + iy * g.st[0] + ix0 * g.st[1];
                    let src = &s[first..=first + (x1 - x0 - 1) * step];
                    let (b, q, at0) = (&mut brow[x0..x1], &mut prow[x0..x1], (iy * g.w + ix0) as i32);
                    match (step, at) {
                        (1, false) => pool_tap::<T, 1, false>(src, step, b, q, at0, sx),
                        (1, true) => pool_tap::<T, 1, true>(src, step, b, q, at0, sx),
                        (2, false) => pool_tap::<T, 2, false>(src, step, b, q, at0, sx),
                        (2, true) => pool_tap::<T, 2, true>(src, step, b, q, at0, sx),
                        (_, false) => pool_tap::<T, 0, false>(src, step, b, q, at0, sx),
                        (_, true) => pool_tap::<T, 0, true>(src, step, b, q, at0, sx),
                    }
                }
            }
        }
    }
}

/// Each window's maximum (see `IndexOp::MaxPool`). Each tap in row-major
/// order updates the running maxima of a whole plane of windows (row by
/// row where padding leaves some taps outside): loops the compiler
/// vectorizes, where a loop over each window's few taps would not.
fn max_pool(inp: &View, p: &UnfoldParams, inputs: &[&CpuStorage]) -> CpuStorage {
    fn go<T: StorageElem + MaxKey>(s: &[T], l: &Layout, p: &UnfoldParams) -> CpuStorage {
        use rayon::prelude::*;
        let (d, st) = (l.dims(), l.strides());
        let (nb, c) = (d[0], d[1]);
        if let Some(x0) = maxpool2x2::pairs_of_rows(p, l) {
            // Tasks of whole rows of windows, about 64k taps each.
            let (s, w) = (&s[x0..], d[3]);
            let rows = (16384 / (w / 2)).max(1);
            let mut out = T::unwrap(super::pool::take(T::DTYPE, l.numel() / 4)).expect("the pool returns the dtype asked for");
            out.par_chunks_mut(rows * (w / 2)).enumerate().for_each(|(t, dst)| {
                let at = t * rows * 2 * w;
                maxpool2x2::pool_rows(&s[at..at + dst.len() * 4], w, dst);
            });
            return T::wrap(out);
        }
        let g = PoolGeom::new(p, d[2], d[3], [st[2], st[3]]);
        let plane = g.oh * g.ow;
        let mut out = T::unwrap(super::pool::take(T::DTYPE, nb * c * plane)).expect("the pool returns the dtype asked for");
        if plane == 0 {
            return T::wrap(out);
        }
        // Tasks of whole planes, about 64k taps each: one plane of a
        // 28x28 image is too little work to hand to another thread.
        let per = (65536 / (plane * p.kernel[0] * p.kernel[1])).max(1);
        out.par_chunks_mut(per * plane).enumerate().for_each_init(
            || (vec![T::LOWEST; plane], vec![-1i32; plane]),
            |(best, pos), (task, planes)| {
                for (pi, dst) in planes.chunks_mut(plane).enumerate() {
                    let nc = task * per + pi;
                    pool_plane(s, l.offset + (nc / c) * st[0] + (nc % c) * st[1], &g, false, best, pos);
                    for (r, &k) in dst.iter_mut().zip(best.iter()) {
                        *r = T::from_key(k);
                    }
                }
            },
        );
        T::wrap(out)
    }
    map_storage!(input(inp, inputs), s => go(s, &inp.layout, p))
}

/// The gradient of max pooling (see `IndexOp::MaxPoolGrad`): each task
/// finds the first maximum of each window of its image planes, as the
/// forward kernel does, and adds the window's gradient there, in window
/// order. Finding them here, plane by plane in cache, saves a kernel that
/// writes them all out and a pass that reads them back.
fn max_pool_grad(g: &View, x: &View, p: &UnfoldParams, inputs: &[&CpuStorage]) -> CpuStorage {
    let xs = input(x, inputs);
    if let (CpuStorage::F32(s), CpuStorage::F32(xs)) = (input(g, inputs), xs) {
        return max_pool_grad_f32(s, &g.layout, xs, &x.layout, p, None);
    }
    map_storage!(input(g, inputs), s => max_pool_grad_of(s, &g.layout, StorageElem::slice(xs).expect("max pooling's gradient has its image's dtype"), &x.layout, p, None))
}

/// The result of an index kernel that adds into `count` image planes of
/// `plane` elements each (fold, max pooling's gradient): `add(scratch, nc,
/// dst)` adds plane `nc` into `dst`, zeroed, with each task's `scratch`
/// from `init`. Tasks take about 16k elements of planes, so that `finish`
/// (an epilogue) runs on blocks large enough to pay for its setup (a plane
/// of a 14x14 image is 196 elements).
fn by_planes<T: StorageElem, S>(count: usize, plane: usize, init: impl Fn() -> S + Sync + Send, add: impl Fn(&mut S, usize, &mut [T]) + Sync, finish: Finish<T>) -> CpuStorage {
    by_plane_blocks(count, plane, true, init, |s, first, planes| {
        for (pi, dst) in planes.chunks_mut(plane).enumerate() {
            add(s, first + pi, dst);
        }
    }, finish)
}

/// [`by_planes`] with `add(scratch, first plane, block of planes)` making
/// a whole block at once, into zeros where `zero`, else over whatever the
/// buffer held (then `add` must write every element).
fn by_plane_blocks<T: StorageElem, S>(count: usize, plane: usize, zero: bool, init: impl Fn() -> S + Sync + Send, add: impl Fn(&mut S, usize, &mut [T]) + Sync, finish: Finish<T>) -> CpuStorage {
    use rayon::prelude::*;
    // From the pool: a training step makes a result of the same size every
    // step, and a fresh allocation costs page faults and, when freed, TLB
    // shootdowns across the workers. Each task zeroes its own planes (in
    // cache, on every thread), not the caller the whole buffer first.
    let mut out = T::unwrap(super::pool::take(T::DTYPE, count * plane)).expect("the pool returns the dtype asked for");
    if plane == 0 {
        return T::wrap(out);
    }
    let per = (16384 / plane).max(1);
    out.par_chunks_mut(per * plane).enumerate().for_each_init(init, |scratch, (task, planes)| {
        if zero {
            planes.fill(T::from_f64(0.0));
        }
        add(scratch, task * per, planes);
        if let Some(f) = finish {
            f(task * per * plane, planes);
        }
    });
    T::wrap(out)
}

/// [`max_pool_grad`] in f32: 2x2 windows at stride 2 over contiguous
/// images and gradients through [`maxpool2x2::grad_rows`], others as any type.
fn max_pool_grad_f32(s: &[f32], gl: &Layout, x: &[f32], xl: &Layout, p: &UnfoldParams, finish: Finish<f32>) -> CpuStorage {
    let (Some(x0), true) = (maxpool2x2::pairs_of_rows(p, xl), gl.is_contiguous()) else { return max_pool_grad_of(s, gl, x, xl, p, finish) };
    let (count, [h, w]) = (gl.dims()[0] * gl.dims()[1], [xl.dims()[2], xl.dims()[3]]);
    let (x, s) = (&x[x0..], &s[gl.offset..]);
    // Each task's planes are whole pairs of image rows, and rows of g.
    by_plane_blocks(count, h * w, false, || (), |_, first, planes| {
        let at = first * h * w;
        maxpool2x2::grad_rows(&x[at..at + planes.len()], &s[at / 4..(at + planes.len()) / 4], w, planes);
    }, finish)
}

/// [`max_pool_grad`] of one storage type, `finish` applied to each task's planes.
fn max_pool_grad_of<T: StorageElem + AddElem + MaxKey>(s: &[T], gl: &Layout, x: &[T], xl: &Layout, p: &UnfoldParams, finish: Finish<T>) -> CpuStorage {
    let (d, gs, xs) = (gl.dims(), gl.strides(), xl.strides());
    let (c, oh, ow) = (d[1], d[2], d[3]);
    let (h, w) = (xl.dims()[2], xl.dims()[3]);
    let geom = PoolGeom::new(p, h, w, [xs[2], xs[3]]);
    let scratch = || (vec![T::LOWEST; oh * ow], vec![-1i32; oh * ow]);
    let add_plane = |(best, pos): &mut (Vec<T::K>, Vec<i32>), nc: usize, dst: &mut [T]| {
        let (n, ci) = (nc / c, nc % c);
        pool_plane(x, xl.offset + n * xs[0] + ci * xs[1], &geom, true, best, pos);
        let gb = gl.offset + n * gs[0] + ci * gs[1];
        for y in 0..oh {
            for (xo, &q) in pos[y * ow..(y + 1) * ow].iter().enumerate() {
                // Every window has a tap inside the image (padding is at
                // most half the kernel); one without would be dropped, never a panic.
                if let Some(e) = usize::try_from(q).ok().and_then(|q| dst.get_mut(q)) {
                    *e = e.add(s[gb + y * gs[2] + xo * gs[3]]);
                }
            }
        }
    };
    by_planes(d[0] * c, h * w, scratch, add_plane, finish)
}
