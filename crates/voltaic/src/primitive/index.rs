//! Index-like primitives: ops whose output elements read inputs at computed
//! positions (gather, index_select, scatter_add, cumsum, cat, unfold, fold,
//! max pooling and its gradient).
//! They share one graph op and one kernel kind; each executor has one
//! kernel per variant.

/// Parameters of an unfold (im2col) over the last two dims of an NCHW input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UnfoldParams {
    /// Window size (rows, cols).
    pub kernel: [usize; 2],
    /// Step between windows.
    pub stride: [usize; 2],
    /// Padding on each side.
    pub padding: [usize; 2],
    /// Spacing between taps.
    pub dilation: [usize; 2],
}

impl UnfoldParams {
    /// Output spatial size for an input of `h` x `w`; `None` when the
    /// kernel does not fit (or the sizes overflow).
    pub fn out_hw(&self, h: usize, w: usize) -> Option<[usize; 2]> {
        let f = |i: usize, n: usize| {
            let span = self.dilation[i].checked_mul(self.kernel[i].checked_sub(1)?)?.checked_add(1)?;
            let padded = self.padding[i].checked_mul(2)?.checked_add(n)?;
            if padded < span {
                None
            } else {
                Some((padded - span) / self.stride[i] + 1)
            }
        };
        Some([f(0, h)?, f(1, w)?])
    }

    /// Whether the windows tile a non-empty `h` x `w` image exactly: side
    /// by side (stride = kernel, no dilation), unpadded, and a whole number
    /// of them each way, so that every element is in exactly one window.
    pub fn tiles(&self, h: usize, w: usize) -> bool {
        let [kh, kw] = self.kernel;
        let side_by_side = self.stride == self.kernel && self.padding == [0, 0] && self.dilation == [1, 1] && kh > 0 && kw > 0;
        side_by_side && h > 0 && w > 0 && h.is_multiple_of(kh) && w.is_multiple_of(kw)
    }
}

/// The public ops that read index tensors, for errors that name what the
/// user called.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // named as the ops they stand for
pub enum Caller {
    Gather,
    IndexSelect,
    ScatterAdd,
    Embedding,
    OneHot,
    CrossEntropy,
    NllLoss,
}

impl Caller {
    /// Every caller, in error-code order.
    pub const ALL: [Caller; 7] = [Caller::Gather, Caller::IndexSelect, Caller::ScatterAdd, Caller::Embedding, Caller::OneHot, Caller::CrossEntropy, Caller::NllLoss];

    /// The op's name.
    pub fn name(self) -> &'static str {
        match self {
            Caller::Gather => "gather",
            Caller::IndexSelect => "index_select",
            Caller::ScatterAdd => "scatter_add",
            Caller::Embedding => "embedding",
            Caller::OneHot => "one_hot",
            Caller::CrossEntropy => "cross_entropy",
            Caller::NllLoss => "nll_loss",
        }
    }
}

/// An index-like primitive and its parameters. Inputs, in order, are given
/// per variant.
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(missing_docs)] // the fields are named by the variants' docs
pub enum IndexOp {
    /// `out[p] = input[p with p[dim] = index[p]]`; inputs (input, index).
    Gather { dim: usize, caller: Caller },
    /// `out = input; out[p with p[dim] = index[p]] += src[p]`; inputs (input, index, src).
    ScatterAdd { dim: usize, caller: Caller },
    /// Entries of `input` along `dim` at the positions of a 1-D index; inputs (input, index).
    IndexSelect { dim: usize, caller: Caller },
    /// Inclusive prefix sum along `dim`; input (input).
    Cumsum { dim: usize },
    /// Concatenation along `dim`; inputs (parts...).
    Cat { dim: usize },
    /// im2col of `[N, C, H, W]` into `[N, C, kh, kw, oh, ow]`, padding
    /// with `pad`; with `by_tap`, into `[C, kh, kw, N, oh, ow]`: each tap's
    /// patches for the whole batch are then one row of a convolution's
    /// product, and its weight gradient reads them as one matrix, with no
    /// copy that gathers the batch; input (image).
    Unfold { params: UnfoldParams, pad: f64, by_tap: bool },
    /// col2im, the adjoint of unfold: patches `[N, C, kh, kw, oh, ow]` added
    /// back into an `[N, C, H, W]` image of spatial size `hw`; input (patches).
    Fold { params: UnfoldParams, hw: [usize; 2] },
    /// The maximum of each window of an `[N, C, H, W]` image (padding is
    /// never chosen, a NaN is the maximum), `[N, C, oh, ow]`; input (image).
    MaxPool { params: UnfoldParams },
    /// The gradient of max pooling: each window's entry of `g` added at the
    /// window's first maximum in the image (in row-major tap order, the
    /// first NaN where there is one), into an `[N, C, H, W]` result of the
    /// image's size (windows in row-major order); inputs (g, image), of one
    /// dtype. The kernel finds the maxima again, rather than the forward
    /// storing their positions for every step, inference included.
    MaxPoolGrad { params: UnfoldParams },
    /// Rows of a block-quantized `[rows, cols]` matrix (its padded blocks as
    /// u32 words, see `QTensor`) at the positions of a 1-D index,
    /// dequantized to f32: `[index len, cols]`; inputs (blocks, index).
    Dequantize { qtype: crate::quant::GgmlType, cols: usize, caller: Caller },
    /// `softmax(q @ k^T * scale + mask) @ v` in one pass over the keys (an
    /// online softmax): q `[..., M, D]`, k `[..., N, D]`, v `[..., N, E]`
    /// with the same leading dims (any number), an additive float mask
    /// seen as `[..., M, N]` (broadcast views allowed); `[..., M, E]`;
    /// inputs (q, k, v, mask).
    Attention { scale: f64 },
}

impl Eq for IndexOp {}

impl std::hash::Hash for IndexOp {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match self {
            IndexOp::Gather { dim, caller } | IndexOp::ScatterAdd { dim, caller } | IndexOp::IndexSelect { dim, caller } => (dim, caller).hash(h),
            IndexOp::Cumsum { dim } | IndexOp::Cat { dim } => dim.hash(h),
            IndexOp::Unfold { params, pad, by_tap } => (params, pad.to_bits(), by_tap).hash(h),
            IndexOp::Fold { params, hw } => (params, hw).hash(h),
            IndexOp::MaxPool { params } | IndexOp::MaxPoolGrad { params } => params.hash(h),
            IndexOp::Dequantize { qtype, cols, caller } => (qtype, cols, caller).hash(h),
            IndexOp::Attention { scale } => scale.to_bits().hash(h),
        }
    }
}

impl IndexOp {
    /// Name used in errors, schedules and profiles.
    pub fn name(&self) -> &'static str {
        match self {
            IndexOp::Gather { .. } => "gather",
            IndexOp::ScatterAdd { .. } => "scatter_add",
            IndexOp::IndexSelect { .. } => "index_select",
            IndexOp::Cumsum { .. } => "cumsum",
            IndexOp::Cat { .. } => "cat",
            IndexOp::Unfold { .. } => "unfold",
            IndexOp::Fold { .. } => "fold",
            IndexOp::MaxPool { .. } => "max_pool2d",
            IndexOp::MaxPoolGrad { .. } => "max_pool2d_grad",
            IndexOp::Dequantize { .. } => "dequantize",
            IndexOp::Attention { .. } => "attention",
        }
    }

    /// The public op whose index an out-of-range error names (an embedding
    /// runs as an index_select, but its user called `embedding`).
    pub fn caller(&self) -> Option<Caller> {
        match self {
            IndexOp::Gather { caller, .. } | IndexOp::ScatterAdd { caller, .. } | IndexOp::IndexSelect { caller, .. } | IndexOp::Dequantize { caller, .. } => Some(*caller),
            _ => None,
        }
    }

    /// Code with which a kernel reports an out-of-range index (0: the op
    /// reads no index tensor).
    pub fn error_code(&self) -> u32 {
        self.caller().map_or(0, |c| c as u32 + 1)
    }

    /// The op name behind an error code of [`IndexOp::error_code`].
    pub fn name_of_error_code(code: u32) -> &'static str {
        Caller::ALL.get((code as usize).wrapping_sub(1)).map_or("index", |c| c.name())
    }
}
