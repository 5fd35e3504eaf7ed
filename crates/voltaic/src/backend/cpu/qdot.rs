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
/// `d` each block's scale (`x ~ d * a`), `sum` each block's exact sum of
/// `x`, and `c8` = `8 d sum(a)`, the centring term of the 4-bit types.
///
/// The kernels multiply the stored (uncentred) nibbles and subtract the
/// centring afterwards: `sum (q - 8) a = sum q a - 8 sum a`, so the result
/// is the centred one of the module docs (up to f32 rounding of the two
/// scaled terms, 2^-24 of the uncentred sum, far below the activations'
/// 2^-16) with two instructions a block fewer. A block holding a NaN gets
/// a NaN scale, so that the NaN reaches every sum it is part of.
pub(crate) struct QuantRows {
    a: Vec<i16>,
    d: Vec<f32>,
    sum: Vec<f32>,
    c8: Vec<f32>,
    /// Elements per row (a multiple of 32).
    k: usize,
    rows: usize,
}

impl QuantRows {
    /// Quantize `rows` rows of `x` (`[rows, k]`, contiguous; `k` a multiple of 32).
    pub(crate) fn new(x: &[f32], rows: usize, k: usize) -> QuantRows {
        debug_assert!(k.is_multiple_of(BLOCK) && x.len() >= rows * k);
        let blocks = rows * k / BLOCK;
        let mut q = QuantRows { a: vec![0; rows * k], d: vec![0.0; blocks], sum: vec![0.0; blocks], c8: vec![0.0; blocks], k, rows };
        for (b, (xs, a)) in x[..rows * k].chunks_exact(BLOCK).zip(q.a.chunks_exact_mut(BLOCK)).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sum: f32 = xs.iter().sum();
            // `max` skips NaN, and a NaN rounds to the integer 0: the sum
            // says whether the block holds one (or +inf with -inf, whose
            // products are NaN through the infinite scale anyway).
            let d = if sum.is_nan() { f32::NAN } else { amax / 32767.0 };
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (a, &v) in a.iter_mut().zip(xs) {
                *a = (v * inv).round() as i16;
            }
            q.d[b] = d;
            q.sum[b] = sum;
            q.c8[b] = (8.0 * d as f64 * a.iter().map(|&v| v as i64).sum::<i64>() as f64) as f32;
        }
        q
    }
}

/// How the weight rows of a quantized matrix lie in memory: `nrows` rows
/// from `bytes`, `row_bytes` apart, in blocks of `padded` bytes.
pub(crate) struct WeightRows<'a> {
    pub bytes: &'a [u8],
    pub nrows: usize,
    pub row_bytes: usize,
    pub padded: usize,
}

/// `sums[j * x.rows + i] = x_i . w_j` for every weight row `w_j` of `w`
/// and every row `x_i` of `x`.
pub(crate) fn dot_rows(q: GgmlType, w: &WeightRows, x: &QuantRows, sums: &mut [f32]) {
    dot_rows_on(Isa::best(), q, w, x, sums)
}

/// The instruction sets the kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 (BW, VL) with VNNI: the AVX2 body with 32 registers and
    /// `vpdpwssd` for the multiply-adds.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Isa {
    /// The fastest set this CPU has (checked once).
    pub(crate) fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Isa::available().into_iter().last().unwrap_or(Isa::Portable))
    }

    /// Every set this CPU runs, slowest first.
    pub(crate) fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                v.push(Isa::Avx2);
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                    v.push(Isa::Avx512Vnni);
                }
            }
        }
        v
    }
}

/// [`dot_rows`] with a chosen instruction set (the tests run each one the CPU has).
pub(crate) fn dot_rows_on(isa: Isa, q: GgmlType, w: &WeightRows, x: &QuantRows, sums: &mut [f32]) {
    assert!(supports(q) && sums.len() == w.nrows * x.rows && (1..=MAX_ROWS).contains(&x.rows), "dot_rows: {} rows of {} against {} activation rows", w.nrows, q.name(), x.rows);
    if w.nrows == 0 {
        return;
    }
    // Every read ends within the last row's blocks (checked arithmetic: the
    // unsafe kernels rely on this bound).
    let needed = (w.nrows - 1).checked_mul(w.row_bytes).and_then(|b| b.checked_add(x.k / BLOCK * w.padded));
    assert!(w.padded >= q.block().1 && w.row_bytes >= x.k / BLOCK * w.padded && needed.is_some_and(|n| w.bytes.len() >= n), "dot_rows: {} bytes for {} rows of {} bytes", w.bytes.len(), w.nrows, w.row_bytes);
    match isa {
        Isa::Portable => dot_rows_portable(q, w, x, sums),
        // SAFETY: `Isa::available` lists these only where the CPU has every
        // feature they enable; the assertions above bound every read.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2(q, w, x, sums) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { x86::avx512(q, w, x, sums) },
    }
}

/// Most activation rows handled at once (the callers' SMALL_M).
pub(crate) const MAX_ROWS: usize = 16;

/// The same sums in plain Rust (other CPUs; the reference of the tests),
/// with the nibbles centred before the product.
fn dot_rows_portable(q: GgmlType, w: &WeightRows, x: &QuantRows, sums: &mut [f32]) {
    let nb = x.k / BLOCK;
    let half = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    sums.iter_mut().for_each(|s| *s = 0.0);
    for (j, sums) in sums.chunks_exact_mut(x.rows).enumerate() {
        let row = &w.bytes[j * w.row_bytes..];
        for (b, blk) in row.chunks_exact(w.padded).take(nb).enumerate() {
            // (integer weights, scale, offset per element)
            let nibbles = |at: usize| -> [i32; BLOCK] { std::array::from_fn(|j| (if j < 16 { blk[at + j] & 0xF } else { blk[at + j - 16] >> 4 }) as i32 - 8) };
            let (wq, d, m): ([i32; BLOCK], f32, f32) = match q {
                GgmlType::Q4_1 => (nibbles(4), half(blk, 0), half(blk, 2) + 8.0 * half(blk, 0)),
                GgmlType::Q4_0 => (nibbles(2), half(blk, 0), 0.0),
                GgmlType::Q8_0 => (std::array::from_fn(|j| blk[2 + j] as i8 as i32), half(blk, 0), 0.0),
                _ => unreachable!("dot_rows takes {} only when supports() says so", q.name()),
            };
            for (i, s) in sums.iter_mut().enumerate() {
                let a = &x.a[(i * nb + b) * BLOCK..][..BLOCK];
                let dot: i32 = wq.iter().zip(a).map(|(&w, &a)| w * a as i32).sum();
                *s += d * x.d[i * nb + b] * dot as f32 + m * x.sum[i * nb + b];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{QuantRows, WeightRows, BLOCK};
    use crate::quant::GgmlType;
    use std::arch::x86_64::*;

    /// The types, as const parameters.
    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// Bytes ahead of the block being read that each row prefetches: at
    /// 2048 a weight matrix read from memory runs as fast as one in cache
    /// (7 cycles a block on the 2-core Xeon, against 11 without).
    const PREFETCH: usize = 2048;

    /// Horizontal sum of 8 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// A block's scale and (Q4_1) minimum: the two f16 at its start.
    #[inline(always)]
    unsafe fn header<const Q: u8>(blk: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(blk as *const i32)));
        (_mm_cvtss_f32(v), if Q == Q4_1 { _mm_cvtss_f32(_mm_movehdup_ps(v)) } else { 0.0 })
    }

    /// The 32 weights of a block as two vectors of 16 i16 (elements 0..16,
    /// 16..32); 4-bit values uncentred (0..15).
    #[inline(always)]
    unsafe fn weights<const Q: u8>(blk: *const u8) -> (__m256i, __m256i) {
        if Q == Q8_0 {
            (_mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(2) as *const __m128i)), _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(18) as *const __m128i)))
        } else {
            // Byte j holds element j (low nibble) and j + 16 (high): widened
            // to 16 bits, a mask and a shift split them.
            let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(blk.add(if Q == Q4_1 { 4 } else { 2 }) as *const __m128i));
            (_mm256_and_si256(v, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(v, 4))
        }
    }

    /// `W` weight rows against `R` activation rows: `sums[j * R + i]`;
    /// `V`: VNNI's fused multiply-add of 16-bit pairs.
    /// Per block and pair: the integer dot in eight i32 lanes, scaled into
    /// an f32 accumulator; the offsets (`m sum x`, the centring) in scalars.
    #[inline(always)]
    unsafe fn rows<const V: bool, const Q: u8, const R: usize, const W: usize>(w: *const u8, row_bytes: usize, padded: usize, x: &QuantRows, sums: *mut f32) {
        let nb = x.k / BLOCK;
        let (a, ds, ss, cs) = (x.a.as_ptr(), x.d.as_ptr(), x.sum.as_ptr(), x.c8.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); R]; W];
        // Two scalar chains a pair (centring, minimum): one would wait on the other.
        let (mut oc, mut om) = ([[0f32; R]; W], [[0f32; R]; W]);
        for b in 0..nb {
            let mut alo = [_mm256_setzero_si256(); R];
            let mut ahi = [_mm256_setzero_si256(); R];
            for i in 0..R {
                let p = a.add((i * nb + b) * BLOCK) as *const __m256i;
                alo[i] = _mm256_loadu_si256(p);
                ahi[i] = _mm256_loadu_si256(p.add(1));
            }
            for j in 0..W {
                let blk = w.add(j * row_bytes + b * padded);
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH) as *const i8);
                let (d, m) = header::<Q>(blk);
                let (lo, hi) = weights::<Q>(blk);
                for i in 0..R {
                    let at = i * nb + b;
                    let dot = if V { _mm256_dpwssd_epi32(_mm256_madd_epi16(lo, alo[i]), hi, ahi[i]) } else { _mm256_add_epi32(_mm256_madd_epi16(lo, alo[i]), _mm256_madd_epi16(hi, ahi[i])) };
                    acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * *ds.add(at)), acc[j][i]);
                    // sum (d q + m) x = d da sum q a - d c8 + (m + 8 d) sum x
                    // (Q4_1); Q4_0 has no minimum, Q8_0 no centring.
                    if Q == Q4_1 {
                        oc[j][i] = d.mul_add(8.0 * *ss.add(at) - *cs.add(at), oc[j][i]);
                        om[j][i] = m.mul_add(*ss.add(at), om[j][i]);
                    } else if Q == Q4_0 {
                        oc[j][i] = d.mul_add(-*cs.add(at), oc[j][i]);
                    }
                }
            }
        }
        for j in 0..W {
            for i in 0..R {
                *sums.add(j * R + i) = hsum(acc[j][i]) + oc[j][i] + om[j][i];
            }
        }
    }

    /// Every weight row, `W` at a time, then the rest one at a time.
    #[inline(always)]
    unsafe fn tile<const V: bool, const Q: u8, const R: usize, const W: usize>(w: &WeightRows, x: &QuantRows, sums: &mut [f32]) {
        let (p, out) = (w.bytes.as_ptr(), sums.as_mut_ptr());
        let mut j = 0;
        while j + W <= w.nrows {
            rows::<V, Q, R, W>(p.add(j * w.row_bytes), w.row_bytes, w.padded, x, out.add(j * R));
            j += W;
        }
        while j < w.nrows {
            rows::<V, Q, R, 1>(p.add(j * w.row_bytes), w.row_bytes, w.padded, x, out.add(j * R));
            j += 1;
        }
    }

    /// Dispatch on the type and the number of activation rows, so that each
    /// gets a copy whose accumulators live in registers; one activation row
    /// (decode) takes four weight rows at a time, sharing its loads.
    #[inline(always)]
    unsafe fn dispatch<const V: bool>(q: GgmlType, w: &WeightRows, x: &QuantRows, sums: &mut [f32]) {
        macro_rules! by_rows {
            ($Q:expr; $($r:literal => $w:literal),*) => {
                match x.rows {
                    $($r => tile::<V, { $Q }, $r, $w>(w, x, sums),)*
                    _ => unreachable!("at most {} rows", super::MAX_ROWS),
                }
            };
        }
        macro_rules! by_type {
            ($($Q:expr),*) => {{
                let t = match q { GgmlType::Q4_0 => Q4_0, GgmlType::Q4_1 => Q4_1, GgmlType::Q8_0 => Q8_0, _ => unreachable!("checked by supports()") };
                $(if t == $Q { by_rows!($Q; 1 => 4, 2 => 2, 3 => 2, 4 => 1, 5 => 1, 6 => 1, 7 => 1, 8 => 1, 9 => 1, 10 => 1, 11 => 1, 12 => 1, 13 => 1, 14 => 1, 15 => 1, 16 => 1); })*
            }};
        }
        by_type!(Q4_0, Q4_1, Q8_0)
    }

    #[target_feature(enable = "avx,avx2,fma,f16c")]
    pub(super) unsafe fn avx2(q: GgmlType, w: &WeightRows, x: &QuantRows, sums: &mut [f32]) {
        dispatch::<false>(q, w, x, sums)
    }

    #[target_feature(enable = "avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn avx512(q: GgmlType, w: &WeightRows, x: &QuantRows, sums: &mut [f32]) {
        dispatch::<true>(q, w, x, sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every supported type and every instruction set this CPU runs: the
    /// integer kernel against f64 sums over the dequantized weights, on
    /// random rows, with weight-row counts that take the four-row path and
    /// its remainder: the 16-bit activations keep the error under 5e-5 of
    /// the sum of |x w| (1e-5 measured).
    #[test]
    fn integer_dots_match_f64() {
        let mut g = crate::Generator::new(5);
        for q in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for (rows, k, n) in [(1, 32, 1), (1, 96, 7), (2, 64, 5), (3, 96, 3), (5, 160, 2), (16, 576, 3)] {
                let wf: Vec<f32> = g.normal(n * k).iter().map(|v| *v as f32).collect();
                let blocks = crate::quant::quantize(q, &wf).expect("quantize");
                let padded = q.padded_block_bytes();
                // Rows padded further apart than their blocks, as a view's rows may be.
                let row_bytes = k / 32 * padded + 8;
                let mut bytes = vec![0u8; n * row_bytes];
                for (b, src) in blocks.chunks_exact(q.block().1).enumerate() {
                    let at = (b / (k / 32)) * row_bytes + (b % (k / 32)) * padded;
                    bytes[at..at + src.len()].copy_from_slice(src);
                }
                let mut wd = vec![0f32; n * k];
                for (j, out) in wd.chunks_exact_mut(k).enumerate() {
                    crate::quant::dequantize_strided(q, &bytes[j * row_bytes..], padded, out);
                }
                let x: Vec<f32> = g.normal(rows * k).iter().map(|v| (*v * 3.0) as f32).collect();
                let qx = QuantRows::new(&x, rows, k);
                let w = WeightRows { bytes: &bytes, nrows: n, row_bytes, padded };
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; n * rows];
                    dot_rows_on(isa, q, &w, &qx, &mut got);
                    for j in 0..n {
                        for i in 0..rows {
                            let exact: f64 = (0..k).map(|c| x[i * k + c] as f64 * wd[j * k + c] as f64).sum();
                            let scale: f64 = (0..k).map(|c| (x[i * k + c] as f64 * wd[j * k + c] as f64).abs()).sum();
                            let v = got[j * rows + i];
                            let err = (v as f64 - exact).abs();
                            assert!(err <= 5e-5 * scale + 1e-6, "{} {isa:?} {rows}x{k} against {n} rows, ({j}, {i}): {v} vs {exact} (error {err}, scale {scale})", q.name());
                        }
                    }
                }
            }
        }
    }

    /// A NaN activation makes every sum it is part of NaN, for every type
    /// and instruction set (`max` skips NaN and a NaN rounds to 0: the
    /// kernels of types that read no block sums once returned a number).
    #[test]
    fn nan_activations_propagate() {
        let mut g = crate::Generator::new(3);
        let (k, n) = (96, 5);
        for q in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let wf: Vec<f32> = g.normal(n * k).iter().map(|v| *v as f32).collect();
            let blocks = crate::quant::quantize(q, &wf).expect("quantize");
            let padded = q.padded_block_bytes();
            let mut bytes = vec![0u8; n * k / 32 * padded];
            for (b, src) in blocks.chunks_exact(q.block().1).enumerate() {
                bytes[b * padded..b * padded + src.len()].copy_from_slice(src);
            }
            let mut x: Vec<f32> = g.normal(2 * k).iter().map(|v| *v as f32).collect();
            x[k + 40] = f32::NAN;
            let qx = QuantRows::new(&x, 2, k);
            let w = WeightRows { bytes: &bytes, nrows: n, row_bytes: k / 32 * padded, padded };
            for isa in Isa::available() {
                let mut got = vec![0f32; n * 2];
                dot_rows_on(isa, q, &w, &qx, &mut got);
                for j in 0..n {
                    assert!(got[j * 2].is_finite() && got[j * 2 + 1].is_nan(), "{} {isa:?} row {j}: {} and {}", q.name(), got[j * 2], got[j * 2 + 1]);
                }
            }
        }
    }

    /// The kernels and the portable code compute the same centred sums: on
    /// inputs with one huge activation a block (as LLM activations have),
    /// they agree far closer than either is to the exact sum.
    #[test]
    fn instruction_sets_agree() {
        let mut g = crate::Generator::new(9);
        let (k, n) = (256, 9);
        let q = GgmlType::Q4_1;
        let wf: Vec<f32> = g.normal(n * k).iter().map(|v| *v as f32).collect();
        let bytes = crate::quant::quantize(q, &wf).expect("quantize");
        let mut x: Vec<f32> = g.normal(k).iter().map(|v| *v as f32).collect();
        for b in 0..k / 32 {
            x[b * 32 + b % 32] = 300.0;
        }
        let qx = QuantRows::new(&x, 1, k);
        let w = WeightRows { bytes: &bytes, nrows: n, row_bytes: k / 32 * 20, padded: 20 };
        let mut base = vec![0f32; n];
        dot_rows_on(Isa::Portable, q, &w, &qx, &mut base);
        for isa in Isa::available() {
            let mut got = vec![0f32; n];
            dot_rows_on(isa, q, &w, &qx, &mut got);
            for (a, b) in got.iter().zip(&base) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{isa:?}: {a} vs portable {b}");
            }
        }
    }
}
