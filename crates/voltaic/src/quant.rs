//! Block-quantized element types (ggml's, as GGUF files store them) and
//! their dequantization to f32.
//!
//! A quantized tensor is a sequence of blocks; each block holds a fixed
//! number of elements as small integers and one or more f16 scales:
//!
//! | type | elements | bytes | value |
//! |---|---:|---:|---|
//! | Q8_0 | 32 | 34 | `d * q`, q an i8 |
//! | Q4_0 | 32 | 18 | `d * (q - 8)`, q a nibble |
//! | Q4_1 | 32 | 20 | `d * q + m` |
//! | Q4_K | 256 | 144 | 8 sub-blocks of 32 with 6-bit scales and mins: `d * sc * q - dmin * mn` |
//! | Q6_K | 256 | 210 | 16 sub-blocks of 16 with i8 scales, 6-bit q: `d * sc * (q - 32)` |
//!
//! The arithmetic is done in f32 in the same order as ggml's reference
//! (and the PyPI `gguf` package's numpy code), so results agree bit for bit.

use crate::error::{Error, Result};
use half::{bf16, f16};

/// The ggml element types a GGUF tensor may have, with their block layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // named as in ggml
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
}

/// Every type once: ggml's id, its name, (elements per block, bytes per block).
const TYPES: [(GgmlType, u32, &str, (usize, usize)); 20] = {
    use GgmlType::*;
    [
        (F32, 0, "F32", (1, 4)),
        (F16, 1, "F16", (1, 2)),
        (Q4_0, 2, "Q4_0", (32, 18)),
        (Q4_1, 3, "Q4_1", (32, 20)),
        (Q5_0, 6, "Q5_0", (32, 22)),
        (Q5_1, 7, "Q5_1", (32, 24)),
        (Q8_0, 8, "Q8_0", (32, 34)),
        (Q8_1, 9, "Q8_1", (32, 36)),
        (Q2K, 10, "Q2_K", (256, 84)),
        (Q3K, 11, "Q3_K", (256, 110)),
        (Q4K, 12, "Q4_K", (256, 144)),
        (Q5K, 13, "Q5_K", (256, 176)),
        (Q6K, 14, "Q6_K", (256, 210)),
        (Q8K, 15, "Q8_K", (256, 292)),
        (I8, 24, "I8", (1, 1)),
        (I16, 25, "I16", (1, 2)),
        (I32, 26, "I32", (1, 4)),
        (I64, 27, "I64", (1, 8)),
        (F64, 28, "F64", (1, 8)),
        (BF16, 30, "BF16", (1, 2)),
    ]
};

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, (usize, usize)) {
        TYPES.iter().find(|t| t.0 == self).expect("every type is in TYPES")
    }

    /// The type of ggml's numeric id, if Voltaic knows it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|t| t.1 == id).map(|t| t.0)
    }

    /// ggml's numeric id of the type.
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        self.entry().3
    }

    /// ggml's name for the type.
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Bytes of one block as a quantized tensor stores it on a device: the
    /// block's bytes unchanged, padded to whole 32-bit words so that every
    /// block (and every f16 scale in it) starts on a word boundary for GPU
    /// kernels, which read memory in words (Q8_0: 34 -> 36, Q6_K: 210 -> 212).
    pub fn padded_block_bytes(self) -> usize {
        self.block().1.next_multiple_of(4)
    }

    /// Whether quantized tensors (`QTensor`) of this type exist:
    /// the block types that kernels multiply and gather without
    /// dequantizing the whole tensor first.
    pub fn is_block_quantized(self) -> bool {
        use GgmlType::*;
        matches!(self, Q8_0 | Q4_0 | Q4_1 | Q4K | Q6K)
    }

    /// Whether [`dequantize`] reads this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q4K | Q6K)
    }
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantize `bytes` (whole blocks of `ty`) into `out`, one f32 per element.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let (per_block, block_bytes) = ty.block();
    if !ty.can_dequantize() {
        return Err(Error::DType { op: "dequantize", msg: format!("{} tensors cannot be dequantized yet (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K can)", ty.name()) });
    }
    if !bytes.len().is_multiple_of(block_bytes) || bytes.len() / block_bytes * per_block != out.len() {
        return Err(Error::Value {
            op: "dequantize",
            msg: format!("{} bytes of {} ({block_bytes} per {per_block} elements) do not hold {} elements", bytes.len(), ty.name(), out.len()),
        });
    }
    dequantize_strided(ty, bytes, block_bytes, out);
    Ok(())
}

/// Dequantize blocks that start every `stride` bytes of `bytes` (padded
/// blocks, as a `QTensor` holds them, or packed ones) into `out`.
#[inline(always)]
pub(crate) fn dequantize_strided(ty: GgmlType, bytes: &[u8], stride: usize, out: &mut [f32]) {
    for (b, o) in bytes.chunks(stride).zip(out.chunks_exact_mut(ty.block().0)) {
        dequantize_block(ty, b, o);
    }
}

/// Dequantize one block of `ty` (a type [`GgmlType::can_dequantize`]
/// accepts) into its elements. Inlined into its callers, so that a caller
/// compiled for AVX2 (the CPU kernels' `simd_fn!`) vectorizes the block.
#[inline(always)]
pub(crate) fn dequantize_block(ty: GgmlType, b: &[u8], o: &mut [f32]) {
    match ty {
        GgmlType::F32 => o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => o[0] = half(b, 0),
        GgmlType::BF16 => o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q8_0 => q8_0(b, o),
        GgmlType::Q4_0 => q4_0(b, o),
        GgmlType::Q4_1 => q4_1(b, o),
        GgmlType::Q4K => q4_k(b, o),
        GgmlType::Q6K => q6_k(b, o),
        _ => unreachable!("{} is checked by can_dequantize", ty.name()),
    }
}

/// `[d: f16][q: 32 x i8]`.
#[inline(always)]
fn q8_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    for (o, &q) in o.iter_mut().zip(&b[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

/// `[d: f16][16 bytes]`: element `j` is the low nibble of byte `j`, element
/// `j + 16` its high nibble.
#[inline(always)]
fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = half(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        o[j] = d * ((q & 0xF) as i8 - 8) as f32;
        o[j + 16] = d * ((q >> 4) as i8 - 8) as f32;
    }
}

/// `[d: f16][m: f16][16 bytes]`, nibbles as in Q4_0, unsigned.
#[inline(always)]
fn q4_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        o[j] = d * (q & 0xF) as f32 + m;
        o[j + 16] = d * (q >> 4) as f32 + m;
    }
}

/// The 6-bit scale and min of sub-block `i` of a Q4_K block, packed in 12
/// bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
/// (mins); sub-blocks 4-7 in the nibbles of bytes 8-11 plus the top two bits
/// of bytes 0-7.
#[inline(always)]
fn scale_min(s: &[u8], i: usize) -> (u8, u8) {
    if i < 4 {
        (s[i] & 63, s[i + 4] & 63)
    } else {
        ((s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4), (s[i + 4] >> 4) | ((s[i] >> 6) << 4))
    }
}

/// `[d: f16][dmin: f16][scales: 12][qs: 128]`: four chunks of 32 bytes,
/// chunk `c`'s low nibbles are sub-block `2c`, its high nibbles `2c + 1`.
#[inline(always)]
fn q4_k(b: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    for c in 0..4 {
        let qs = &b[16 + 32 * c..48 + 32 * c];
        for (h, shift) in [(0, 0), (1, 4)] {
            let (sc, mn) = scale_min(scales, 2 * c + h);
            let (ds, dm) = (d * sc as f32, dmin * mn as f32);
            let out = &mut o[64 * c + 32 * h..64 * c + 32 * h + 32];
            for (o, &q) in out.iter_mut().zip(qs) {
                *o = ds * ((q >> shift) & 0xF) as f32 - dm;
            }
        }
    }
}

/// `[ql: 128][qh: 64][scales: 16 x i8][d: f16]`. Two halves of 128
/// elements; in half `h`, element `32k + l` (k = 0..4) takes the low
/// (k = 0, 1) or high (k = 2, 3) nibble of `ql[64h + 32(k % 2) + l]` and
/// bits `2k..2k+2` of `qh[32h + l]` as its top two bits; scale `e / 16`.
#[inline(always)]
fn q6_k(b: &[u8], o: &mut [f32]) {
    let d = half(b, 208);
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    for h in 0..2 {
        for k in 0..4 {
            let lo = &ql[64 * h + 32 * (k % 2)..64 * h + 32 * (k % 2) + 32];
            for l in 0..32 {
                let nib = if k < 2 { lo[l] & 0xF } else { lo[l] >> 4 };
                let q = (nib | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)) as i8 - 32;
                let e = 128 * h + 32 * k + l;
                o[e] = d * sc[e / 16] as i8 as f32 * q as f32;
            }
        }
    }
}

/// Quantize `x` (whole blocks of 32) to Q8_0, Q4_0 or Q4_1 bytes the way
/// ggml's reference quantizers do (`quantize_row_q8_0_ref`, ...), so that a
/// tensor quantized here and one from a GGUF file are the same kind of data.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    if !matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1) {
        return Err(Error::DType { op: "quantize", msg: format!("quantizing to {} is not supported (Q8_0, Q4_0 and Q4_1 are)", ty.name()) });
    }
    if !x.len().is_multiple_of(32) {
        return Err(Error::Shape { op: "quantize", msg: format!("{} elements are not whole blocks of 32", x.len()) });
    }
    let mut out = Vec::with_capacity(x.len() / 32 * ty.block().1);
    for b in x.chunks_exact(32) {
        match ty {
            GgmlType::Q8_0 => {
                let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
            GgmlType::Q4_0 => {
                // The value of largest magnitude, with its sign, maps to -8.
                let max = b.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
            _ => {
                let (min, max) = b.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_type_table_lists_each_type_and_id_once() {
        for (i, t) in TYPES.iter().enumerate() {
            assert_eq!(GgmlType::from_id(t.1), Some(t.0));
            assert!(TYPES[..i].iter().all(|u| u.0 != t.0 && u.1 != t.1 && u.2 != t.2), "{:?} twice", t.0);
        }
        assert_eq!(GgmlType::from_id(4), None, "ids 4 and 5 were removed from ggml");
    }
}
