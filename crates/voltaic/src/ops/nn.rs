//! Neural-network ops: convolution, pooling, normalisation, dropout, losses.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::OpKind;
use crate::primitive::{Caller, IndexOp, UnfoldParams};
use crate::rng;
use crate::tensor::Tensor;

/// Options of [`Tensor::conv2d`], PyTorch's defaults via `Default`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOpts {
    /// Step between windows (rows, cols).
    pub stride: [usize; 2],
    /// Zero padding on each side (rows, cols).
    pub padding: [usize; 2],
    /// Spacing between kernel taps (rows, cols).
    pub dilation: [usize; 2],
    /// Number of channel groups.
    pub groups: usize,
}

impl Default for Conv2dOpts {
    fn default() -> Self {
        Conv2dOpts { stride: [1, 1], padding: [0, 0], dilation: [1, 1], groups: 1 }
    }
}

/// Options of [`Tensor::cross_entropy_with`], PyTorch's defaults via `Default`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOpts {
    /// Targets equal to this are ignored (PyTorch's default: -100).
    pub ignore_index: i64,
    /// Weight of the uniform distribution mixed into the target, in `[0, 1]`.
    pub label_smoothing: f64,
    /// How the per-position losses are reduced.
    pub reduction: Reduction,
}

impl Default for CrossEntropyOpts {
    fn default() -> Self {
        CrossEntropyOpts { ignore_index: -100, label_smoothing: 0.0, reduction: Reduction::Mean }
    }
}

/// Reduction of a loss over its elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Average (PyTorch's default).
    #[default]
    Mean,
    /// Sum.
    Sum,
    /// One loss per element.
    None,
}

/// The adjoint of unfold (col2im): add each patch entry of `g`
/// `[N, C, kh, kw, oh, ow]` back at the input position it was read from.
fn fold(g: &Tensor, p: &UnfoldParams, h: usize, w: usize) -> Result<Tensor> {
    let d = g.dims();
    Tensor::from_op(OpKind::Index(IndexOp::Fold { params: *p, hw: [h, w] }), &[g], g.dtype(), g.device(), vec![d[0], d[1], h, w])
}

/// The gradient of `max_pool2d` of `x`: `g` at each window's first maximum,
/// summed where windows overlap.
fn max_pool2d_grad(x: &Tensor, g: &Tensor, p: UnfoldParams) -> Result<Tensor> {
    // The kernel reads both in one type (a gradient has its output's).
    let g = g.to_dtype(x.dtype())?;
    Tensor::from_op(OpKind::Index(IndexOp::MaxPoolGrad { params: p }), &[&g, x], x.dtype(), x.device(), x.dims().to_vec())
}

impl Tensor {
    /// The windows `p` over this `[N, C, H, W]` tensor, checked: the
    /// parameters as the kernels take them and the output's spatial size.
    fn windows(&self, op: &'static str, p: UnfoldParams) -> Result<(UnfoldParams, [usize; 2])> {
        if self.rank() != 4 {
            bail!(Shape, op, "expected a 4-D input [N, C, H, W], got {:?}", self.dims());
        }
        if p.kernel.contains(&0) || p.stride.contains(&0) || p.dilation.contains(&0) {
            bail!(Value, op, "kernel size, stride and dilation must be positive, got {:?}, {:?}, {:?}", p.kernel, p.stride, p.dilation);
        }
        // Bounded so that the kernels' signed index arithmetic cannot overflow.
        if p.padding.iter().chain(&p.dilation).any(|&v| v > u32::MAX as usize) {
            bail!(Value, op, "padding {:?} and dilation {:?} must be at most {}", p.padding, p.dilation, u32::MAX);
        }
        let d = self.dims();
        let Some(out_hw) = p.out_hw(d[2], d[3]) else {
            bail!(
                Shape,
                op,
                "input of spatial size {}x{} (padding {:?}) is smaller than the kernel {:?} with dilation {:?}",
                d[2],
                d[3],
                p.padding,
                p.kernel,
                p.dilation
            );
        };
        crate::shape::checked_numel(op, &[d[0], d[1], p.kernel[0], p.kernel[1], out_hw[0], out_hw[1]])?;
        // A stride beyond the padded input gives one output either way; cap it
        // there so that it cannot overflow the kernels' signed arithmetic.
        let mut p = p;
        for i in 0..2 {
            p.stride[i] = p.stride[i].min(d[2 + i] + 2 * p.padding[i]);
        }
        Ok((p, out_hw))
    }

    /// The patches `[N, C, kh, kw, oh, ow]` of windows `p`, padded with
    /// `pad`; with `by_tap`, a view of them stored as `[C, kh, kw, N, oh, ow]`
    /// (see `IndexOp::Unfold`).
    fn unfold(&self, op: &'static str, p: UnfoldParams, pad: f64, by_tap: bool) -> Result<Tensor> {
        let (p, [oh, ow]) = self.windows(op, p)?;
        let d = self.dims();
        let [kh, kw] = p.kernel;
        let (dims, to_image): (_, &[isize]) =
            if by_tap { (vec![d[1], kh, kw, d[0], oh, ow], &[3, 0, 1, 2, 4, 5]) } else { (vec![d[0], d[1], kh, kw, oh, ow], &[0, 1, 2, 3, 4, 5]) };
        let out = Tensor::from_op(OpKind::Index(IndexOp::Unfold { params: p, pad, by_tap }), &[self], self.dtype(), self.device(), dims)?;
        let out = if self.dtype().is_float() {
            let [h, w] = [d[2], d[3]];
            let to_image = to_image.to_vec();
            out.track(&[self], move |g, _| Ok(vec![Some(fold(&g.permute(&to_image)?, &p, h, w)?)]))
        } else {
            out
        };
        if by_tap {
            return out.permute(to_image);
        }
        Ok(out)
    }

    /// 2-D convolution (really cross-correlation, as PyTorch) of `[N, Cin, H, W]` (or unbatched `[Cin, H, W]`)
    /// with `weight [Cout, Cin/groups, kh, kw]` and an optional `bias [Cout]`.
    /// Runs as unfold (im2col) and a batched matmul.
    pub fn conv2d(&self, weight: &Tensor, bias: Option<&Tensor>, opts: Conv2dOpts) -> Result<Tensor> {
        if self.rank() == 3 && weight.rank() == 4 {
            // Unbatched `[C, H, W]`, as PyTorch accepts.
            return self.unsqueeze(0)?.conv2d(weight, bias, opts)?.squeeze(0);
        }
        if weight.rank() != 4 || self.rank() != 4 {
            bail!(Shape, "conv2d", "expected input [N, C, H, W] and weight [Cout, Cin/groups, kh, kw], got {:?} and {:?}", self.dims(), weight.dims());
        }
        let (n, cin) = (self.dims()[0], self.dims()[1]);
        let (cout, cpg, kh, kw) = (weight.dims()[0], weight.dims()[1], weight.dims()[2], weight.dims()[3]);
        let g = opts.groups;
        if g == 0 || cin % g != 0 || cout % g != 0 || cpg.checked_mul(g) != Some(cin) {
            bail!(
                Shape,
                "conv2d",
                "input has {cin} channels and weight {:?} with groups={g}: expected weight [Cout, {}, kh, kw] with Cout divisible by {g}",
                weight.dims(),
                cin.checked_div(g).unwrap_or(0)
            );
        }
        if let Some(b) = bias {
            if b.dims() != [cout] {
                bail!(Shape, "conv2d", "expected bias of shape [{cout}], got {:?}", b.dims());
            }
        }
        // Autocast: cast before the unfold, which then moves half the bytes.
        let (x, weight) = (super::autocast::low(self)?, super::autocast::low(weight)?);
        let bias = bias.map(super::autocast::low).transpose()?;
        let p = UnfoldParams { kernel: [kh, kw], stride: opts.stride, padding: opts.padding, dilation: opts.dilation };
        // Patches by tap: the weight gradient reads them as `[k, N * oh * ow]`.
        let u = x.unfold("conv2d", p, 0.0, true)?;
        let (oh, ow) = (u.dims()[4], u.dims()[5]);
        let k = cpg * kh * kw;
        let u = u.reshape_dims(&[n, g, k, oh * ow])?;
        let w = weight.reshape_dims(&[1, g, cout / g, k])?;
        let y = w.matmul(&u)?.reshape_dims(&[n, cout, oh, ow])?;
        match bias {
            Some(b) => y.add(&b.reshape_dims(&[1, cout, 1, 1])?),
            None => Ok(y),
        }
    }

    /// Non-overlapping, unpadded windows that tile the input exactly, as the
    /// view `[N, C, H/kh, kh, W/kw, kw]`: pooling then needs no unfold copy.
    fn tiled_windows(&self, p: &UnfoldParams) -> Result<Option<Tensor>> {
        // Anything unusual (including invalid sizes, reported by unfold) takes the general path.
        if self.rank() != 4 || !p.tiles(self.dims()[2], self.dims()[3]) {
            return Ok(None);
        }
        let d = self.dims();
        let [kh, kw] = p.kernel;
        Ok(Some(self.reshape_dims(&[d[0], d[1], d[2] / kh, kh, d[3] / kw, kw])?))
    }

    fn pool_params(op: &'static str, kernel: [usize; 2], stride: Option<[usize; 2]>, padding: [usize; 2]) -> Result<UnfoldParams> {
        for i in 0..2 {
            if padding[i] > kernel[i] / 2 {
                bail!(Value, op, "padding {:?} must be at most half the kernel size {:?}", padding, kernel);
            }
        }
        Ok(UnfoldParams { kernel, stride: stride.unwrap_or(kernel), padding, dilation: [1, 1] })
    }

    /// Max pooling over `[N, C, H, W]` (or unbatched `[C, H, W]`); `stride`
    /// defaults to the kernel size. Padding is never chosen (as -inf), a NaN
    /// is the maximum of its window, and the gradient of each window goes to
    /// its first maximum, as PyTorch.
    ///
    /// ```
    /// # use voltaic::{Device, Tensor};
    /// let x = Tensor::from_vec((0..16).map(|v| v as f32).collect(), &[1, 1, 4, 4], Device::Cpu)?;
    /// assert_eq!(x.max_pool2d([2, 2], None, [0, 0])?.to_vec::<f32>()?, [5.0, 7.0, 13.0, 15.0]);
    /// # Ok::<(), voltaic::Error>(())
    /// ```
    pub fn max_pool2d(&self, kernel: [usize; 2], stride: Option<[usize; 2]>, padding: [usize; 2]) -> Result<Tensor> {
        if self.rank() == 3 {
            return self.unsqueeze(0)?.max_pool2d(kernel, stride, padding)?.squeeze(0);
        }
        let (p, [oh, ow]) = self.windows("max_pool2d", Tensor::pool_params("max_pool2d", kernel, stride, padding)?)?;
        let d = self.dims();
        let dims = vec![d[0], d[1], oh, ow];
        let x = self.detach();
        let y = Tensor::from_op(OpKind::Index(IndexOp::MaxPool { params: p }), &[&x], x.dtype(), x.device(), dims)?;
        if !y.dtype().is_float() {
            return Ok(y);
        }
        // The backward finds each window's first maximum again, in the
        // gradient's kernel (see `IndexOp::MaxPoolGrad`).
        let hw = [d[2], d[3]];
        if self.is_tracked() && hw[0].saturating_mul(hw[1]) > i32::MAX as usize {
            bail!(Shape, "max_pool2d", "the gradient of an image of {}x{} positions: at most {} (i32 positions)", hw[0], hw[1], i32::MAX);
        }
        Ok(y.track(&[self], move |g, _| Ok(vec![Some(max_pool2d_grad(&x, g, p)?)])))
    }

    /// Average pooling over `[N, C, H, W]` or `[C, H, W]` (zero padding counted, as PyTorch's default).
    pub fn avg_pool2d(&self, kernel: [usize; 2], stride: Option<[usize; 2]>, padding: [usize; 2]) -> Result<Tensor> {
        if self.rank() == 3 {
            return self.unsqueeze(0)?.avg_pool2d(kernel, stride, padding)?.squeeze(0);
        }
        let p = Tensor::pool_params("avg_pool2d", kernel, stride, padding)?;
        if let Some(w) = self.tiled_windows(&p)? {
            return w.to_dtype(w.dtype().to_float())?.mean(&[3, 5], false);
        }
        let u = self.to_dtype(self.dtype().to_float())?.unfold("avg_pool2d", p, 0.0, false)?;
        let d = u.dims().to_vec();
        u.reshape_dims(&[d[0], d[1], d[2] * d[3], d[4], d[5]])?.mean(&[2], false)
    }

    /// Layer normalisation over the trailing dims `normalized_shape`, with
    /// optional elementwise `weight` and `bias` of that shape. Runs as three
    /// kernels: mean, variance (with the centring fused in), normalise; its
    /// gradient is the closed form, not the chain through those steps.
    pub fn layer_norm(&self, normalized_shape: &[usize], weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let k = normalized_shape.len();
        let r = self.rank();
        if k == 0 || k > r || &self.dims()[r - k..] != normalized_shape {
            bail!(Shape, "layer_norm", "normalized_shape {normalized_shape:?} must match the trailing dims of the input {:?}", self.dims());
        }
        for (name, p) in [("weight", weight), ("bias", bias)] {
            if let Some(p) = p {
                if p.dims() != normalized_shape {
                    bail!(Shape, "layer_norm", "{name} of shape {:?} must have shape {normalized_shape:?}", p.dims());
                }
            }
        }
        let x = self.to_dtype(super::autocast::full(self.dtype()))?;
        let axes: Vec<isize> = (r - k..r).map(|a| a as isize).collect();
        let y = crate::no_grad(|| -> Result<Tensor> {
            let (xhat, _) = normalized(&x, &axes, eps)?;
            let mut y = xhat;
            if let Some(w) = weight {
                y = y.mul(w)?;
            }
            if let Some(b) = bias {
                y = y.add(b)?;
            }
            Ok(y)
        })?;
        // The gradient as one formula rather than through the forward's
        // means, centring and square root: a third of the kernels, and far
        // fewer graph nodes to record. With x^ = (x - mean) * rstd and
        // g' = g * weight: dx = rstd * (g' - mean(g') - x^ * mean(g' * x^)),
        // dweight = sum(g * x^) and dbias = sum(g) over the leading dims.
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let (w, has_b) = (weight.cloned(), bias.is_some());
        let lead = r - k;
        Ok(y.track(&inputs, move |g, needs| {
            let (xhat, rstd) = normalized(&x, &axes, eps)?;
            let gw = match &w {
                Some(w) => g.mul(w)?,
                None => g.clone(),
            };
            let mut out = vec![None; needs.len()];
            if needs[0] {
                let m1 = gw.mean(&axes, true)?;
                let m2 = gw.mul(&xhat)?.mean(&axes, true)?;
                out[0] = Some(gw.sub(&m1)?.sub(&xhat.mul(&m2)?)?.mul(&rstd)?);
            }
            let leading: Vec<isize> = (0..lead as isize).collect();
            let over_rows = |t: &Tensor| if leading.is_empty() { Ok(t.clone()) } else { t.sum(&leading, false) };
            if let Some(w) = &w {
                if needs[1] {
                    out[1] = Some(over_rows(&g.mul(&xhat)?)?.to_dtype(w.dtype())?);
                }
            }
            if has_b && needs[needs.len() - 1] {
                out[needs.len() - 1] = Some(over_rows(g)?);
            }
            Ok(out)
        }))
    }

    /// Inverted dropout: in training, zero each element with probability `p`
    /// and scale the rest by `1 / (1 - p)`; identity otherwise.
    pub fn dropout(&self, p: f64, train: bool) -> Result<Tensor> {
        if !(0.0..=1.0).contains(&p) {
            bail!(Value, "dropout", "probability must be in [0, 1], got {p}");
        }
        if !train || p == 0.0 {
            return Ok(self.clone());
        }
        if p == 1.0 {
            return self.zeros_like();
        }
        let u = rng::with_default(|g| Tensor::rand_with(g, self.dims(), DType::F32, self.device()))?;
        u.ge(p)?.where_cond(&self.mul(1.0 / (1.0 - p))?, &self.zeros_like()?.to_dtype(self.dtype().to_float())?)
    }

    /// Cross entropy between logits `[N, C, ...]` (or unbatched `[C]`) and
    /// class indices `[N, ...]` (or a 0-d index), i32 or u32, with label
    /// smoothing `eps` (PyTorch's formula), reduced as asked. Targets equal to
    /// -100 are ignored, as PyTorch's default `ignore_index`; see
    /// [`Tensor::cross_entropy_with`] for the other options. Probability
    /// targets and class weights are not supported.
    pub fn cross_entropy(&self, target: &Tensor, label_smoothing: f64, reduction: Reduction) -> Result<Tensor> {
        self.cross_entropy_with(target, &CrossEntropyOpts { label_smoothing, reduction, ..Default::default() })
    }

    /// [`Tensor::cross_entropy`] with every option. Ignored positions add
    /// nothing and do not count in the mean (all ignored: NaN, as PyTorch).
    pub fn cross_entropy_with(&self, target: &Tensor, opts: &CrossEntropyOpts) -> Result<Tensor> {
        if self.rank() == 1 && target.rank() == 0 {
            let l = self.unsqueeze(0)?.cross_entropy_with(&target.unsqueeze(0)?, opts)?;
            return if opts.reduction == Reduction::None { l.squeeze(0) } else { Ok(l) };
        }
        self.check_class_target("cross_entropy", "logits", target)?;
        let eps = opts.label_smoothing;
        if !(0.0..=1.0).contains(&eps) {
            bail!(Value, "cross_entropy", "label_smoothing must be in [0, 1], got {eps}");
        }
        // Ignored positions read class 0 and are masked out after.
        let ignores = target.dtype() == DType::I32 && i32::try_from(opts.ignore_index).is_ok()
            || target.dtype() == DType::U32 && u32::try_from(opts.ignore_index).is_ok();
        let valid = if ignores { Some(target.ne(opts.ignore_index as f64)?) } else { None };
        let safe = match &valid {
            Some(v) => v.where_cond(target, 0)?,
            None => target.clone(),
        };
        let logp = self.log_softmax(1)?;
        let nll = logp.pick_class(Caller::CrossEntropy, &safe)?.neg()?;
        let loss = if eps > 0.0 {
            let smooth = logp.mean(&[1], false)?.neg()?;
            nll.mul(1.0 - eps)?.add(&smooth.mul(eps)?)?
        } else {
            nll
        };
        let Some(valid) = valid else { return loss.reduce_loss(opts.reduction) };
        let loss = valid.where_cond(&loss, 0.0)?;
        match opts.reduction {
            Reduction::Mean => loss.sum_all()?.div(&valid.to_dtype(loss.dtype())?.sum_all()?),
            r => loss.reduce_loss(r),
        }
    }

    /// Mean squared error between `self` and `target`, broadcast against
    /// each other as PyTorch does (PyTorch also warns when the shapes differ).
    pub fn mse_loss(&self, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
        crate::shape::broadcast_shapes("mse_loss", self.dims(), target.dims())?;
        let full = |t: &Tensor| t.to_dtype(super::autocast::full(t.dtype()));
        full(self)?.sub(&full(target)?)?.sqr()?.reduce_loss(reduction)
    }

    /// Checks shared by the classification losses: `self` holds scores
    /// `[N, C, ...]` (`what`: logits, log-probabilities) and `target` the class
    /// indices `[N, ...]` as i32 or u32.
    pub(crate) fn check_class_target(&self, op: &'static str, what: &str, target: &Tensor) -> Result<()> {
        if self.rank() < 2 {
            bail!(Shape, op, "expected {what} [N, C, ...], got {:?}", self.dims());
        }
        if !matches!(target.dtype(), DType::I32 | DType::U32) {
            bail!(DType, op, "expected i32 or u32 class indices, got {}", target.dtype());
        }
        let mut want = self.dims().to_vec();
        want.remove(1);
        if target.dims() != want.as_slice() {
            bail!(Shape, op, "{what} {:?} need a target of shape {want:?}, got {:?}", self.dims(), target.dims());
        }
        Ok(())
    }

    /// The score of each position's target class: `self[n, target[n, ...], ...]`.
    pub(crate) fn pick_class(&self, caller: Caller, target: &Tensor) -> Result<Tensor> {
        self.gather_as(caller, 1, &target.unsqueeze(1)?)?.squeeze(1)
    }

    pub(crate) fn reduce_loss(&self, reduction: Reduction) -> Result<Tensor> {
        match reduction {
            Reduction::Mean => self.mean(&[], false),
            Reduction::Sum => self.sum(&[], false),
            Reduction::None => Ok(self.clone()),
        }
    }
}

impl Tensor {
    /// Scaled dot-product attention, as PyTorch's
    /// `torch.nn.functional.scaled_dot_product_attention`:
    /// `softmax(q @ k^T * scale + mask) @ v` for `self` (the queries)
    /// `[..., M, D]`, `k` `[..., N, D]`, `v` `[..., N, E]` with the same
    /// leading dims, and an additive float `mask` broadcastable to
    /// `[..., M, N]` (`-inf` or a large negative value where a query must
    /// not look). `scale` defaults to `1 / sqrt(D)`.
    ///
    /// With no gradient to record it runs as one kernel per query row that
    /// never stores the scores (an online softmax over the keys); when an
    /// input is tracked, the dtype is f64 (the kernel computes in f32) or
    /// `D` is above 1024, it runs as the two products and the softmax,
    /// which differentiate. A row whose mask is -inf
    /// everywhere gives NaN, as the softmax does; with no keys at all the
    /// result is zeros.
    ///
    /// ```
    /// use voltaic::{DType, Device, Tensor};
    /// let q = Tensor::randn(&[2, 3, 8], DType::F32, Device::Cpu)?;
    /// let k = Tensor::randn(&[2, 5, 8], DType::F32, Device::Cpu)?;
    /// let v = Tensor::randn(&[2, 5, 4], DType::F32, Device::Cpu)?;
    /// let out = q.scaled_dot_product_attention(&k, &v, None, None)?;
    /// let manual = q.matmul(&k.transpose(1, 2)?)?.mul(1.0 / 8f64.sqrt())?.softmax(-1)?.matmul(&v)?;
    /// assert!(out.sub(&manual)?.abs()?.max_all()?.item_f64()? < 1e-5);
    /// # Ok::<(), voltaic::Error>(())
    /// ```
    pub fn scaled_dot_product_attention(&self, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: Option<f64>) -> Result<Tensor> {
        const OP: &str = "scaled_dot_product_attention";
        let (q, r) = (self, self.rank());
        if r < 2 || k.rank() != r || v.rank() != r {
            bail!(Shape, OP, "expected q, k, v of one rank >= 2, got {:?}, {:?}, {:?}", q.dims(), k.dims(), v.dims());
        }
        let lead = &q.dims()[..r - 2];
        let (m, d, n, e) = (q.dims()[r - 2], q.dims()[r - 1], k.dims()[r - 2], v.dims()[r - 1]);
        if &k.dims()[..r - 2] != lead || &v.dims()[..r - 2] != lead || k.dims()[r - 1] != d || v.dims()[r - 2] != n {
            bail!(Shape, OP, "expected q [..., M, D], k [..., N, D], v [..., N, E] with equal leading dims, got {:?}, {:?}, {:?}", q.dims(), k.dims(), v.dims());
        }
        for t in [k, v].into_iter().chain(mask) {
            q.check_same_device(OP, t)?;
        }
        if !q.dtype().is_float() || k.dtype() != q.dtype() || v.dtype() != q.dtype() || mask.is_some_and(|m| !m.dtype().is_float()) {
            let md = mask.map_or("none".to_string(), |m| m.dtype().to_string());
            bail!(DType, OP, "expected float q, k, v of one dtype and a float mask, got {}, {}, {} and {md}", q.dtype(), k.dtype(), v.dtype());
        }
        let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
        if !scale.is_finite() {
            bail!(Value, OP, "the scale must be finite, got {scale}");
        }
        let mut scores_dims = lead.to_vec();
        scores_dims.extend([m, n]);
        let mask = match mask {
            Some(mk) => mk.broadcast_to(&scores_dims).map_err(|_| crate::error::Error::Shape { op: OP, msg: format!("a mask of shape {:?} does not broadcast to the scores' {scores_dims:?}", mk.dims()) })?,
            None => Tensor::zeros(&[1], q.dtype(), q.device())?.broadcast_to(&scores_dims)?,
        };
        // The kernel keeps a query row in workgroup memory (16 KiB on the
        // smallest adapters); heads wider than this take the unfused form.
        const MAX_FUSED_D: usize = 1024;
        // The kernel computes in f32: f64 keeps its precision in the unfused form.
        if d > MAX_FUSED_D || q.dtype() == DType::F64 || (crate::is_grad_enabled() && [q, k, v, &mask].iter().any(|t| t.is_tracked())) {
            return q.matmul(&k.transpose(-1, -2)?)?.mul(scale)?.add(&mask)?.softmax(-1)?.matmul(v);
        }
        let batch: usize = lead.iter().product();
        let mut out_dims = lead.to_vec();
        out_dims.extend([m, e]);
        // No keys: nothing to average, zeros (as the CPU's sums give).
        if batch * m * e == 0 || n == 0 {
            return Tensor::zeros(&out_dims, q.dtype(), q.device());
        }
        // The leading dims stay as they are (none, or several): heads split
        // from a [B, T, H] projection (or a mask broadcast over them) do not
        // flatten into one batch dim without a copy; the kernels walk them
        // as they lie.
        Tensor::from_op(OpKind::Index(IndexOp::Attention { scale }), &[q, k, v, &mask], q.dtype(), q.device(), out_dims)
    }
}

/// `((x - mean) * rstd, rstd)` over `axes` (kept), `rstd = 1 / sqrt(var + eps)`.
fn normalized(x: &Tensor, axes: &[isize], eps: f64) -> Result<(Tensor, Tensor)> {
    let mu = x.mean(axes, true)?;
    // Centred twice, not once and shared: a node read by two consumers is
    // stored, and the normalisation would leave its row kernel.
    let rstd = x.sub(&mu)?.sqr()?.mean(axes, true)?.add(eps)?.rsqrt()?;
    Ok((x.sub(&mu)?.mul(&rstd)?, rstd))
}
