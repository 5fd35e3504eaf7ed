//! Shapes, axis normalisation and NumPy broadcasting.

use crate::error::{bail, Result};

/// Dimensions or strides, inline up to 6 (no allocation for common ranks).
pub(crate) type Dims = smallvec::SmallVec<[usize; 6]>;

/// The dimensions of a tensor, outermost first.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub(crate) Dims);

impl Shape {
    /// A shape from its dimensions.
    pub fn new(dims: &[usize]) -> Shape {
        Shape(Dims::from_slice(dims))
    }
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements (1 for a scalar, 0 if any dimension is 0).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Row-major strides of a contiguous tensor of this shape.
    pub(crate) fn contiguous_strides(&self) -> Dims {
        let mut s = Dims::from_elem(0, self.0.len());
        let mut acc = 1;
        for i in (0..self.0.len()).rev() {
            s[i] = acc;
            acc *= self.0[i];
        }
        s
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}
impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}
impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Shape {
        Shape::new(d)
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Shape {
        Shape::new(&d)
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Shape {
        Shape::new(&d)
    }
}

/// Turn a possibly negative axis into an index in `0..rank`.
pub(crate) fn norm_axis(op: &'static str, axis: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        bail!(Axis, op, "axis {axis} is out of range for a tensor of rank {rank} (expected {}..{})", -r, r);
    }
    Ok(a as usize)
}

/// Normalise a set of axes: each in range, none repeated, sorted. An empty set
/// means every axis, as in PyTorch's `sum()` with no `dim`.
pub(crate) fn norm_axes(op: &'static str, axes: &[isize], rank: usize) -> Result<Vec<usize>> {
    if axes.is_empty() {
        return Ok((0..rank).collect());
    }
    let mut out = Vec::with_capacity(axes.len());
    for &a in axes {
        let n = norm_axis(op, a, rank)?;
        if out.contains(&n) {
            bail!(Axis, op, "axis {a} appears more than once in {axes:?}");
        }
        out.push(n);
    }
    out.sort_unstable();
    Ok(out)
}

/// The broadcast shape of two shapes under NumPy rules.
pub(crate) fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => bail!(
                Shape,
                op,
                "shapes {a:?} and {b:?} cannot be broadcast together: dimension {i} is {da} and {db}"
            ),
        };
    }
    Ok(out)
}

/// Elements of a shape, failing instead of overflowing. The product of the
/// non-zero dims must fit as well, even when a zero dim makes the shape
/// empty: strides are products of dims and must not overflow either.
pub(crate) fn checked_numel(op: &'static str, dims: &[usize]) -> Result<usize> {
    let mut n: usize = 1;
    for &d in dims.iter().filter(|&&d| d != 0) {
        n = match n.checked_mul(d) {
            Some(v) if v <= isize::MAX as usize / 8 => v,
            _ => bail!(Shape, op, "shape {dims:?} has too many elements"),
        };
    }
    Ok(if dims.contains(&0) { 0 } else { n })
}
