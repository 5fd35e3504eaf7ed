//! Layouts: how a tensor's multi-index maps to an offset in its buffer.
//!
//! Every view (reshape, permute, expand, narrow, slicing, squeeze, ...) is a
//! new layout over the same buffer; kernels read their inputs through layouts,
//! so views cost nothing until `contiguous()`.

use crate::error::{bail, Result};
use crate::shape::Shape;

/// Shape, strides (in elements) and offset of a strided view into a buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub(crate) shape: Shape,
    pub(crate) strides: crate::shape::Dims,
    pub(crate) offset: usize,
}

impl Layout {
    /// The contiguous row-major layout of a shape.
    pub fn contiguous(shape: &[usize]) -> Layout {
        let shape = Shape::new(shape);
        let strides = shape.contiguous_strides();
        Layout { shape, strides, offset: 0 }
    }
    /// The shape seen through this layout.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// Dimensions seen through this layout.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    /// Offset of element zero in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of elements seen.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// Row-major contiguous (strides of size-1 dimensions are ignored).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for i in (0..self.strides.len()).rev() {
            let d = self.shape.0[i];
            if d != 1 && self.strides[i] != acc {
                return false;
            }
            acc *= d;
        }
        true
    }

    /// Contiguous and starting at offset zero: element i lives at i.
    pub fn is_identity(&self) -> bool {
        self.offset == 0 && self.is_contiguous()
    }

    /// Offset of a multi-index.
    pub fn offset_of(&self, idx: &[usize]) -> usize {
        self.offset + idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>()
    }

    /// One past the largest offset this layout reaches (0 when empty).
    pub fn span(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        self.offset + self.shape.0.iter().zip(&self.strides).map(|(d, s)| (d - 1) * s).sum::<usize>() + 1
    }

    /// Reorder dimensions; `perm` must be a permutation of `0..rank`.
    pub fn permute(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: Shape(perm.iter().map(|&p| self.shape.0[p]).collect()),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }

    /// Broadcast to `shape` (NumPy rules, stride 0 for new or stretched dims).
    pub fn broadcast_to(&self, op: &'static str, shape: &[usize]) -> Result<Layout> {
        let r = shape.len();
        let me = self.shape.dims();
        if me.len() > r {
            bail!(Shape, op, "cannot broadcast shape {me:?} to {shape:?}: it has more dimensions");
        }
        let lead = r - me.len();
        let mut strides = vec![0; r];
        for i in 0..r {
            if i < lead {
                continue;
            }
            let d = me[i - lead];
            if d == shape[i] {
                strides[i] = self.strides[i - lead];
            } else if d == 1 {
                strides[i] = 0;
            } else {
                bail!(
                    Shape,
                    op,
                    "cannot broadcast shape {me:?} to {shape:?}: dimension {} is {d}, expected 1 or {}",
                    i - lead,
                    shape[i]
                );
            }
        }
        Ok(Layout { shape: Shape::new(shape), strides: strides.into(), offset: self.offset })
    }

    /// Elements `start..start + len` (with `step`) of dimension `dim`.
    pub fn slice(&self, dim: usize, start: usize, len: usize, step: usize) -> Layout {
        let mut l = self.clone();
        l.offset += if len == 0 { 0 } else { start * self.strides[dim] };
        l.shape.0[dim] = len;
        l.strides[dim] *= step;
        l
    }

    /// Insert a dimension of size 1 before `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Layout {
        let mut l = self.clone();
        let stride = if dim < l.strides.len() { l.strides[dim] * l.shape.0[dim] } else { 1 };
        l.shape.0.insert(dim, 1);
        l.strides.insert(dim, stride);
        l
    }

    /// Remove dimension `dim`, which must be of size 1.
    pub fn squeeze(&self, dim: usize) -> Layout {
        let mut l = self.clone();
        l.shape.0.remove(dim);
        l.strides.remove(dim);
        l
    }

    /// The same elements in a new shape, without copying, if the strides allow
    /// it (PyTorch's `view` rule); `None` when a copy is needed.
    pub fn reshape(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() || self.numel() == 0 {
            let mut l = Layout::contiguous(shape);
            l.offset = self.offset;
            return Some(l);
        }
        // Group the old dims into chunks that are contiguous among themselves,
        // then split the new dims over those chunks.
        let old: Vec<(usize, usize)> =
            self.shape.0.iter().zip(&self.strides).filter(|(d, _)| **d != 1).map(|(d, s)| (*d, *s)).collect();
        let mut new_strides = vec![0usize; shape.len()];
        let mut oi = 0;
        let mut ni = 0;
        while ni < shape.len() || oi < old.len() {
            // Skip new size-1 dims.
            if ni < shape.len() && shape[ni] == 1 {
                new_strides[ni] = 1;
                ni += 1;
                continue;
            }
            if oi >= old.len() {
                return None;
            }
            // A chunk of old dims that is contiguous in memory.
            let chunk_start = oi;
            let mut chunk_numel = old[oi].0;
            while oi + 1 < old.len() && old[oi].1 == old[oi + 1].0 * old[oi + 1].1 {
                oi += 1;
                chunk_numel *= old[oi].0;
            }
            let chunk_inner_stride = old[oi].1;
            oi += 1;
            let _ = chunk_start;
            // Assign new dims to this chunk until its numel is consumed.
            let mut acc = 1;
            let first_new = ni;
            while ni < shape.len() && acc * shape[ni] <= chunk_numel && (acc < chunk_numel || shape[ni] == 1) {
                acc *= shape[ni];
                ni += 1;
            }
            if acc != chunk_numel {
                return None;
            }
            let mut st = chunk_inner_stride;
            for j in (first_new..ni).rev() {
                new_strides[j] = st;
                st *= shape[j];
            }
        }
        Some(Layout { shape: Shape::new(shape), strides: new_strides.into(), offset: self.offset })
    }

    /// Merge neighbouring dimensions that are contiguous with each other in
    /// every one of `layouts` (all of the same shape). Returns the merged shape
    /// and the merged layouts; element order is unchanged.
    pub(crate) fn coalesce(layouts: &[&Layout], shape: &[usize]) -> (Vec<usize>, Vec<Layout>) {
        let mut dims: Vec<usize> = Vec::new();
        let mut strides: Vec<Vec<usize>> = vec![Vec::new(); layouts.len()];
        for i in 0..shape.len() {
            if shape[i] == 1 && shape.len() > 1 {
                continue;
            }
            let merge = !dims.is_empty()
                && layouts.iter().enumerate().all(|(k, l)| {
                    let prev = *strides[k].last().unwrap();
                    prev == l.strides[i] * shape[i]
                });
            if merge {
                *dims.last_mut().unwrap() *= shape[i];
                for (k, l) in layouts.iter().enumerate() {
                    *strides[k].last_mut().unwrap() = l.strides[i];
                }
            } else {
                dims.push(shape[i]);
                for (k, l) in layouts.iter().enumerate() {
                    strides[k].push(l.strides[i]);
                }
            }
        }
        if dims.is_empty() {
            dims.push(1);
            for s in strides.iter_mut() {
                s.push(0);
            }
        }
        let out = layouts
            .iter()
            .zip(strides)
            .map(|(l, s)| Layout { shape: Shape::new(&dims), strides: s.into(), offset: l.offset })
            .collect();
        (dims, out)
    }

    /// Compose `view` (a layout over the contiguous output of shape `inner.shape`)
    /// with `inner` (which maps that output's index into a buffer), when `view`
    /// only narrows, permutes, broadcasts, drops or adds size-1 dims. `None`
    /// when it reshapes across dimensions, which needs index arithmetic.
    pub(crate) fn compose(view: &Layout, inner: &Layout) -> Option<Layout> {
        let pdims = inner.dims();
        let pstrides = Shape::new(pdims).contiguous_strides();
        // The view's offset as a multi-index of the inner shape.
        let mut rem = view.offset;
        let mut base = vec![0usize; pdims.len()];
        // An empty inner shape has zero strides (and nothing to read).
        if pdims.contains(&0) {
            return None;
        }
        for j in 0..pdims.len() {
            base[j] = rem / pstrides[j];
            rem %= pstrides[j];
        }
        let mut used = vec![false; pdims.len()];
        let mut strides = vec![0usize; view.dims().len()];
        for (i, (&d, &s)) in view.dims().iter().zip(&view.strides).enumerate() {
            if d == 1 || s == 0 {
                continue;
            }
            let j = (0..pdims.len()).find(|&j| pdims[j] > 1 && pstrides[j] == s)?;
            if used[j] || base[j] + d > pdims[j] {
                return None;
            }
            used[j] = true;
            strides[i] = inner.strides[j];
        }
        Some(Layout { shape: view.shape.clone(), strides: strides.into(), offset: inner.offset_of(&base) })
    }

    /// Visit every offset this layout reaches, in row-major order.
    pub(crate) fn for_each_offset(&self, mut f: impl FnMut(usize)) {
        let n = self.numel();
        if n == 0 {
            return;
        }
        let dims = self.dims();
        let r = dims.len();
        let mut idx = vec![0usize; r];
        let mut off = self.offset;
        for _ in 0..n {
            f(off);
            for k in (0..r).rev() {
                idx[k] += 1;
                off += self.strides[k];
                if idx[k] < dims[k] {
                    break;
                }
                off -= self.strides[k] * dims[k];
                idx[k] = 0;
            }
        }
    }

    /// Copy the elements this layout sees of `s` into a new Vec, in row-major order.
    pub(crate) fn gather<T: Copy>(&self, s: &[T]) -> Vec<T> {
        if self.is_contiguous() {
            return s[self.offset..self.offset + self.numel()].to_vec();
        }
        let mut out = Vec::with_capacity(self.numel());
        self.for_each_offset(|o| out.push(s[o]));
        out
    }
}

/// Unravel a linear index into a multi-index of `dims`.
pub(crate) fn unravel(mut i: usize, dims: &[usize], out: &mut [usize]) {
    for k in (0..dims.len()).rev() {
        let d = dims[k].max(1);
        out[k] = i % d;
        i /= d;
    }
}
