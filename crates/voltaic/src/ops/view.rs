//! Views: new layouts over the same node, no data moved. `contiguous()` is the
//! only op here that copies (and `reshape`, like PyTorch's, when the strides
//! leave no other way).

use crate::error::{bail, Result};
use crate::graph::OpKind;
use crate::shape::{checked_numel, norm_axis};
use crate::tensor::Tensor;

impl Tensor {
    /// A contiguous tensor with the same values: `self` when already
    /// contiguous, otherwise a copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.value.layout.is_contiguous() {
            return Ok(self.clone());
        }
        let out = Tensor::from_op(OpKind::Copy, &[self], self.dtype(), self.device(), self.dims().to_vec())?;
        Ok(out.track(&[self], |g, _| Ok(vec![Some(g.clone())])))
    }

    /// The elements in a buffer of their own, even where the view is
    /// contiguous already: a small view kept for long would hold its
    /// whole buffer alive.
    pub(crate) fn copied(&self) -> Result<Tensor> {
        let out = Tensor::from_op(OpKind::Copy, &[self], self.dtype(), self.device(), self.dims().to_vec())?;
        Ok(out.track(&[self], |g, _| Ok(vec![Some(g.clone())])))
    }

    /// The same elements in a new shape; one dimension may be -1 (inferred).
    /// A view when the strides allow it, otherwise a contiguous copy (as PyTorch's `reshape`).
    pub fn reshape(&self, shape: &[isize]) -> Result<Tensor> {
        let n = self.numel();
        let mut infer = None;
        let mut known: usize = 1;
        for (i, &d) in shape.iter().enumerate() {
            if d == -1 {
                if infer.is_some() {
                    bail!(Shape, "reshape", "only one dimension can be -1, got {shape:?}");
                }
                infer = Some(i);
            } else if d < 0 {
                bail!(Shape, "reshape", "invalid dimension {d} in {shape:?}");
            } else {
                known = known.saturating_mul(d as usize);
            }
        }
        let mut dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        if let Some(i) = infer {
            if known == 0 || !n.is_multiple_of(known) {
                bail!(Shape, "reshape", "cannot reshape a tensor of shape {:?} ({n} elements) into {shape:?}", self.dims());
            }
            dims[i] = n / known;
        }
        self.reshape_dims(&dims)
    }

    /// [`Tensor::reshape`] with explicit non-negative dims.
    pub fn reshape_dims(&self, dims: &[usize]) -> Result<Tensor> {
        let n = checked_numel("reshape", dims)?;
        if n != self.numel() {
            bail!(
                Shape,
                "reshape",
                "cannot reshape a tensor of shape {:?} ({} elements) into {dims:?} ({n} elements)",
                self.dims(),
                self.numel()
            );
        }
        let (src, l) = match self.value.layout.reshape(dims) {
            Some(l) => (self.clone(), l),
            None => {
                let c = self.contiguous()?;
                let l = c.value.layout.reshape(dims).expect("contiguous layouts reshape");
                (c, l)
            }
        };
        Ok(src.with_layout(l).track(&[&src], reshape_back(src.dims())))
    }

    /// Reshape to another tensor's shape.
    pub fn view_as(&self, other: &Tensor) -> Result<Tensor> {
        self.reshape_dims(other.dims())
    }

    /// Reorder dimensions (negative dims allowed).
    pub fn permute(&self, dims: &[isize]) -> Result<Tensor> {
        let r = self.rank();
        if dims.len() != r {
            bail!(Axis, "permute", "expected {r} dims for a tensor of shape {:?}, got {dims:?}", self.dims());
        }
        let mut perm = Vec::with_capacity(r);
        for &d in dims {
            let a = norm_axis("permute", d, r)?;
            if perm.contains(&a) {
                bail!(Axis, "permute", "dim {d} appears twice in {dims:?}");
            }
            perm.push(a);
        }
        let mut inverse = vec![0isize; r];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i as isize;
        }
        Ok(self.with_layout(self.value.layout.permute(&perm)).track(&[self], move |g, _| Ok(vec![Some(g.permute(&inverse)?)])))
    }

    /// Swap two dimensions.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let r = self.rank();
        let (a, b) = (norm_axis("transpose", d0, r)?, norm_axis("transpose", d1, r)?);
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(a, b);
        let (a, b) = (a as isize, b as isize);
        Ok(self.with_layout(self.value.layout.permute(&perm)).track(&[self], move |g, _| Ok(vec![Some(g.transpose(a, b)?)])))
    }

    /// Transpose of a matrix; 0-d and 1-d tensors are returned as they are (PyTorch `t`).
    pub fn t(&self) -> Result<Tensor> {
        match self.rank() {
            0 | 1 => Ok(self.clone()),
            2 => self.transpose(0, 1),
            r => bail!(Shape, "t", "expects a tensor with at most 2 dims, got {r} (shape {:?}); use transpose", self.dims()),
        }
    }

    /// Broadcast to a shape (NumPy rules), as a view with stride 0 where stretched.
    pub fn broadcast_to(&self, dims: &[usize]) -> Result<Tensor> {
        if dims == self.dims() {
            return Ok(self.clone());
        }
        checked_numel("broadcast_to", dims)?;
        let src = self.dims().to_vec();
        Ok(self.with_layout(self.value.layout.broadcast_to("broadcast_to", dims)?).track(&[self], move |g, _| Ok(vec![Some(g.sum_to(&src)?)])))
    }

    /// PyTorch `expand`: like `broadcast_to`, with -1 keeping a dimension.
    pub fn expand(&self, shape: &[isize]) -> Result<Tensor> {
        let r = shape.len();
        if r < self.rank() {
            bail!(Shape, "expand", "cannot expand shape {:?} to {shape:?}: fewer dims", self.dims());
        }
        let lead = r - self.rank();
        let mut dims = Vec::with_capacity(r);
        for (i, &d) in shape.iter().enumerate() {
            if d == -1 {
                if i < lead {
                    bail!(Shape, "expand", "-1 is not allowed for the new leading dim {i} in {shape:?}");
                }
                dims.push(self.dims()[i - lead]);
            } else if d < 0 {
                bail!(Shape, "expand", "invalid size {d} in {shape:?}");
            } else {
                dims.push(d as usize);
            }
        }
        self.broadcast_to(&dims)
    }

    /// Elements `start..start + len` of dimension `dim`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = norm_axis("narrow", dim, self.rank())?;
        let size = self.dims()[d];
        if start.checked_add(len).is_none_or(|e| e > size) {
            bail!(Index, "narrow", "range {start}..{} is out of bounds for dim {d} of size {size}", start.saturating_add(len));
        }
        Ok(self.with_layout(self.value.layout.slice(d, start, len, 1)).track_slice(self, d, start))
    }

    /// Python slicing `x[start:end:step]` along `dim`: negative start and end
    /// count from the end, out-of-range bounds are clamped, `step` must be positive.
    pub fn slice(&self, dim: isize, start: isize, end: isize, step: usize) -> Result<Tensor> {
        let d = norm_axis("slice", dim, self.rank())?;
        if step == 0 {
            bail!(Value, "slice", "step must be positive, got 0");
        }
        let size = self.dims()[d] as isize;
        let clampi = |i: isize| if i < 0 { (i + size).max(0) } else { i.min(size) };
        let (s, e) = (clampi(start), clampi(end));
        let len = if e > s { ((e - s) as usize).div_ceil(step) } else { 0 };
        // With at most one element the step is never taken; a huge one would overflow the stride.
        let step = if len <= 1 { 1 } else { step };
        let size = size as usize;
        Ok(self.with_layout(self.value.layout.slice(d, s as usize, len, step)).track(&[self], move |g, _| Ok(vec![Some(g.embed(d, s as usize, step, size)?)])))
    }

    /// Remove dimension `dim` if it has size 1 (otherwise unchanged, as PyTorch).
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = norm_axis("squeeze", dim, self.rank())?;
        if self.dims()[d] != 1 {
            return Ok(self.clone());
        }
        Ok(self.with_layout(self.value.layout.squeeze(d)).track(&[self], reshape_back(self.dims())))
    }

    /// Remove every dimension of size 1.
    pub fn squeeze_all(&self) -> Result<Tensor> {
        let mut l = self.value.layout.clone();
        for d in (0..self.rank()).rev() {
            if l.dims()[d] == 1 {
                l = l.squeeze(d);
            }
        }
        Ok(self.with_layout(l).track(&[self], reshape_back(self.dims())))
    }

    /// Insert a dimension of size 1 at `dim` (in `-rank-1..=rank`).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = norm_axis("unsqueeze", dim, self.rank() + 1)?;
        Ok(self.with_layout(self.value.layout.unsqueeze(d)).track(&[self], reshape_back(self.dims())))
    }

    /// Merge dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape_dims(&[1]);
        }
        let (s, e) = (norm_axis("flatten", start, self.rank())?, norm_axis("flatten", end, self.rank())?);
        if s > e {
            bail!(Axis, "flatten", "start dim {start} comes after end dim {end}");
        }
        let mut dims = self.dims()[..s].to_vec();
        dims.push(self.dims()[s..=e].iter().product());
        dims.extend_from_slice(&self.dims()[e + 1..]);
        self.reshape_dims(&dims)
    }

    /// Flatten to one dimension.
    pub fn flatten_all(&self) -> Result<Tensor> {
        self.reshape_dims(&[self.numel()])
    }
}

/// The gradient of a view that only changes the shape: reshape it back.
fn reshape_back(dims: &[usize]) -> impl Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static {
    let dims = dims.to_vec();
    move |g, _| Ok(vec![Some(g.reshape_dims(&dims)?)])
}

impl Tensor {
    /// The gradient of a slice: `self` placed at `start, start + step, ...`
    /// along `dim` of a zero tensor whose `dim` has `size` entries.
    pub(crate) fn embed(&self, dim: usize, start: usize, step: usize, size: usize) -> Result<Tensor> {
        let len = self.dims()[dim];
        let zeros = |n: usize, like: &Tensor| {
            let mut d = like.dims().to_vec();
            d[dim] = n;
            Tensor::zeros(&d, like.dtype(), like.device())
        };
        if len == 0 {
            return zeros(size, self);
        }
        // Spread the entries `step` apart: [.., len, ..] -> [.., len, step, ..] -> [.., len * step, ..].
        let spread = if step == 1 {
            self.clone()
        } else {
            let x = self.unsqueeze(dim as isize + 1)?;
            let mut pd = x.dims().to_vec();
            pd[dim + 1] = step - 1;
            let pad = Tensor::zeros(&pd, x.dtype(), x.device())?;
            let wide = Tensor::cat(&[&x, &pad], dim as isize + 1)?;
            let mut d = self.dims().to_vec();
            d[dim] = len * step;
            wide.reshape_dims(&d)?.narrow(dim as isize, 0, (len - 1) * step + 1)?
        };
        let used = spread.dims()[dim];
        let mut parts = vec![];
        let before = zeros(start, self)?;
        let after = zeros(size - start - used, self)?;
        if start > 0 {
            parts.push(&before);
        }
        parts.push(&spread);
        if size - start - used > 0 {
            parts.push(&after);
        }
        Tensor::cat(&parts, dim as isize)
    }
}
