//! Batched matmul through the `gemm` crate (f32, f64, f16), which reads any
//! strides, so transposed and broadcast inputs are never copied.

use super::input;
use crate::dtype::DType;
use crate::ir::Epilogue;
use crate::ir::Strided as View;
use crate::layout::unravel;
use crate::storage::CpuStorage;
use gemm::Parallelism;
use half::{bf16, f16};
use rayon::prelude::*;

/// Per-batch element offsets of a `[..., r, c]` layout.
fn batch_offsets(v: &View) -> Vec<usize> {
    let l = &v.layout;
    let r = l.dims().len();
    let bdims = &l.dims()[..r - 2];
    let nb: usize = bdims.iter().product();
    let mut idx = vec![0; bdims.len()];
    (0..nb)
        .map(|b| {
            unravel(b, bdims, &mut idx);
            l.offset + idx.iter().zip(&l.strides).map(|(i, s)| i * s).sum::<usize>()
        })
        .collect()
}

fn strides(v: &View) -> (isize, isize) {
    let s = v.layout.strides();
    let r = s.len();
    (s[r - 2] as isize, s[r - 1] as isize)
}

/// Shared pointer for disjoint per-batch writes from rayon tasks.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer; a method, so closures capture the whole (Send) wrapper.
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// `dst = lhs @ rhs` through gemm: `m x n` products over an inner dim of
/// `k`, written (not added) to `dst`; `dst` and each operand given by its
/// first element and (row, column) strides. `zero` and `one` are the
/// element type's.
///
/// # Safety
/// Every element the strides reach from each pointer must be in bounds,
/// and `dst`'s elements written by no one else meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product<T: 'static>(m: usize, n: usize, k: usize, dst: (*mut T, isize, isize), lhs: (*const T, isize, isize), rhs: (*const T, isize, isize), zero: T, one: T, par: Parallelism) {
    // SAFETY: the caller's promise, above.
    unsafe { gemm::gemm(m, n, k, dst.0, dst.2, dst.1, false, lhs.0, lhs.2, lhs.1, rhs.0, rhs.2, rhs.1, zero, one, false, false, false, par) }
}

/// Whether gemm makes `m x n` products over `k` faster into a column-major
/// destination than into a row-major one, given the operands' (row,
/// column) strides. gemm turns a row-major destination column-major by
/// swapping the operands (`C^T = B^T A^T`), and packs its left operand
/// fastest when it is contiguous along the output's rows and its right one
/// along k; this counts the elements of operands that are not, either way.
/// A weight gradient `dY @ X^T` (both contiguous along k, 64x50176x288,
/// split over k): 19.3 ms row-major, 10.2-13.4 column-major on 2 cores.
fn column_major_is_cheaper(m: usize, n: usize, k: usize, (a_rs, a_cs): (isize, isize), (b_rs, b_cs): (isize, isize)) -> bool {
    let unpacked = |strided: bool, len: usize| if strided { len * k } else { 0 };
    let row_major = unpacked(b_cs != 1, n) + unpacked(a_cs != 1, m);
    let column_major = unpacked(a_rs != 1, m) + unpacked(b_rs != 1, n);
    column_major < row_major
}

/// Work applied in place to each batch's block of products right after gemm
/// writes it (the block's first element, the block).
type Finish<'a, T> = Option<&'a (dyn Fn(usize, &mut [T]) + Sync)>;

#[allow(clippy::too_many_arguments)]
fn gemm_batched<T: 'static + Copy + Send + Sync + std::ops::Add<Output = T>>(a: &View, b: &View, sa: &[T], sb: &[T], out: &mut [T], m: usize, k: usize, n: usize, zero: T, one: T, finish: Finish<T>) {
    let (oa, ob) = (batch_offsets(a), batch_offsets(b));
    let (a_rs, a_cs) = strides(a);
    let (b_rs, b_cs) = strides(b);
    let nb = oa.len();
    if m == 0 || n == 0 || k == 0 {
        // The output is already zeros.
        if let Some(f) = finish {
            f(0, out);
        }
        return;
    }
    let threads = super::threads();
    let work = m * n * k;
    if nb == 1 && threads > 1 && k >= 8 * m.max(n) && m * n <= 1 << 16 && work >= 1 << 22 {
        split_k(a, b, sa, sb, out, m, k, n, zero, one, threads);
        if let Some(f) = finish {
            f(0, out);
        }
        return;
    }
    // Products split over batches, one per task, where the batches share
    // out evenly (or are many) or are small: gemm's own threads pay only on
    // one large product (a convolution's 64 products of 64x288x196 ran at 68
    // GFLOP/s on 2 cores through gemm's threads, about 100 one per task).
    // Otherwise (few large ones, unevenly many) gemm's own threads.
    let batch_tasks = nb >= threads && (work < 128 * 128 * 128 || nb % threads == 0 || nb >= 4 * threads);
    let (par_batches, inner_par) = if batch_tasks {
        (true, Parallelism::None)
    } else {
        (false, if work >= 48 * 48 * 48 { Parallelism::Rayon(threads) } else { Parallelism::None })
    };
    let dst = SendPtr(out.as_mut_ptr());
    let run = |bi: usize| {
        // SAFETY: each batch writes its own m*n block of `out`; the input
        // offsets come from layouts whose span was checked against their buffers.
        unsafe { product(m, n, k, (dst.get().add(bi * m * n), n as isize, 1), (sa.as_ptr().add(oa[bi]), a_rs, a_cs), (sb.as_ptr().add(ob[bi]), b_rs, b_cs), zero, one, inner_par) }
        if let (Some(f), true) = (finish, par_batches) {
            // SAFETY: this task alone writes batch `bi`'s block, just written by gemm.
            f(bi * m * n, unsafe { std::slice::from_raw_parts_mut(dst.get().add(bi * m * n), m * n) });
        }
    };
    if par_batches {
        (0..nb).into_par_iter().for_each(run);
    } else {
        (0..nb).for_each(run);
        // gemm's own threads made the products: the finish splits the same way.
        if let Some(f) = finish {
            let chunk = (out.len() / (threads * 4)).max(super::elementwise::BLOCK * 16);
            out.par_chunks_mut(chunk).enumerate().for_each(|(c, block)| f(c * chunk, block));
        }
    }
}

/// One product with a long inner dim and a small output (a weight gradient,
/// its batch folded into k): gemm's threads would split the small output
/// and each stream all of k; here each thread multiplies a slice of k into
/// a partial product of its own, and the partials are added. The CNN's
/// weight gradients on 2 cores: 64x12544x288 3.3-5.0 -> 2.9 ms, 32x50176x9
/// 0.69-0.93 -> 0.43 ms.
#[allow(clippy::too_many_arguments)]
fn split_k<T: 'static + Copy + Send + Sync + std::ops::Add<Output = T>>(a: &View, b: &View, sa: &[T], sb: &[T], out: &mut [T], m: usize, k: usize, n: usize, zero: T, one: T, parts: usize) {
    let (oa, ob) = (batch_offsets(a)[0], batch_offsets(b)[0]);
    let (a_rs, a_cs) = strides(a);
    let (b_rs, b_cs) = strides(b);
    let kc = k.div_ceil(parts);
    // The partials are scratch: each is laid out as gemm fills it fastest.
    let col = column_major_is_cheaper(m, n, k, (a_rs, a_cs), (b_rs, b_cs));
    let (d_rs, d_cs) = if col { (1, m as isize) } else { (n as isize, 1) };
    let partials: Vec<Vec<T>> = (0..parts)
        .into_par_iter()
        .map(|t| {
            let (k0, k1) = ((t * kc).min(k), ((t + 1) * kc).min(k));
            let mut part = vec![zero; m * n];
            if k1 > k0 {
                // SAFETY: rows and columns k0..k1 of a view whose span was checked against its buffer.
                unsafe {
                    let (pa, pb) = (sa.as_ptr().add(oa).offset(k0 as isize * a_cs), sb.as_ptr().add(ob).offset(k0 as isize * b_rs));
                    product(m, n, k1 - k0, (part.as_mut_ptr(), d_rs, d_cs), (pa, a_rs, a_cs), (pb, b_rs, b_cs), zero, one, Parallelism::None)
                }
            }
            part
        })
        .collect();
    for (i, o) in out.iter_mut().enumerate() {
        let at = if col { i % n * m + i / n } else { i };
        *o = partials.iter().fold(zero, |s, p| s + p[at]);
    }
}

/// Integer matmul, wrapping like the elementwise integer ops (exact mod
/// 2^32, where accumulating in f64 rounds once products pass 2^53).
fn naive<T: Copy>(a: &View, b: &View, sa: &[T], sb: &[T], m: usize, k: usize, n: usize, mul: impl Fn(T, T) -> T, add: impl Fn(T, T) -> T, zero: T) -> Vec<T> {
    let (oa, ob) = (batch_offsets(a), batch_offsets(b));
    let (a_rs, a_cs) = strides(a);
    let (b_rs, b_cs) = strides(b);
    let mut out = vec![zero; oa.len() * m * n];
    for bi in 0..oa.len() {
        for i in 0..m {
            for j in 0..n {
                let mut s = zero;
                for p in 0..k {
                    let x = sa[(oa[bi] as isize + i as isize * a_rs + p as isize * a_cs) as usize];
                    let y = sb[(ob[bi] as isize + p as isize * b_rs + j as isize * b_cs) as usize];
                    s = add(s, mul(x, y));
                }
                out[(bi * m + i) * n + j] = s;
            }
        }
    }
    out
}

/// The buffer for `len` products over an inner dim of `k`: gemm overwrites
/// every element unless the inner dim is empty, and then they are zeros.
fn product_buffer(dtype: DType, len: usize, k: usize) -> CpuStorage {
    if k > 0 {
        super::pool::take(dtype, len)
    } else {
        super::pool::take_zeroed(dtype, len)
    }
}

/// An f32 product with its epilogue applied in place, batch by batch while
/// each block of products is in cache; `None` where the epilogue does not
/// read the product element for element into an f32 result of its own shape
/// (the caller then runs it as a pass of its own).
pub(crate) fn run_with_epilogue(a: &View, b: &View, m: usize, k: usize, n: usize, inputs: &[&CpuStorage], e: &Epilogue, dtype: DType) -> Option<CpuStorage> {
    let (CpuStorage::F32(sa), CpuStorage::F32(sb)) = (input(a, inputs), input(b, inputs)) else { return None };
    let nb = batch_offsets(a).len();
    let prog = super::elementwise::in_place_program(e, nb * m * n, dtype)?;
    let finish = |start: usize, block: &mut [f32]| super::elementwise::run_in_place(&prog, inputs, e.acc, start, block);
    let mut out = product_buffer(dtype, nb * m * n, k);
    let CpuStorage::F32(o) = &mut out else { unreachable!("the pool returns the dtype asked for") };
    gemm_batched(a, b, sa, sb, o, m, k, n, 0.0, 1.0, Some(&finish));
    Some(out)
}

/// Run a matmul kernel.
pub(crate) fn run(a: &View, b: &View, m: usize, k: usize, n: usize, inputs: &[&CpuStorage], dtype: DType) -> CpuStorage {
    let (x, y) = (input(a, inputs), input(b, inputs));
    let nb = batch_offsets(a).len();
    let mut out = product_buffer(dtype, nb * m * n, k);
    match (x, y, &mut out) {
        (CpuStorage::F32(sa), CpuStorage::F32(sb), CpuStorage::F32(o)) => gemm_batched(a, b, sa, sb, o, m, k, n, 0.0, 1.0, None),
        (CpuStorage::F64(sa), CpuStorage::F64(sb), CpuStorage::F64(o)) => gemm_batched(a, b, sa, sb, o, m, k, n, 0.0, 1.0, None),
        (CpuStorage::F16(sa), CpuStorage::F16(sb), CpuStorage::F16(o)) => {
            gemm_batched(a, b, sa, sb, o, m, k, n, f16::ZERO, f16::ONE, None)
        }
        (CpuStorage::BF16(sa), CpuStorage::BF16(sb), CpuStorage::BF16(o)) => {
            // No bf16 gemm: compute in f32 from converted copies of the viewed elements.
            let fa: Vec<f32> = sa.iter().map(|v| v.to_f32()).collect();
            let fb: Vec<f32> = sb.iter().map(|v| v.to_f32()).collect();
            let mut fo = vec![0f32; o.len()];
            gemm_batched(a, b, &fa, &fb, &mut fo, m, k, n, 0.0, 1.0, None);
            for (d, s) in o.iter_mut().zip(fo) {
                *d = bf16::from_f32(s);
            }
        }
        (CpuStorage::I32(sa), CpuStorage::I32(sb), CpuStorage::I32(o)) => {
            o.copy_from_slice(&naive(a, b, sa, sb, m, k, n, i32::wrapping_mul, i32::wrapping_add, 0));
        }
        (CpuStorage::U32(sa), CpuStorage::U32(sb), CpuStorage::U32(o)) => {
            o.copy_from_slice(&naive(a, b, sa, sb, m, k, n, u32::wrapping_mul, u32::wrapping_add, 0));
        }
        _ => unreachable!("matmul dtypes are checked when the op is recorded"),
    }
    out
}
