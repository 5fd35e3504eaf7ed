//! Matrix products with PyTorch's `matmul` semantics.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::OpKind;
use crate::qtensor::MatmulRhs;
use crate::shape::broadcast_shapes;
use crate::tensor::Tensor;

impl Tensor {
    /// Matrix product like `torch.matmul`: 1-D @ 1-D is a dot product, a 1-D
    /// operand is treated as a row (left) or column (right) vector and that
    /// dim is removed again, and batch dims broadcast.
    ///
    /// ```
    /// use voltaic::{Tensor, Device, DType};
    /// let a = Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?;
    /// let b = Tensor::ones(&[4, 5], DType::F32, Device::Cpu)?;
    /// let e = a.matmul(&b).unwrap_err();
    /// assert_eq!(e.to_string(), "matmul: cannot multiply [2, 3] by [4, 5]: inner dimensions 3 and 4 differ");
    /// # Ok::<(), voltaic::Error>(())
    /// ```
    ///
    /// The right operand may also be a transposed quantized weight
    /// (`x.matmul(&w_q.t())`, see [`crate::QTensor`]).
    pub fn matmul<R: MatmulRhs + ?Sized>(&self, rhs: &R) -> Result<Tensor> {
        rhs.matmul_from(self)
    }

    /// `self @ rhs` for a dense right operand.
    pub(crate) fn matmul_dense(&self, rhs: &Tensor) -> Result<Tensor> {
        if super::autocast::autocast_dtype().is_some() {
            let (a, b) = (super::autocast::low(self)?, super::autocast::low(rhs)?);
            let _off = super::autocast::AutocastGuard::new(None);
            return a.matmul_dense(&b);
        }
        self.check_same_device("matmul", rhs)?;
        let (ra, rb) = (self.rank(), rhs.rank());
        if ra == 0 || rb == 0 {
            bail!(Shape, "matmul", "both operands need at least 1 dim, got shapes {:?} and {:?}", self.dims(), rhs.dims());
        }
        let ka = self.dims()[ra - 1];
        let kb = if rb == 1 { rhs.dims()[0] } else { rhs.dims()[rb - 2] };
        if ka != kb {
            bail!(
                Shape,
                "matmul",
                "cannot multiply {:?} by {:?}: inner dimensions {ka} and {kb} differ",
                self.dims(),
                rhs.dims()
            );
        }
        if self.dtype() == DType::Bool || rhs.dtype() == DType::Bool {
            bail!(DType, "matmul", "bool tensors cannot be multiplied; cast them first");
        }
        let dt = DType::promote(self.dtype(), rhs.dtype());
        let a = if ra == 1 { self.unsqueeze(0)? } else { self.clone() }.to_dtype(dt)?;
        let b = if rb == 1 { rhs.unsqueeze(1)? } else { rhs.clone() }.to_dtype(dt)?;
        let (m, n) = (a.dims()[a.rank() - 2], b.dims()[b.rank() - 1]);
        let batch = broadcast_shapes("matmul", &a.dims()[..a.rank() - 2], &b.dims()[..b.rank() - 2]).map_err(|_| {
            crate::error::err!(Shape, "matmul", "cannot multiply {:?} by {:?}: the batch dims {:?} and {:?} do not broadcast", self.dims(), rhs.dims(), &a.dims()[..a.rank() - 2], &b.dims()[..b.rank() - 2])
        })?;
        let mut da = batch.clone();
        da.extend([m, ka]);
        let mut db = batch.clone();
        db.extend([ka, n]);
        let (a0, b0) = (a, b);
        let (a, b) = (a0.broadcast_to(&da)?, b0.broadcast_to(&db)?);
        let mut dims = batch.clone();
        dims.extend([m, n]);
        let out = Tensor::from_op(OpKind::Matmul, &[&a, &b], dt, self.device(), dims.clone())?;
        let out = if dt.is_float() {
            // Gradients for the operands as given (before broadcasting), so a
            // matrix shared across the batch gets its gradient from one large
            // matmul over the batch instead of a batch of products then a sum.
            let (ad, bd) = (a.detach(), b.detach());
            let (a_dims, b_dims) = (a0.dims().to_vec(), b0.dims().to_vec());
            let b_cols = column_major(&b0);
            out.track(&[&a0, &b0], move |g, needs| {
                let ga = if needs[0] { Some(matmul_grad_lhs(g, &bd, &a_dims)?) } else { None };
                let gb = if needs[1] { Some(matmul_grad_rhs(&ad, g, &b_dims, b_cols)?) } else { None };
                Ok(vec![ga, gb])
            })
        } else {
            out
        };
        // Drop the dims that 1-D operands added.
        let mut final_dims = batch;
        if ra > 1 {
            final_dims.push(m);
        }
        if rb > 1 {
            final_dims.push(n);
        }
        if final_dims != dims {
            return out.reshape_dims(&final_dims);
        }
        Ok(out)
    }
}

/// `[batch..., r, c]` to `[r, batch * c]`: the batch folded into the columns.
fn fold_batch_into_cols(t: &Tensor) -> Result<Tensor> {
    let r = t.rank();
    let batch: usize = t.dims()[..r - 2].iter().product();
    let (rows, cols) = (t.dims()[r - 2], t.dims()[r - 1]);
    let mut perm: Vec<isize> = vec![(r - 2) as isize];
    perm.extend((0..r - 2).map(|d| d as isize));
    perm.push((r - 1) as isize);
    t.permute(&perm)?.reshape_dims(&[rows, batch * cols])
}

/// Gradient of `a @ b` for `a` of shape `a_dims` (broadcast to `g`'s batch):
/// `g @ b^T`, summed over the batch dims that `a` was broadcast along.
fn matmul_grad_lhs(g: &Tensor, b: &Tensor, a_dims: &[usize]) -> Result<Tensor> {
    if g.rank() > 2 && a_dims[..a_dims.len() - 2].iter().all(|&d| d == 1) {
        // sum_z g_z @ b_z^T = [m, batch*n] @ [k, batch*n]^T
        return fold_batch_into_cols(g)?.matmul(&fold_batch_into_cols(b)?.t()?)?.reshape_dims(a_dims);
    }
    g.matmul(&b.transpose(-1, -2)?)?.sum_to(a_dims)
}

/// Whether `t` is a matrix stored column by column, as `w.t()` is for a
/// row-major `w` (a linear layer's weight).
fn column_major(t: &Tensor) -> bool {
    let (d, s) = (t.dims(), t.layout().strides());
    t.rank() == 2 && d[0] > 1 && d[1] > 1 && s[0] == 1 && s[1] == d[0]
}

/// Gradient of `a @ b` for `b` of shape `b_dims`: `a^T @ g`, summed over the
/// batch dims that `b` was broadcast along.
///
/// A `b` stored column-major (`column_major`, a linear layer's `w.t()`) gets
/// its gradient in the same order, as `(g^T @ a)^T`: the transpose's own
/// gradient is then `w`'s in `w`'s order, and what reads a weight's
/// gradient (the optimizer's update, a gradient scaler's check, a clip)
/// reads it in order instead of across.
fn matmul_grad_rhs(a: &Tensor, g: &Tensor, b_dims: &[usize], column_major: bool) -> Result<Tensor> {
    let nb = b_dims.len();
    if b_dims[..nb - 2].iter().all(|&d| d == 1) {
        // sum_z a_z^T @ g_z = [batch*m, k]^T @ [batch*m, n]
        let r = g.rank();
        let rows: usize = g.dims()[..r - 1].iter().product();
        let (a2, g2) = if r > 2 { (a.reshape_dims(&[rows, b_dims[nb - 2]])?, g.reshape_dims(&[rows, b_dims[nb - 1]])?) } else { (a.clone(), g.clone()) };
        let gb = if column_major { g2.t()?.matmul(&a2)?.t()? } else { a2.t()?.matmul(&g2)? };
        return if nb == 2 { Ok(gb) } else { gb.reshape_dims(b_dims) };
    }
    a.transpose(-1, -2)?.matmul(g)?.sum_to(b_dims)
}
