//! Indexing with index tensors: gather, scatter_add, index_select, embedding,
//! one_hot. Index tensors are i32 or u32 (PyTorch uses int64); an index out of
//! range is reported as an error when the values are computed.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::{Op, OpKind, State, Value};
use crate::layout::Layout;
use crate::primitive::{Caller, IndexOp};
use crate::shape::norm_axis;
use crate::tensor::Tensor;

fn check_index(op: &'static str, index: &Tensor) -> Result<()> {
    if !matches!(index.dtype(), DType::I32 | DType::U32) {
        bail!(DType, op, "expected an i32 or u32 index tensor, got {}", index.dtype());
    }
    Ok(())
}

impl Tensor {
    /// `out[i][j] = self[i][index[i][j]]` for `dim = 1` (and likewise for any
    /// dim); `index` has the input's rank and is no larger in the other dims.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        self.gather_as(Caller::Gather, dim, index)
    }

    /// [`Tensor::gather`] on behalf of the public op `caller`, whose name its errors carry.
    pub(crate) fn gather_as(&self, caller: Caller, dim: isize, index: &Tensor) -> Result<Tensor> {
        check_index(caller.name(), index)?;
        self.check_same_device(caller.name(), index)?;
        let d = norm_axis(caller.name(), dim, self.rank().max(1))?;
        if index.rank() != self.rank() {
            bail!(Shape, caller.name(), "index of shape {:?} must have the same rank as the input {:?}", index.dims(), self.dims());
        }
        for i in 0..self.rank() {
            if i != d && index.dims()[i] > self.dims()[i] {
                bail!(
                    Shape,
                    caller.name(),
                    "index of shape {:?} is larger than the input {:?} in dim {i}",
                    index.dims(),
                    self.dims()
                );
            }
        }
        if self.rank() == 0 {
            return self.reshape_dims(&[1])?.gather_as(caller, 0, &index.reshape_dims(&[1])?)?.reshape_dims(&[]);
        }
        let out = Tensor::from_op(OpKind::Index(IndexOp::Gather { dim: d, caller }), &[self, index], self.dtype(), self.device(), index.dims().to_vec())?;
        let (idx, dims) = (index.detach(), self.dims().to_vec());
        Ok(out.track(&[self], move |g, _| Ok(vec![Some(Tensor::zeros(&dims, g.dtype(), g.device())?.scatter_add(d as isize, &idx, g)?)])))
    }

    /// A copy of `self` with `src[p]` added at `p` with `p[dim] = index[p]`
    /// for every position `p` of `index` (PyTorch `scatter_add`).
    pub fn scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        self.scatter_add_as(Caller::ScatterAdd, dim, index, src)
    }

    /// [`Tensor::scatter_add`] on behalf of the public op `caller`, whose name its errors carry.
    pub(crate) fn scatter_add_as(&self, caller: Caller, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        check_index(caller.name(), index)?;
        self.check_same_device(caller.name(), index)?;
        self.check_same_device(caller.name(), src)?;
        let d = norm_axis(caller.name(), dim, self.rank().max(1))?;
        if index.rank() != self.rank() || src.rank() != self.rank() {
            bail!(
                Shape,
                caller.name(),
                "input {:?}, index {:?} and src {:?} must have the same rank",
                self.dims(),
                index.dims(),
                src.dims()
            );
        }
        for i in 0..self.rank() {
            if index.dims()[i] > src.dims()[i] || (i != d && index.dims()[i] > self.dims()[i]) {
                bail!(
                    Shape,
                    caller.name(),
                    "index {:?} must be no larger than src {:?} in every dim and than the input {:?} outside dim {d}",
                    index.dims(),
                    src.dims(),
                    self.dims()
                );
            }
        }
        if self.rank() == 0 {
            let one = |t: &Tensor| t.reshape_dims(&[1]);
            return one(self)?.scatter_add_as(caller, 0, &one(index)?, &one(src)?)?.reshape_dims(&[]);
        }
        let src = src.to_dtype(self.dtype())?;
        let out = Tensor::from_op(
            OpKind::Index(IndexOp::ScatterAdd { dim: d, caller }),
            &[self, index, &src],
            self.dtype(),
            self.device(),
            self.dims().to_vec(),
        )?;
        if !self.dtype().is_float() {
            return Ok(out);
        }
        let idx = index.detach();
        Ok(out.track(&[self, &src], move |g, needs| {
            let gs = if needs[1] { Some(g.gather(d as isize, &idx)?) } else { None };
            Ok(vec![Some(g.clone()), gs])
        }))
    }

    /// If `self` is a pending `zeros.scatter_add(0, index, src)` whose
    /// `index` repeats one value along each row (what `index_select` and
    /// `embedding` record as their table's gradient), that index's values
    /// `[T]` and `src` `[T, D]`: the rows the sum would add, without
    /// computing it. Data-parallel training exchanges those rows instead of
    /// a word embedding's whole gradient, of which a batch touches a few.
    pub(crate) fn as_row_scatter(&self) -> Option<(Tensor, Tensor)> {
        let whole = Layout::contiguous(&self.value.node.dims);
        if self.rank() != 2 || self.value.layout.strides() != whole.strides() || self.value.layout.offset() != 0 || self.dims() != whole.dims() {
            return None;
        }
        let state = self.value.node.state();
        let State::Pending(op) = &*state else { return None };
        let (OpKind::Index(IndexOp::ScatterAdd { dim: 0, .. }), [zeros, index, src]) = (&op.kind, &op.inputs[..]) else { return None };
        let zero = matches!(&*zeros.node.state(), State::Pending(Op { kind: OpKind::Const(c), .. }) if *c == 0.0);
        let (idims, istrides) = (index.layout.dims(), index.layout.strides());
        if !zero || idims.len() != 2 || istrides[1] != 0 || src.layout.dims() != idims || idims[1] != self.dims()[1] {
            return None;
        }
        let rows = index.layout.slice(1, 0, 1, 1).squeeze(1);
        let ids = Tensor { value: Value { node: index.node.clone(), layout: rows }, grad: None };
        Some((ids, Tensor { value: src.clone(), grad: None }))
    }

    /// The entries of `self` along `dim` at the positions in the 1-D `index`.
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        self.index_select_as(Caller::IndexSelect, dim, index)
    }

    /// [`Tensor::index_select`] on behalf of the public op `caller`, whose name its errors carry.
    pub(crate) fn index_select_as(&self, caller: Caller, dim: isize, index: &Tensor) -> Result<Tensor> {
        check_index(caller.name(), index)?;
        self.check_same_device(caller.name(), index)?;
        if index.rank() > 1 {
            bail!(Shape, caller.name(), "expected a 1-D index, got shape {:?}", index.dims());
        }
        let index = index.flatten_all()?;
        if self.rank() == 0 {
            return self.reshape_dims(&[1])?.index_select_as(caller, 0, &index)?.reshape_dims(&[]);
        }
        let d = norm_axis(caller.name(), dim, self.rank())?;
        let mut dims = self.dims().to_vec();
        dims[d] = index.numel();
        let out = Tensor::from_op(OpKind::Index(IndexOp::IndexSelect { dim: d, caller }), &[self, &index], self.dtype(), self.device(), dims)?;
        let (idx, src) = (index.detach(), self.dims().to_vec());
        Ok(out.track(&[self], move |g, _| {
            // Scatter the rows back: the 1-D index, expanded along every other dim.
            let mut shape = vec![1usize; g.rank()];
            shape[d] = idx.numel();
            let full = idx.reshape_dims(&shape)?.broadcast_to(g.dims())?;
            Ok(vec![Some(Tensor::zeros(&src, g.dtype(), g.device())?.scatter_add(d as isize, &full, g)?)])
        }))
    }

    /// Embedding lookup: rows of the `[num, dim]` table `self` for each index,
    /// giving `index.shape + [dim]`.
    pub fn embedding(&self, index: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 {
            bail!(Shape, "embedding", "expected a 2-D weight [num_embeddings, dim], got {:?}", self.dims());
        }
        let mut dims = index.dims().to_vec();
        dims.push(self.dims()[1]);
        self.index_select_as(Caller::Embedding, 0, &index.flatten_all()?)?.reshape_dims(&dims)
    }

    /// One-hot encoding of class indices, as i32 with a new last dim of
    /// `num_classes` (PyTorch returns int64). An index outside
    /// `0..num_classes` is an error when computed.
    pub fn one_hot(&self, num_classes: usize) -> Result<Tensor> {
        check_index("one_hot", self)?;
        let mut dims = self.dims().to_vec();
        dims.push(num_classes);
        let idx = self.unsqueeze(-1)?;
        let mut ones_dims = self.dims().to_vec();
        ones_dims.push(1);
        let zeros = Tensor::zeros(&dims, DType::I32, self.device())?;
        let ones = Tensor::ones(&ones_dims, DType::I32, self.device())?;
        zeros.scatter_add_as(Caller::OneHot, -1, &idx, &ones)
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Tensor};

    /// The rows of a table's gradient are recognised where `embedding`
    /// alone made it, and nowhere else.
    #[test]
    fn a_scatter_of_rows_is_recognised_only_as_recorded_by_a_lookup() {
        let d = Device::Cpu;
        let ids = Tensor::from_vec(vec![3i32, 0, 3, 7, 1, 0], &[2, 3], d).unwrap();
        let weight = Tensor::randn(&[9, 4], DType::F32, d).unwrap().requires_grad().unwrap();
        let out = weight.embedding(&ids).unwrap();
        let up = Tensor::randn(&[2, 3, 4], DType::F32, d).unwrap();
        out.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
        let g = weight.grad().unwrap();
        let (rows, src) = g.as_row_scatter().expect("embedding's gradient is a scatter of rows");
        assert_eq!(rows.to_vec::<i32>().unwrap(), vec![3, 0, 3, 7, 1, 0]);
        assert_eq!(src.to_vec::<f32>().unwrap(), up.to_vec::<f32>().unwrap());
        // Once computed, or seen through a view, it is just a tensor.
        assert!(g.t().unwrap().as_row_scatter().is_none());
        g.realize().unwrap();
        assert!(g.as_row_scatter().is_none());
        // A table that also enters the loss elsewhere: a sum of gradients.
        let w = Tensor::randn(&[9, 4], DType::F32, d).unwrap().requires_grad().unwrap();
        w.embedding(&ids).unwrap().sum_all().unwrap().add(w.sqr().unwrap().sum_all().unwrap()).unwrap().backward().unwrap();
        assert!(w.grad().unwrap().as_row_scatter().is_none());
        // scatter_add into anything but zeros, or with an index that varies
        // along a row, is no lookup's gradient.
        let idx = Tensor::from_vec(vec![1i32, 2, 0, 1], &[2, 2], d).unwrap();
        let src = Tensor::ones(&[2, 2], DType::F32, d).unwrap();
        assert!(Tensor::zeros(&[3, 2], DType::F32, d).unwrap().scatter_add(0, &idx, &src).unwrap().as_row_scatter().is_none());
        let rowwise = Tensor::from_vec(vec![1i32, 2], &[2, 1], d).unwrap().broadcast_to(&[2, 2]).unwrap();
        assert!(Tensor::ones(&[3, 2], DType::F32, d).unwrap().scatter_add(0, &rowwise, &src).unwrap().as_row_scatter().is_none());
        let (r, _) = Tensor::zeros(&[3, 2], DType::F32, d).unwrap().scatter_add(0, &rowwise, &src).unwrap().as_row_scatter().unwrap();
        assert_eq!(r.to_vec::<i32>().unwrap(), vec![1, 2]);
    }
}
