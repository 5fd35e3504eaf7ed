//! Block-quantized matrices ([`QTensor`]): weights that stay quantized on the
//! device and are multiplied and gathered by kernels that dequantize in
//! registers.
//!
//! A `QTensor` is a 2-D matrix `[rows, cols]` whose rows are sequences of
//! ggml blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), as a GGUF file stores a
//! `Linear` weight `[out, in]`. On the device it is one `u32` buffer: the
//! blocks' bytes unchanged, each block padded to whole words (at most 2
//! bytes per block; see [`GgmlType::padded_block_bytes`]). Two ops read it:
//! `x.matmul(&w.t())` (the quantized matmul, with the usual epilogue
//! fusion) and [`QTensor::embedding`] (rows gathered and dequantized, which
//! is also how [`QTensor::dequantize`] works).

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::OpKind;
use crate::primitive::{Caller, IndexOp};
use crate::quant::{self, GgmlType};
use crate::tensor::Tensor;

/// A block-quantized matrix `[rows, cols]` on a device: its ggml blocks
/// (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) kept as they are, each padded to whole
/// 32-bit words. It multiplies as `x.matmul(&w.t())` and gathers rows with
/// [`QTensor::embedding`], both dequantizing in registers.
///
/// ```
/// use voltaic::{quant::GgmlType, Device, DType, QTensor, Tensor};
/// let w = Tensor::randn(&[8, 64], DType::F32, Device::Cpu)?;
/// let wq = QTensor::quantize(&w, GgmlType::Q8_0)?;
/// let x = Tensor::randn(&[3, 64], DType::F32, Device::Cpu)?;
/// let y = x.matmul(&wq.t())?; // [3, 8], like x.matmul(&w.t())
/// let diff = y.sub(&x.matmul(&w.t()?)?)?.abs()?.max_all()?.item_f64()?;
/// assert!(diff < 0.1);
/// # Ok::<(), voltaic::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct QTensor {
    /// The padded blocks, `[rows, words per row]` of u32.
    raw: Tensor,
    qtype: GgmlType,
    rows: usize,
    cols: usize,
    /// Seen as `[cols, rows]` (after [`QTensor::t`]).
    transposed: bool,
}

impl QTensor {
    /// A matrix of `dims = [rows, cols]` from its blocks as a GGUF file
    /// holds them (`bytes`: rows after each other, each `cols / block`
    /// blocks of `qtype`), placed on `device`.
    pub fn from_blocks(bytes: &[u8], qtype: GgmlType, dims: &[usize], device: Device) -> Result<QTensor> {
        if !qtype.is_block_quantized() {
            bail!(DType, "quantized tensor", "{} is not a block-quantized type (Q8_0, Q4_0, Q4_1, Q4_K and Q6_K are)", qtype.name());
        }
        let &[rows, cols] = dims else {
            bail!(Shape, "quantized tensor", "expected a 2-D [rows, cols] matrix, got dims {dims:?}");
        };
        let (per, block_bytes) = qtype.block();
        if !cols.is_multiple_of(per) {
            bail!(Shape, "quantized tensor", "a row of {cols} elements is not whole {} blocks of {per}", qtype.name());
        }
        let blocks = rows.checked_mul(cols / per).filter(|b| b.checked_mul(block_bytes) == Some(bytes.len()));
        let Some(blocks) = blocks else {
            bail!(Value, "quantized tensor", "{} bytes are not the {rows} x {cols} {} blocks of a {dims:?} matrix", bytes.len(), qtype.name());
        };
        let padded = qtype.padded_block_bytes();
        let mut words = vec![0u32; blocks * padded / 4];
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        for (d, s) in dst.chunks_exact_mut(padded).zip(bytes.chunks_exact(block_bytes)) {
            d[..block_bytes].copy_from_slice(s);
        }
        let per_row = (cols / per) * padded / 4;
        let raw = Tensor::from_vec(words, &[rows, per_row], device)?;
        Ok(QTensor { raw, qtype, rows, cols, transposed: false })
    }

    /// Quantize a 2-D float tensor `[rows, cols]` to Q8_0, Q4_0 or Q4_1 (ggml's
    /// reference quantizers; `cols` a multiple of 32), on the tensor's device.
    pub fn quantize(t: &Tensor, qtype: GgmlType) -> Result<QTensor> {
        if t.rank() != 2 || !t.dtype().is_float() {
            bail!(Shape, "quantize", "expected a 2-D float tensor, got {} of shape {:?}", t.dtype(), t.dims());
        }
        let x: Vec<f32> = t.to_dtype(DType::F32)?.to_vec()?;
        let bytes = quant::quantize(qtype, &x)?;
        QTensor::from_blocks(&bytes, qtype, t.dims(), t.device())
    }

    /// The rows of several matrices of one quantization type and width
    /// stacked into one `[sum of rows, cols]` (`torch.cat(ws, 0)`): weights
    /// that multiply the same input (a layer's query, key and value
    /// projections) then run as one product. The blocks are copied on the
    /// device, not requantized.
    ///
    /// ```
    /// use voltaic::{quant::GgmlType, Device, DType, QTensor, Tensor};
    /// let a = QTensor::quantize(&Tensor::randn(&[4, 32], DType::F32, Device::Cpu)?, GgmlType::Q8_0)?;
    /// let b = QTensor::quantize(&Tensor::randn(&[2, 32], DType::F32, Device::Cpu)?, GgmlType::Q8_0)?;
    /// let ab = QTensor::cat_rows(&[&a, &b])?;
    /// assert_eq!(ab.dims(), [6, 32]);
    /// # Ok::<(), voltaic::Error>(())
    /// ```
    pub fn cat_rows(parts: &[&QTensor]) -> Result<QTensor> {
        let Some(first) = parts.first() else {
            bail!(Value, "cat_rows", "expected at least one quantized matrix, got none");
        };
        if let Some(o) = parts.iter().find(|o| o.qtype != first.qtype || o.cols != first.cols || o.transposed || o.device() != first.device()) {
            bail!(
                Value,
                "cat_rows",
                "can only stack untransposed matrices of one type, width and device: {} [{}, {}] on {} and {} {:?}{} on {}",
                first.qtype.name(),
                first.rows,
                first.cols,
                first.device(),
                o.qtype.name(),
                o.dims(),
                if o.transposed { " (transposed)" } else { "" },
                o.device()
            );
        }
        if first.transposed {
            bail!(Value, "cat_rows", "can only stack untransposed matrices, got a transposed {:?}", first.dims());
        }
        let raws: Vec<&Tensor> = parts.iter().map(|p| &p.raw).collect();
        let raw = Tensor::cat(&raws, 0)?;
        raw.realize()?;
        Ok(QTensor { raw, qtype: first.qtype, rows: parts.iter().map(|p| p.rows).sum(), cols: first.cols, transposed: false })
    }

    /// The quantization type.
    pub fn qtype(&self) -> GgmlType {
        self.qtype
    }

    /// The matrix's shape as seen (`[rows, cols]`, or `[cols, rows]` after [`QTensor::t`]).
    pub fn dims(&self) -> [usize; 2] {
        if self.transposed {
            [self.cols, self.rows]
        } else {
            [self.rows, self.cols]
        }
    }

    /// The device holding the blocks.
    pub fn device(&self) -> Device {
        self.raw.device()
    }

    /// Bytes the blocks take on the device.
    pub fn size_in_bytes(&self) -> usize {
        self.raw.numel() * 4
    }

    /// The transposed matrix (no copy): `x.matmul(&w.t())` multiplies by a
    /// weight stored `[out, in]`, as `nn::Linear` does.
    pub fn t(&self) -> QTensor {
        QTensor { transposed: !self.transposed, ..self.clone() }
    }

    /// The same blocks on another device.
    pub fn to_device(&self, device: Device) -> Result<QTensor> {
        Ok(QTensor { raw: self.raw.to_device(device)?, ..self.clone() })
    }

    /// The rows at `ids` (i32 or u32, any shape), dequantized to f32: shape
    /// `ids.dims() + [cols]`, the lookup of a quantized embedding table. An
    /// id out of range is reported when the values are computed, as
    /// [`Tensor::embedding`] does.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        if !matches!(ids.dtype(), DType::I32 | DType::U32) {
            bail!(DType, "embedding", "expected i32 or u32 ids, got {}", ids.dtype());
        }
        self.raw.check_same_device("embedding", ids)?;
        if self.transposed {
            bail!(Shape, "embedding", "the table is transposed ({:?}); look rows up in the stored [rows, cols] orientation", self.dims());
        }
        let flat = ids.reshape_dims(&[ids.numel()])?;
        let op = IndexOp::Dequantize { qtype: self.qtype, cols: self.cols, caller: Caller::Embedding };
        let out = Tensor::from_op(OpKind::Index(op), &[&self.raw, &flat], DType::F32, self.device(), vec![ids.numel(), self.cols])?;
        let mut dims = ids.dims().to_vec();
        dims.push(self.cols);
        out.reshape_dims(&dims)
    }

    /// The whole matrix in f32, as seen (transposed after [`QTensor::t`]).
    pub fn dequantize(&self) -> Result<Tensor> {
        let ids = Tensor::arange(0.0, self.rows as f64, 1.0, DType::I32, self.device())?;
        let w = QTensor { transposed: false, ..self.clone() }.embedding(&ids)?;
        if self.transposed {
            w.t()
        } else {
            Ok(w)
        }
    }

    /// `x @ self` for `self` seen as `[cols, rows]` (`w.t()`): the product
    /// in f32 (cast back to `x`'s dtype when it is a half type), with
    /// gradient for `x`.
    pub(crate) fn matmul_lhs(&self, x: &Tensor) -> Result<Tensor> {
        self.raw.check_same_device("matmul", x)?;
        if !self.transposed {
            bail!(
                Shape,
                "matmul",
                "a quantized [{}, {}] weight multiplies as x.matmul(&w.t()) (stored [out, in], like nn::Linear); multiplying by it untransposed is not supported",
                self.rows,
                self.cols
            );
        }
        if x.rank() == 0 || x.dims()[x.rank() - 1] != self.cols {
            bail!(Shape, "matmul", "cannot multiply {:?} by a quantized {:?}: inner dimensions differ", x.dims(), self.dims());
        }
        if !x.dtype().is_float() {
            bail!(DType, "matmul", "a quantized weight multiplies float tensors, got {}", x.dtype());
        }
        let lead = &x.dims()[..x.rank() - 1];
        let m: usize = lead.iter().product();
        let x2 = x.to_dtype(DType::F32)?.reshape_dims(&[m, self.cols])?;
        let w = QTensor { transposed: false, ..self.clone() };
        let out = if m > DENSE_ROWS && crate::backend::executor(self.device())?.capabilities().dense_wide_qmatmul {
            // A prompt on a GPU: the dense kernels (see Capabilities).
            x2.matmul_dense(&w.dequantize()?.t()?)?
        } else {
            let out = Tensor::from_op(OpKind::QMatmul(self.qtype), &[&x2, &self.raw], DType::F32, self.device(), vec![m, self.rows])?;
            out.track(&[&x2], move |g, _| Ok(vec![Some(g.matmul(&w.dequantize()?)?)]))
        };
        let mut dims = lead.to_vec();
        dims.push(self.rows);
        let out = out.reshape_dims(&dims)?;
        if x.dtype() == DType::F32 {
            Ok(out)
        } else {
            out.to_dtype(x.dtype())
        }
    }
}

/// Rows of `x` above which a device with `dense_wide_qmatmul` multiplies
/// by the dequantized weight (at and below, its quantized GEMV reads the
/// weight once for all rows).
const DENSE_ROWS: usize = 8;

/// What `Tensor::matmul` multiplies by: a [`Tensor`], or a transposed
/// [`QTensor`] (`x.matmul(&w_q.t())`).
pub trait MatmulRhs {
    /// `lhs @ self`.
    fn matmul_from(&self, lhs: &Tensor) -> Result<Tensor>;
}

impl MatmulRhs for Tensor {
    fn matmul_from(&self, lhs: &Tensor) -> Result<Tensor> {
        lhs.matmul_dense(self)
    }
}

impl MatmulRhs for QTensor {
    fn matmul_from(&self, lhs: &Tensor) -> Result<Tensor> {
        self.matmul_lhs(lhs)
    }
}
