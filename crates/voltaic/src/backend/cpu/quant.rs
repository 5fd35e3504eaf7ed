//! Kernels over block-quantized matrices (see `QTensor`), spread over the
//! rayon pool: for a few rows of activations (decode), integer dot products
//! with the activations quantized to 16 bits (`qdot.rs`; Q4_0, Q4_1, Q8_0)
//! or, for the other types, blocks dequantized into registers and AVX2/FMA
//! dot products; for a prompt (prefill), weight rows dequantized a tile at
//! a time into a buffer that stays in cache and multiplied by the `gemm`
//! crate.

use super::input;
use super::matmul::SendPtr;
use super::simd::simd_fn;
use crate::error::{bail, Result};
use crate::ir::Strided as View;
use crate::quant::GgmlType;
use crate::storage::CpuStorage;
use rayon::prelude::*;

/// The padded blocks of a quantized matrix: `rows` rows of `cols` elements.
struct Blocks<'a> {
    bytes: &'a [u8],
    row_bytes: usize,
    padded: usize,
    q: GgmlType,
}

simd_fn!(
    /// One row's padded blocks dequantized into `out`.
    fn dequant_row(q: GgmlType, row: &[u8], padded: usize, out: &mut [f32]) {
        crate::quant::dequantize_strided(q, row, padded, out)
    }
);

impl<'a> Blocks<'a> {
    fn new(v: &View, inputs: &[&'a CpuStorage], q: GgmlType, cols: usize) -> Blocks<'a> {
        let CpuStorage::U32(words) = input(v, inputs) else { unreachable!("quantized blocks are u32 words") };
        let padded = q.padded_block_bytes();
        let bytes: &[u8] = bytemuck::cast_slice(&words[v.layout.offset..]);
        Blocks { bytes, row_bytes: cols / q.block().0 * padded, padded, q }
    }

    /// The padded blocks of row `r`.
    fn row_bytes(&self, r: usize) -> &'a [u8] {
        &self.bytes[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Row `r`, dequantized into `out` (`cols` long).
    fn row(&self, r: usize, out: &mut [f32]) {
        dequant_row(self.q, self.row_bytes(r), self.padded, out);
    }
}

/// Rows of a `[rows, cols]` quantized matrix at the positions of a 1-D index, in f32.
pub(crate) fn dequantize_rows(op: &'static str, q: GgmlType, cols: usize, blocks: &View, index: &View, inputs: &[&CpuStorage]) -> Result<CpuStorage> {
    let rows = blocks.layout.dims()[0];
    let mut ids: Vec<i64> = Vec::with_capacity(index.layout.numel());
    match input(index, inputs) {
        CpuStorage::I32(x) => index.layout.for_each_offset(|o| ids.push(x[o] as i64)),
        CpuStorage::U32(x) => index.layout.for_each_offset(|o| ids.push(x[o] as i64)),
        _ => unreachable!("index dtype is checked when the op is recorded"),
    }
    if let Some(&bad) = ids.iter().find(|&&i| i < 0 || i as usize >= rows) {
        bail!(Index, op, "index {bad} is out of range for dimension 0 of size {rows}");
    }
    let b = Blocks::new(blocks, inputs, q, cols);
    let mut out = super::pool::take(crate::DType::F32, ids.len() * cols);
    let CpuStorage::F32(o) = &mut out else { unreachable!("f32 output") };
    if cols > 0 {
        o.par_chunks_mut(cols).zip(ids.par_iter()).for_each(|(o, &i)| b.row(i as usize, o));
    }
    Ok(out)
}

/// Rows of `a` up to which the product runs as dot products of each
/// dequantized block with every row (decode); above, through `gemm`.
const SMALL_M: usize = 16;

simd_fn!(
    /// `sums[i] = a[i] . row` for the `sums.len()` rows of `a` (`[.., k]`):
    /// each block of the quantized row is dequantized into a register-sized
    /// buffer once and used for every row of `a`.
    fn dot_rows(q: GgmlType, row: &[u8], padded: usize, a: &[f32], k: usize, sums: &mut [f32]) {
        let per = q.block().0;
        let mut w = [0f32; 256];
        // 32 sums per row of `a`: four independent AVX2 chains.
        let mut acc = [[0f32; 32]; SMALL_M];
        let half = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        for (bi, blk) in row.chunks_exact(padded).enumerate() {
            // The common 32-element types written out with fixed-size
            // arrays, so that this AVX2 copy vectorizes them (an iterator
            // adaptor would be a separate baseline-compiled function).
            match q {
                GgmlType::Q4_1 => {
                    let (d, m) = (half(blk, 0), half(blk, 2));
                    let qs: &[u8; 16] = blk[4..20].try_into().expect("a Q4_1 block");
                    for j in 0..16 {
                        w[j] = d * (qs[j] & 0xF) as f32 + m;
                        w[j + 16] = d * (qs[j] >> 4) as f32 + m;
                    }
                }
                GgmlType::Q4_0 => {
                    let d = half(blk, 0);
                    let qs: &[u8; 16] = blk[2..18].try_into().expect("a Q4_0 block");
                    for j in 0..16 {
                        w[j] = d * ((qs[j] & 0xF) as i8 - 8) as f32;
                        w[j + 16] = d * ((qs[j] >> 4) as i8 - 8) as f32;
                    }
                }
                GgmlType::Q8_0 => {
                    let d = half(blk, 0);
                    let qs: &[u8; 32] = blk[2..34].try_into().expect("a Q8_0 block");
                    for j in 0..32 {
                        w[j] = qs[j] as i8 as f32 * d;
                    }
                }
                _ => crate::quant::dequantize_block(q, blk, &mut w[..per]),
            }
            for (i, acc) in acc.iter_mut().enumerate().take(sums.len()) {
                let x = &a[i * k + bi * per..i * k + (bi + 1) * per];
                for c in 0..per / 32 {
                    let xc: &[f32; 32] = x[c * 32..c * 32 + 32].try_into().expect("32");
                    let wc: &[f32; 32] = w[c * 32..c * 32 + 32].try_into().expect("32");
                    for l in 0..32 {
                        acc[l] += xc[l] * wc[l];
                    }
                }
            }
        }
        for (s, acc) in sums.iter_mut().zip(&acc) {
            *s = acc.iter().sum();
        }
    }
);

/// Rows of the weight dequantized at once: a tile of 64 rows of 4096
/// elements is 1 MiB, which stays in L2 while it is used.
const TILE_ROWS: usize = 64;

/// `a [m, k] @ w.t()` for a quantized `w` `[n, k]`, in f32.
pub(crate) fn matmul(a: &View, w: &View, q: GgmlType, m: usize, k: usize, n: usize, inputs: &[&CpuStorage]) -> CpuStorage {
    let CpuStorage::F32(x) = input(a, inputs) else { unreachable!("the scheduler gives a quantized matmul f32 rows") };
    let (rs, cs) = (a.layout.strides()[0], a.layout.strides()[1]);
    // Rows of `a`, contiguous (they almost always are already).
    let xs: Vec<f32> = if cs == 1 && rs == k { x[a.layout.offset..a.layout.offset + m * k].to_vec() } else { (0..m * k).map(|i| x[a.layout.offset + (i / k) * rs + (i % k) * cs]).collect() };
    let b = Blocks::new(w, inputs, q, k);
    let mut out = super::pool::take_zeroed(crate::DType::F32, m * n);
    let CpuStorage::F32(o) = &mut out else { unreachable!("f32 output") };
    if m == 0 || n == 0 || k == 0 {
        return out;
    }
    let dst = SendPtr(o.as_mut_ptr());
    // A few rows (decode): integer dot products with 16-bit activations
    // where the type has a kernel (see qdot.rs).
    let int_rows = (m <= SMALL_M && super::qdot::supports(q)).then(|| super::qdot::QuantRows::new(&xs, m, k));
    // Decode tiles are smaller, so that the two or more threads get even
    // shares of a 576-row matrix (64-row tiles left one thread 5 of 9).
    let tile_rows = if m <= SMALL_M { (n / (8 * super::threads())).clamp(8, TILE_ROWS) } else { TILE_ROWS };
    let tiles = n.div_ceil(tile_rows);
    (0..tiles).into_par_iter().for_each_init(Vec::new, |buf: &mut Vec<f32>, t| {
        let (r0, r1) = (t * tile_rows, ((t + 1) * tile_rows).min(n));
        if m <= SMALL_M {
            // Each weight row against every row of `a`: integer dots, or its
            // blocks dequantized into registers one at a time.
            buf.resize((r1 - r0) * m, 0.0);
            match &int_rows {
                Some(qx) => {
                    let w = super::qdot::WeightRows { bytes: &b.bytes[r0 * b.row_bytes..], nrows: r1 - r0, row_bytes: b.row_bytes, padded: b.padded };
                    super::qdot::dot_rows(b.q, &w, qx, buf);
                }
                None => {
                    for (j, sums) in (r0..r1).zip(buf.chunks_exact_mut(m)) {
                        dot_rows(b.q, b.row_bytes(j), b.padded, &xs, k, sums);
                    }
                }
            }
            for (j, sums) in (r0..r1).zip(buf.chunks_exact(m)) {
                for (i, v) in sums.iter().enumerate() {
                    // SAFETY: tiles write disjoint columns of `out`.
                    unsafe { *dst.get().add(i * n + j) = *v };
                }
            }
        } else {
            buf.resize((r1 - r0) * k, 0.0);
            for (i, row) in buf.chunks_exact_mut(k).enumerate() {
                b.row(r0 + i, row);
            }
            // SAFETY: this tile writes columns r0..r1 of every row of `out`
            // ([m, n], row stride n), which no other tile writes; `xs` is
            // [m, k] and `buf` [r1 - r0, k], both contiguous.
            unsafe {
                super::matmul::product(m, r1 - r0, k, (dst.get().add(r0), n as isize, 1), (xs.as_ptr(), k as isize, 1), (buf.as_ptr(), 1, k as isize), 0.0, 1.0, gemm::Parallelism::None)
            }
        }
    });
    out
}
