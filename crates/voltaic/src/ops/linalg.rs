//! Matrix products with PyTorch's `matmul` semantics.

use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::Op;
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
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
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
        let batch = broadcast_shapes("matmul", &a.dims()[..a.rank() - 2], &b.dims()[..b.rank() - 2])?;
        let mut da = batch.clone();
        da.extend([m, ka]);
        let mut db = batch.clone();
        db.extend([ka, n]);
        let (a, b) = (a.broadcast_to(&da)?, b.broadcast_to(&db)?);
        let mut dims = batch.clone();
        dims.extend([m, n]);
        let out = Tensor::from_op(Op::Matmul(a.clone(), b.clone()), dt, self.device(), dims.clone())?;
        let out = if dt.is_float() {
            let (ad, bd) = (a.detach(), b.detach());
            out.track(&[&a, &b], move |g, needs| {
                let ga = if needs[0] { Some(g.matmul(&bd.transpose(-1, -2)?)?) } else { None };
                let gb = if needs[1] { Some(ad.transpose(-1, -2)?.matmul(g)?) } else { None };
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
