//! Joining and splitting: cat, stack, split, chunk.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::OpKind;
use crate::primitive::IndexOp;
use crate::shape::norm_axis;
use crate::tensor::Tensor;

impl Tensor {
    /// How many parts one `cat` kernel on `device` reads (beyond that,
    /// `cat` joins groups and then the groups).
    pub(crate) fn cat_parts_per_kernel(device: crate::Device) -> Result<usize> {
        Ok(crate::backend::executor(device)?.capabilities().max_inputs.max(2))
    }

    /// Concatenate along `dim`; all tensors must agree on every other dim.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            bail!(Value, "cat", "expected at least one tensor, got none");
        };
        let r = first.rank();
        if r == 0 {
            bail!(Shape, "cat", "zero-dimensional tensors cannot be concatenated");
        }
        let d = norm_axis("cat", dim, r)?;
        let mut dt = first.dtype();
        for t in tensors {
            first.check_same_device("cat", t)?;
            let same = t.rank() == r && (0..r).all(|i| i == d || t.dims()[i] == first.dims()[i]);
            if !same {
                bail!(
                    Shape,
                    "cat",
                    "expected shapes matching {:?} except in dim {d}, got {:?}",
                    first.dims(),
                    t.dims()
                );
            }
            dt = DType::promote(dt, t.dtype());
        }
        if tensors.len() == 1 {
            return first.to_dtype(dt);
        }
        // One kernel reads every part: more parts than the device lets a
        // kernel bind are joined a group at a time.
        let max = Tensor::cat_parts_per_kernel(first.device())?;
        if tensors.len() > max {
            let groups = tensors.chunks(max).map(|g| Tensor::cat(g, d as isize)).collect::<Result<Vec<_>>>()?;
            return Tensor::cat(&groups.iter().collect::<Vec<_>>(), d as isize);
        }
        let mut dims = first.dims().to_vec();
        dims[d] = tensors.iter().map(|t| t.dims()[d]).sum();
        let parts = tensors.iter().map(|t| t.to_dtype(dt)).collect::<Result<Vec<_>>>()?;
        let sizes: Vec<usize> = parts.iter().map(|t| t.dims()[d]).collect();
        let refs: Vec<&Tensor> = parts.iter().collect();
        let out = Tensor::from_op(OpKind::Index(IndexOp::Cat { dim: d }), &refs, dt, first.device(), dims)?;
        Ok(out.track(&parts.iter().collect::<Vec<_>>(), move |g, _| {
            let mut at = 0;
            let mut grads = Vec::with_capacity(sizes.len());
            for &n in &sizes {
                grads.push(Some(g.narrow(d as isize, at, n)?));
                at += n;
            }
            Ok(grads)
        }))
    }

    /// Stack along a new dim `dim`; all tensors must have the same shape.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            bail!(Value, "stack", "expected at least one tensor, got none");
        };
        for t in tensors {
            if t.dims() != first.dims() {
                bail!(Shape, "stack", "expected every tensor to have shape {:?}, got {:?}", first.dims(), t.dims());
            }
        }
        let d = norm_axis("stack", dim, first.rank() + 1)? as isize;
        let parts = tensors.iter().map(|t| t.unsqueeze(d)).collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts.iter().collect::<Vec<_>>(), d)
    }

    /// Views of consecutive pieces of `size` along `dim` (the last may be smaller).
    pub fn split(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_axis("split", dim, self.rank())?;
        if size == 0 {
            bail!(Value, "split", "split size must be positive, got 0");
        }
        let n = self.dims()[d];
        let mut out = vec![];
        let mut s = 0;
        while s < n {
            let len = size.min(n - s);
            out.push(self.narrow(d as isize, s, len)?);
            s += len;
        }
        if n == 0 {
            out.push(self.clone());
        }
        Ok(out)
    }

    /// Views of pieces with the given sizes along `dim`; they must add up to the dim's size.
    pub fn split_with_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_axis("split_with_sizes", dim, self.rank())?;
        // Summed in u128: the sizes themselves may overflow usize.
        let total: u128 = sizes.iter().map(|&s| s as u128).sum();
        if total != self.dims()[d] as u128 {
            bail!(Shape, "split_with_sizes", "sizes {sizes:?} add up to {total}, but dim {d} has size {}", self.dims()[d]);
        }
        let mut s = 0;
        sizes
            .iter()
            .map(|&len| {
                let t = self.narrow(d as isize, s, len);
                s += len;
                t
            })
            .collect()
    }

    /// Split into `chunks` pieces of equal size (the last may be smaller), as PyTorch `chunk`.
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        if chunks == 0 {
            bail!(Value, "chunk", "number of chunks must be positive, got 0");
        }
        let d = norm_axis("chunk", dim, self.rank())?;
        if self.dims()[d] == 0 {
            // An empty dim gives `chunks` empty pieces, as PyTorch.
            let mut pieces = Vec::new();
            if pieces.try_reserve_exact(chunks).is_err() {
                bail!(Value, "chunk", "cannot make {chunks} pieces");
            }
            pieces.resize(chunks, self.clone());
            return Ok(pieces);
        }
        let size = self.dims()[d].div_ceil(chunks);
        self.split(size, d as isize)
    }
}
