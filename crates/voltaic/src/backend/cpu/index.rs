//! The index-like kernels: gather, scatter_add, index_select, cumsum, cat,
//! unfold and fold.

use super::input;
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
        IndexOp::Unfold { params, pad } => unfold(&args[0], &params, pad, inputs),
        IndexOp::Fold { params, hw } => fold(&args[0], &params, hw, inputs),
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
    fn add(self, o: f32) -> f32 {
        self + o
    }
}
impl AddElem for f64 {
    fn add(self, o: f64) -> f64 {
        self + o
    }
}
impl AddElem for i32 {
    fn add(self, o: i32) -> i32 {
        self.wrapping_add(o)
    }
}
impl AddElem for u32 {
    fn add(self, o: u32) -> u32 {
        self.wrapping_add(o)
    }
}
impl AddElem for bool {
    fn add(self, o: bool) -> bool {
        self | o
    }
}
impl AddElem for f16 {
    fn add(self, o: f16) -> f16 {
        f16::from_f32(self.to_f32() + o.to_f32())
    }
}
impl AddElem for bf16 {
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
fn cat(dim: usize, parts: &[View], inputs: &[&CpuStorage], dtype: DType, numel: usize) -> CpuStorage {
    let mut out = CpuStorage::zeros(dtype, numel);
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

/// im2col: `[N, C, H, W]` to `[N, C, kh, kw, oh, ow]`, out-of-range reads give `pad`.
/// Each (n, c) plane is one parallel task; rows are copied as runs.
fn unfold(inp: &View, p: &UnfoldParams, pad: f64, inputs: &[&CpuStorage]) -> CpuStorage {
    use rayon::prelude::*;
    let l = &inp.layout;
    let d = l.dims();
    let (nb, c, h, w) = (d[0], d[1], d[2], d[3]);
    let [oh, ow] = p.out_hw(h, w).expect("checked when the op is recorded");
    let [kh, kw] = p.kernel;
    let st = l.strides().to_vec();
    let plane = kh * kw * oh * ow;
    fn go<T: StorageElem>(s: &[T], l: &Layout, st: &[usize], dims: [usize; 8], p: &UnfoldParams, pad: f64) -> CpuStorage {
        let pad = T::from_f64(pad);
        let [nb, c, h, w, kh, kw, oh, ow] = dims;
        let plane = kh * kw * oh * ow;
        // From the pool, so a training loop reuses the (large) patch buffer
        // rather than faulting in fresh pages every step.
        let mut out = T::unwrap(super::pool::take(T::DTYPE, nb * c * plane)).expect("the pool returns the dtype asked for");
        out.fill(pad);
        if plane == 0 {
            return T::wrap(out);
        }
        out.par_chunks_mut(plane).enumerate().for_each(|(nc, dst)| {
            let (n, ci) = (nc / c, nc % c);
            let base = l.offset + n * st[0] + ci * st[1];
            for ki in 0..kh {
                for kj in 0..kw {
                    let tap = &mut dst[(ki * kw + kj) * oh * ow..(ki * kw + kj + 1) * oh * ow];
                    // Output columns whose input column is inside the image.
                    let off_x = (kj * p.dilation[1]) as isize - p.padding[1] as isize;
                    let sx = p.stride[1] as isize;
                    let x0 = if off_x >= 0 { 0 } else { ((-off_x) + sx - 1) / sx } as usize;
                    let x1 = if (w as isize) <= off_x { 0 } else { ((w as isize - off_x + sx - 1) / sx) as usize }.min(ow);
                    for y in 0..oh {
                        let iy = (y * p.stride[0] + ki * p.dilation[0]) as isize - p.padding[0] as isize;
                        if iy < 0 || iy as usize >= h || x0 >= x1 {
                            continue;
                        }
                        let row = base + iy as usize * st[2];
                        let dst_row = &mut tap[y * ow..(y + 1) * ow];
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
                }
            }
        });
        T::wrap(out)
    }
    let _ = plane;
    let dims = [nb, c, h, w, kh, kw, oh, ow];
    map_storage!(input(inp, inputs), s => go(s, l, &st, dims, p, pad))
}

/// col2im: add each patch entry `[N, C, kh, kw, oh, ow]` back at the input
/// position it was read from, into `[N, C, H, W]` (padding reads are dropped).
/// Each (n, c) plane is one parallel task, so no two tasks write one element.
fn fold(inp: &View, p: &UnfoldParams, hw: [usize; 2], inputs: &[&CpuStorage]) -> CpuStorage {
    use rayon::prelude::*;
    let l = &inp.layout;
    let d = l.dims().to_vec();
    let (nb, c, kh, kw, oh, ow) = (d[0], d[1], d[2], d[3], d[4], d[5]);
    let [h, w] = hw;
    let st = l.strides().to_vec();
    fn go<T: StorageElem + AddElem + Default>(s: &[T], l: &Layout, st: &[usize], d: [usize; 8], p: &UnfoldParams) -> CpuStorage {
        let [nb, c, kh, kw, oh, ow, h, w] = d;
        // From the pool, as unfold's patches: a training step folds an input
        // gradient of the same size every step, and a fresh allocation costs
        // page faults and, when freed, TLB shootdowns across the workers.
        let mut out = T::unwrap(super::pool::take_zeroed(T::DTYPE, nb * c * h * w)).expect("the pool returns the dtype asked for");
        if h * w == 0 {
            return T::wrap(out);
        }
        // Each plane adds its patches' rows in place: the columns that land
        // inside the image are worked out once per row, not tested per
        // element, so a stride-1 row with contiguous patches is a slice
        // added to a slice, which the compiler vectorizes (the CNN's 64x32
        // 14x14 input gradient: 9.0 -> 4.8 ms on 2 cores, profiled).
        let (s1, off) = (p.stride[1] as isize, |kj: usize| (kj * p.dilation[1]) as isize - p.padding[1] as isize);
        out.par_chunks_mut(h * w).enumerate().for_each(|(nc, plane)| {
            let (n, ci) = (nc / c, nc % c);
            let base = l.offset + n * st[0] + ci * st[1];
            for ki in 0..kh {
                for kj in 0..kw {
                    // Columns x with 0 <= x * s1 + o < w.
                    let o = off(kj);
                    let x0 = if o >= 0 { 0 } else { ((-o + s1 - 1) / s1) as usize };
                    let x1 = if (w as isize) <= o { 0 } else { ((w as isize - o + s1 - 1) / s1) as usize }.min(ow);
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
        });
        T::wrap(out)
    }
    let dims = [nb, c, kh, kw, oh, ow, h, w];
    match input(inp, inputs) {
        CpuStorage::F32(v) => go(v, l, &st, dims, p),
        CpuStorage::F64(v) => go(v, l, &st, dims, p),
        CpuStorage::F16(v) => go(v, l, &st, dims, p),
        CpuStorage::BF16(v) => go(v, l, &st, dims, p),
        CpuStorage::I32(v) => go(v, l, &st, dims, p),
        CpuStorage::U32(v) => go(v, l, &st, dims, p),
        CpuStorage::Bool(v) => go(v, l, &st, dims, p),
    }
}
