//! Integer dot products of block-quantized weight rows (Q4_0, Q4_1, Q8_0)
//! with activations quantized to 16 bits per block of 32, the decode
//! kernel of the CPU (a few rows of activations against every weight row).
//!
//! llama.cpp quantizes activations to 8 bits (Q8_1) and multiplies with
//! `maddubs`; this uses 16-bit activations and `madd_epi16` instead: about
//! the same instructions per block on AVX2 (a widening of the weight bytes
//! replaces `maddubs`), and an activation error of 2^-16 of its block's
//! largest value rather than 2^-8. SmolLM2's first-step logits stay within
//! 5e-3 of the float64 reference (4e-5 through f32 dot products, which
//! run at a quarter of the speed). The block's
//! scale and offset terms are applied in f32:
//!
//! `sum_j (d q_j + m) x_j  =  d * da * sum_j c_j a_j  +  (m + 8d) * sum_j x_j`,
//! with `x_j ~ da * a_j`, `a_j` an i16, `sum_j x_j` exact, and the 4-bit
//! values centred, `c_j = q_j - 8`: each activation's rounding error is
//! multiplied by its weight, and centred weights are half the size (the
//! logit error fell from 2.1e-2 to 5e-3).

use crate::quant::GgmlType;

/// Elements per block of the types these kernels take.
const BLOCK: usize = 32;

/// Whether `q` has an integer kernel here.
pub(crate) fn supports(q: GgmlType) -> bool {
    matches!(q, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Rows of activations quantized per block of 32: `a` the i16 values,
/// `d` each block's scale (`x ~ d * a`), `sum` each block's exact sum of `x`.
pub(crate) struct QuantRows {
    a: Vec<i16>,
    d: Vec<f32>,
    sum: Vec<f32>,
    /// Elements per row (a multiple of 32).
    k: usize,
    rows: usize,
}

impl QuantRows {
    /// Quantize `rows` rows of `x` (`[rows, k]`, contiguous; `k` a multiple of 32).
    pub(crate) fn new(x: &[f32], rows: usize, k: usize) -> QuantRows {
        debug_assert!(k.is_multiple_of(BLOCK) && x.len() >= rows * k);
        let blocks = rows * k / BLOCK;
        let mut q = QuantRows { a: vec![0; rows * k], d: vec![0.0; blocks], sum: vec![0.0; blocks], k, rows };
        for (b, (xs, a)) in x[..rows * k].chunks_exact(BLOCK).zip(q.a.chunks_exact_mut(BLOCK)).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 32767.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (a, &v) in a.iter_mut().zip(xs) {
                *a = (v * inv).round() as i16;
            }
            q.d[b] = d;
            q.sum[b] = xs.iter().sum();
        }
        q
    }
}

/// `sums[i] = x_i . w` for every row `x_i` of `x` and the weight row `row`
/// (padded blocks of `q`, `padded` bytes each).
pub(crate) fn dot_rows(q: GgmlType, row: &[u8], padded: usize, x: &QuantRows, sums: &mut [f32]) {
    debug_assert!(supports(q) && sums.len() == x.rows && row.len() >= x.k / BLOCK * padded);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU was just checked for every feature the function enables;
        // the slices' lengths are what the debug assertion states, which the
        // callers (QTensor's shape checks) guarantee.
        unsafe { avx2::dot_rows(q, row, padded, x, sums) };
        return;
    }
    dot_rows_portable(q, row, padded, x, sums)
}

/// The same sums in plain Rust (other CPUs; the reference of the tests).
pub(crate) fn dot_rows_portable(q: GgmlType, row: &[u8], padded: usize, x: &QuantRows, sums: &mut [f32]) {
    let nb = x.k / BLOCK;
    let half = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    sums.iter_mut().for_each(|s| *s = 0.0);
    for (b, blk) in row.chunks_exact(padded).take(nb).enumerate() {
        // (integer weights, scale, offset per element)
        // Nibbles centred: q - 8 (see the module docs).
        let nibbles = |at: usize| -> [i32; BLOCK] { std::array::from_fn(|j| (if j < 16 { blk[at + j] & 0xF } else { blk[at + j - 16] >> 4 }) as i32 - 8) };
        let (w, d, m): ([i32; BLOCK], f32, f32) = match q {
            GgmlType::Q4_1 => (nibbles(4), half(blk, 0), half(blk, 2) + 8.0 * half(blk, 0)),
            GgmlType::Q4_0 => (nibbles(2), half(blk, 0), 0.0),
            GgmlType::Q8_0 => (std::array::from_fn(|j| blk[2 + j] as i8 as i32), half(blk, 0), 0.0),
            _ => unreachable!("dot_rows takes {} only when supports() says so", q.name()),
        };
        for (i, s) in sums.iter_mut().enumerate() {
            let a = &x.a[(i * nb + b) * BLOCK..][..BLOCK];
            let dot: i32 = w.iter().zip(a).map(|(&w, &a)| w * a as i32).sum();
            *s += d * x.d[i * nb + b] * dot as f32 + m * x.sum[i * nb + b];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{QuantRows, BLOCK};
    use crate::quant::GgmlType;
    use std::arch::x86_64::*;

    /// Horizontal sum of 8 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// Two f16 at `p` as f32 (the block's scale and, for Q4_1, its minimum).
    #[inline(always)]
    unsafe fn two_halves(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// The 32 weights of a block as two vectors of 16 i16 (elements 0..16, 16..32),
    /// its scale, and the offset added to every element.
    #[inline(always)]
    unsafe fn weights(q: GgmlType, blk: *const u8) -> (__m256i, __m256i, f32, f32) {
        match q {
            GgmlType::Q8_0 => {
                let (d, _) = two_halves(blk);
                let lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(2) as *const __m128i));
                let hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(18) as *const __m128i));
                (lo, hi, d, 0.0)
            }
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                // Nibbles centred (q - 8): the activations' rounding errors
                // then meet weights half the size (see the module docs).
                let (at, (d, m)) = if q == GgmlType::Q4_1 { (4, two_halves(blk)) } else { (2, (two_halves(blk).0, 0.0)) };
                let m = if q == GgmlType::Q4_1 { m + 8.0 * d } else { 0.0 };
                let raw = _mm_loadu_si128(blk.add(at) as *const __m128i);
                let mask = _mm_set1_epi8(0x0F);
                let eight = _mm256_set1_epi16(8);
                let lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(raw, mask)), eight);
                let hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)), eight);
                (lo, hi, d, m)
            }
            _ => unreachable!("checked by supports()"),
        }
    }

    /// Dispatch on the number of activation rows, so that each count gets
    /// a copy whose accumulators live in registers.
    #[target_feature(enable = "avx,avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows(q: GgmlType, row: &[u8], padded: usize, x: &QuantRows, sums: &mut [f32]) {
        macro_rules! by_rows {
            ($($r:literal)*) => {
                match sums.len() {
                    $($r => dot_rows_n::<$r>(q, row, padded, x, sums),)*
                    _ => unreachable!("at most {MAX_ROWS} rows"),
                }
            };
        }
        by_rows!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }

    /// Most activation rows handled at once (the callers' SMALL_M).
    const MAX_ROWS: usize = 16;

    #[target_feature(enable = "avx,avx2,fma,f16c")]
    unsafe fn dot_rows_n<const R: usize>(q: GgmlType, row: &[u8], padded: usize, x: &QuantRows, sums: &mut [f32]) {
        let nb = x.k / BLOCK;
        // Two accumulators a row (even and odd blocks): one FMA chain would
        // wait on the previous block's.
        let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        let (mut off0, mut off1) = ([0f32; R], [0f32; R]);
        let (a, ds, ss) = (x.a.as_ptr(), x.d.as_ptr(), x.sum.as_ptr());
        // Block `b` into the accumulators `acc`, `off`.
        #[inline(always)]
        unsafe fn step<const R: usize>(q: GgmlType, blk: *const u8, b: usize, nb: usize, (a, ds, ss): (*const i16, *const f32, *const f32), acc: &mut [__m256; R], off: &mut [f32; R]) {
            let (lo, hi, d, m) = weights(q, blk);
            for i in 0..R {
                let at = i * nb + b;
                let p = a.add(at * BLOCK) as *const __m256i;
                let dot = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(p)), _mm256_madd_epi16(hi, _mm256_loadu_si256(p.add(1))));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * *ds.add(at)), acc[i]);
                off[i] += m * *ss.add(at);
            }
        }
        let ptrs = (a, ds, ss);
        let mut b = 0;
        while b + 1 < nb {
            step::<R>(q, row.as_ptr().add(b * padded), b, nb, ptrs, &mut acc0, &mut off0);
            step::<R>(q, row.as_ptr().add((b + 1) * padded), b + 1, nb, ptrs, &mut acc1, &mut off1);
            b += 2;
        }
        if b < nb {
            step::<R>(q, row.as_ptr().add(b * padded), b, nb, ptrs, &mut acc0, &mut off0);
        }
        let (acc, off) = ([acc0, acc1], [off0, off1]);
        for i in 0..R {
            sums[i] = hsum(_mm256_add_ps(acc[0][i], acc[1][i])) + off[0][i] + off[1][i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every supported type: the integer kernel (AVX2 where the CPU has it)
    /// against the portable one and against f64 sums over the dequantized
    /// weights, on random rows: the 16-bit activations keep the error
    /// under 5e-5 of the sum of |x w| (1e-5 measured).
    #[test]
    fn integer_dots_match_f64() {
        let mut g = crate::Generator::new(5);
        for q in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for (rows, k) in [(1, 32), (3, 96), (16, 576)] {
                let w: Vec<f32> = g.normal(k).iter().map(|v| *v as f32).collect();
                let blocks = crate::quant::quantize(q, &w).expect("quantize");
                let padded = q.padded_block_bytes();
                let mut row = vec![0u8; k / 32 * padded];
                for (dst, src) in row.chunks_exact_mut(padded).zip(blocks.chunks_exact(q.block().1)) {
                    dst[..src.len()].copy_from_slice(src);
                }
                let mut wd = vec![0f32; k];
                crate::quant::dequantize_strided(q, &row, padded, &mut wd);
                let x: Vec<f32> = g.normal(rows * k).iter().map(|v| (*v * 3.0) as f32).collect();
                let qx = QuantRows::new(&x, rows, k);
                let (mut fast, mut slow) = (vec![0f32; rows], vec![0f32; rows]);
                dot_rows(q, &row, padded, &qx, &mut fast);
                dot_rows_portable(q, &row, padded, &qx, &mut slow);
                for i in 0..rows {
                    let exact: f64 = (0..k).map(|j| x[i * k + j] as f64 * wd[j] as f64).sum();
                    let scale: f64 = (0..k).map(|j| (x[i * k + j] as f64 * wd[j] as f64).abs()).sum();
                    for (name, got) in [("kernel", fast[i]), ("portable", slow[i])] {
                        let err = (got as f64 - exact).abs();
                        assert!(err <= 5e-5 * scale + 1e-6, "{} {rows}x{k} row {i} {name}: {got} vs {exact} (error {err}, scale {scale})", q.name());
                    }
                }
            }
        }
    }
}
