//! Views against a naive model written here (a row-major Vec and its dims,
//! rearranged element by element): reshape, permute, transpose, t, expand,
//! broadcast_to, narrow, slice, squeeze, unsqueeze, flatten, contiguous;
//! storage sharing; and ops applied to non-contiguous and pending inputs.

mod common;

use common::*;
use voltaic::{DType, Device, Tensor};

type Res = voltaic::Result<()>;
const CPU: Device = Device::Cpu;

/// The naive model: dims and row-major values.
#[derive(Clone, Debug)]
struct Naive {
    dims: Vec<usize>,
    v: Vec<f64>,
}

impl Naive {
    fn new(dims: &[usize], v: Vec<f64>) -> Naive {
        assert_eq!(numel(dims), v.len());
        Naive { dims: dims.to_vec(), v }
    }
    /// Build by evaluating each output index.
    fn gen(dims: Vec<usize>, f: impl Fn(&[usize]) -> f64) -> Naive {
        let v = (0..numel(&dims)).map(|i| f(&unravel(i, &dims))).collect();
        Naive { dims, v }
    }
    fn at(&self, idx: &[usize]) -> f64 {
        self.v[ravel(idx, &self.dims)]
    }
    fn permute(&self, perm: &[usize]) -> Naive {
        let dims = perm.iter().map(|&p| self.dims[p]).collect();
        Naive::gen(dims, |idx| {
            let mut src = vec![0; idx.len()];
            for k in 0..idx.len() {
                src[perm[k]] = idx[k];
            }
            self.at(&src)
        })
    }
    /// Python `x[start:end:step]` along `dim` (step > 0).
    fn slice(&self, dim: usize, start: isize, end: isize, step: usize) -> Naive {
        let picked = py_range(self.dims[dim], start, end, step);
        let mut dims = self.dims.clone();
        dims[dim] = picked.len();
        Naive::gen(dims, |idx| {
            let mut src = idx.to_vec();
            src[dim] = picked[idx[dim]];
            self.at(&src)
        })
    }
    fn expand(&self, dims: &[usize]) -> Naive {
        let lead = dims.len() - self.dims.len();
        Naive::gen(dims.to_vec(), |idx| {
            let src: Vec<usize> = (0..self.dims.len()).map(|k| if self.dims[k] == 1 { 0 } else { idx[lead + k] }).collect();
            self.at(&src)
        })
    }
    fn reshape(&self, dims: &[usize]) -> Naive {
        Naive::new(dims, self.v.clone())
    }
}

/// The indices Python's `range(*slice(start, end, step).indices(n))` visits, computed naively.
fn py_range(n: usize, start: isize, end: isize, step: usize) -> Vec<usize> {
    let n = n as isize;
    let norm = |i: isize| {
        let i = if i < 0 { i + n } else { i };
        i.clamp(0, n)
    };
    let (s, e) = (norm(start), norm(end));
    let mut out = vec![];
    let mut i = s;
    while i < e {
        out.push(i as usize);
        i += step as isize;
    }
    out
}

fn f64_tensor(n: &Naive) -> Tensor {
    Tensor::from_vec(n.v.clone(), &n.dims, CPU).unwrap()
}

/// Distinct values so that any misplaced element shows.
fn iota(dims: &[usize]) -> Naive {
    Naive::new(dims, (0..numel(dims)).map(|i| i as f64 * 0.5 - 3.0).collect())
}

#[track_caller]
fn check(t: &Tensor, n: &Naive, what: &str) {
    assert_eq!(t.dims(), &n.dims[..], "{what}: shape");
    assert_same(&t.to_f64_vec().unwrap(), &n.v, what);
}

/// A random shape with the same number of elements as `dims`.
fn random_reshape(rng: &mut Rng, dims: &[usize]) -> Vec<usize> {
    let n = numel(dims);
    let mut out = vec![];
    if n == 0 {
        let r = 1 + rng.below(3);
        out = (0..r).map(|_| rng.pick(&[1, 2, 3])).collect();
        let z = rng.below(r);
        out[z] = 0;
        return out;
    }
    // Split the prime factors of n into a few dims.
    let mut factors = vec![];
    let mut m = n;
    let mut p = 2;
    while m > 1 {
        while m.is_multiple_of(p) {
            factors.push(p);
            m /= p;
        }
        p += 1;
    }
    let k = 1 + rng.below(4);
    let mut d = vec![1usize; k];
    for f in factors {
        let j = rng.below(k);
        d[j] *= f;
    }
    for x in d {
        out.push(x);
        if rng.below(5) == 0 {
            out.push(1);
        }
    }
    out
}

#[test]
fn reshape_values_and_inferred_dims() -> Res {
    let mut rng = Rng::new(21);
    for _ in 0..40 {
        let dims = rng.shape(4, 2000);
        let n = iota(&dims);
        let x = f64_tensor(&n);
        let nd = random_reshape(&mut rng, &dims);
        let y = x.reshape(&nd.iter().map(|&d| d as isize).collect::<Vec<_>>())?;
        check(&y, &n.reshape(&nd), &format!("reshape {dims:?} -> {nd:?}"));
        // A contiguous tensor reshapes as a view.
        assert!(y.same_storage(&x));
        // -1 inferred, wherever it stands (not possible when another dim is 0).
        if !nd.contains(&0) {
            let j = rng.below(nd.len());
            let mut spelled: Vec<isize> = nd.iter().map(|&d| d as isize).collect();
            spelled[j] = -1;
            check(&x.reshape(&spelled)?, &n.reshape(&nd), &format!("reshape {dims:?} -> {spelled:?}"));
        }
    }
    let x = f64_tensor(&iota(&[2, 3, 4]));
    assert_eq!(x.reshape(&[-1])?.dims(), &[24]);
    assert_eq!(x.reshape(&[4, -1, 2])?.dims(), &[4, 3, 2]);
    assert_eq!(x.reshape(&[1, -1, 1])?.dims(), &[1, 24, 1]);
    assert!(x.reshape(&[5, -1]).unwrap_err().is_shape());
    assert!(x.reshape(&[-1, -1]).is_err());
    assert!(x.reshape(&[25]).unwrap_err().is_shape());
    assert!(x.reshape(&[-2, 12]).is_err());
    assert_eq!(Tensor::scalar(3.0f64, CPU)?.reshape(&[1, 1])?.to_f64_vec()?, vec![3.0]);
    assert_eq!(Tensor::from_vec(vec![7.0f64], &[1, 1], CPU)?.reshape(&[])?.item::<f64>()?, 7.0);
    let e = Tensor::zeros(&[0, 3], DType::F64, CPU)?;
    assert_eq!(e.reshape(&[3, 0, 5])?.dims(), &[3, 0, 5]);
    assert!(e.reshape(&[-1, 0]).is_err(), "-1 with a 0 dim is ambiguous");
    Ok(())
}

#[test]
fn reshape_of_non_contiguous_views() -> Res {
    // [3, 4] transposed is [4, 3] in column order; flattening must copy.
    let n = iota(&[3, 4]);
    let x = f64_tensor(&n);
    let xt = x.t()?;
    let nt = n.permute(&[1, 0]);
    let flat = xt.reshape(&[-1])?;
    check(&flat, &nt.reshape(&[12]), "t().reshape(-1)");
    assert!(!flat.same_storage(&x), "a transposed flatten cannot be a view");
    check(&xt.reshape(&[2, 6])?, &nt.reshape(&[2, 6]), "t().reshape(2, 6)");
    check(&xt.reshape(&[6, 2])?.t()?, &nt.reshape(&[6, 2]).permute(&[1, 0]), "t().reshape(6, 2).t()");
    // Splitting the transposed dim keeps a view.
    let n = iota(&[4, 6]);
    let x = f64_tensor(&n);
    let y = x.t()?.reshape(&[2, 3, 4])?;
    check(&y, &n.permute(&[1, 0]).reshape(&[2, 3, 4]), "[4,6].t().reshape(2,3,4)");
    assert!(y.same_storage(&x));
    // Merging dims that are contiguous among themselves keeps a view.
    let n = iota(&[2, 3, 4, 5]);
    let x = f64_tensor(&n);
    let y = x.permute(&[2, 0, 1, 3])?.reshape(&[4, 6, 5])?;
    check(&y, &n.permute(&[2, 0, 1, 3]).reshape(&[4, 6, 5]), "permute then merge");
    assert!(y.same_storage(&x));
    // Slices with a step, then reshape.
    let y = x.slice(3, 0, 5, 2)?.reshape(&[6, 12])?;
    check(&y, &n.slice(3, 0, 5, 2).reshape(&[6, 12]), "slice step 2 then reshape");
    let y = x.narrow(1, 1, 2)?.reshape(&[-1, 20])?;
    check(&y, &n.slice(1, 1, 3, 1).reshape(&[4, 20]), "narrow then reshape");
    // Expanded views reshape to their broadcast values.
    let n = iota(&[3, 1]);
    let y = f64_tensor(&n).expand(&[2, 3, 4])?.reshape(&[4, 6])?;
    check(&y, &n.expand(&[2, 3, 4]).reshape(&[4, 6]), "expand then reshape");
    Ok(())
}

#[test]
fn permute_transpose_and_t() -> Res {
    let mut rng = Rng::new(22);
    for _ in 0..30 {
        let dims = rng.shape(5, 2000);
        let n = iota(&dims);
        let x = f64_tensor(&n);
        let r = dims.len();
        let perm = rng.perm(r);
        let spelled: Vec<isize> = perm.iter().map(|&p| if rng.below(2) == 0 { p as isize } else { p as isize - r as isize }).collect();
        let y = x.permute(&spelled)?;
        check(&y, &n.permute(&perm), &format!("permute {dims:?} by {spelled:?}"));
        assert!(y.same_storage(&x));
        if r >= 1 {
            let (a, b) = (rng.below(r), rng.below(r));
            let mut p: Vec<usize> = (0..r).collect();
            p.swap(a, b);
            check(&x.transpose(a as isize - r as isize, b as isize)?, &n.permute(&p), &format!("transpose {dims:?} {a} {b}"));
        }
    }
    let x = f64_tensor(&iota(&[2, 3]));
    assert!(x.permute(&[0]).is_err());
    assert!(x.permute(&[0, 0]).is_err());
    assert!(x.permute(&[0, -2]).is_err(), "-2 is dim 0 again");
    assert!(x.permute(&[0, 2]).is_err());
    assert!(x.transpose(0, 2).is_err());
    // t: 0-d and 1-d unchanged, 2-d transposed, 3-d refused.
    let s = Tensor::scalar(1.0f64, CPU)?;
    assert_eq!(s.t()?.dims(), &[] as &[usize]);
    let v = f64_tensor(&iota(&[5]));
    check(&v.t()?, &iota(&[5]), "t of 1-d");
    check(&x.t()?, &iota(&[2, 3]).permute(&[1, 0]), "t of 2-d");
    assert!(f64_tensor(&iota(&[2, 2, 2])).t().is_err());
    Ok(())
}

#[test]
fn expand_and_broadcast_to() -> Res {
    let n = iota(&[3, 1]);
    let x = f64_tensor(&n);
    let y = x.expand(&[2, -1, 4])?;
    check(&y, &n.expand(&[2, 3, 4]), "expand [3,1] -> [2,-1,4]");
    assert!(y.same_storage(&x));
    assert_eq!(y.stride()[0], 0, "a new leading dim has stride 0");
    check(&x.broadcast_to(&[5, 3, 7])?, &n.expand(&[5, 3, 7]), "broadcast_to");
    check(&x.broadcast_to(&[3, 0])?, &n.expand(&[3, 0]), "broadcast to an empty dim");
    check(&x.expand(&[-1, -1])?, &n, "expand with all -1");
    assert!(x.expand(&[-1, 3, 4]).is_err(), "-1 for a new leading dim");
    assert!(x.expand(&[4, 4]).is_err(), "3 cannot become 4");
    assert!(x.expand(&[4]).is_err(), "fewer dims");
    assert!(x.broadcast_to(&[2, 3]).is_err());
    // Broadcasting a 0-d tensor, and expanding a size-1 dim of a non-contiguous view.
    let s = Tensor::scalar(2.5f64, CPU)?;
    check(&s.expand(&[2, 3])?, &Naive::new(&[2, 3], vec![2.5; 6]), "expand 0-d");
    let n = iota(&[4, 1, 3]);
    let v = f64_tensor(&n).permute(&[2, 1, 0])?; // [3, 1, 4]
    check(&v.expand(&[2, 3, 5, 4])?, &n.permute(&[2, 1, 0]).expand(&[2, 3, 5, 4]), "expand a permuted view");
    Ok(())
}

#[test]
fn narrow_and_python_slicing() -> Res {
    let mut rng = Rng::new(23);
    for _ in 0..60 {
        let dims = rng.shape_nz(1, 4, 2000);
        let n = iota(&dims);
        let x = f64_tensor(&n);
        let r = dims.len();
        let d = rng.below(r);
        let size = dims[d] as isize;
        let start = rng.below((2 * size + 7) as usize) as isize - size - 3;
        let end = rng.below((2 * size + 7) as usize) as isize - size - 3;
        let step = 1 + rng.below(4);
        let spelled = if rng.below(2) == 0 { d as isize } else { d as isize - r as isize };
        let y = x.slice(spelled, start, end, step)?;
        check(&y, &n.slice(d, start, end, step), &format!("{dims:?}[{d}: {start}:{end}:{step}]"));
        assert!(y.same_storage(&x));
        // narrow(start, len) within bounds
        let s0 = rng.below(dims[d] + 1);
        let len = rng.below(dims[d] - s0 + 1);
        let y = x.narrow(spelled, s0, len)?;
        check(&y, &n.slice(d, s0 as isize, (s0 + len) as isize, 1), &format!("narrow {dims:?} dim {d} {s0}+{len}"));
        assert!(x.narrow(spelled, s0, dims[d] - s0 + 1).is_err(), "narrow past the end");
    }
    // Python examples on [10]: x[-3:], x[:-7], x[1:9:3], x[-100:100:4], x[5:2], x[::5].
    let n = iota(&[10]);
    let x = f64_tensor(&n);
    let pick = |idx: &[usize]| Naive::new(&[idx.len()], idx.iter().map(|&i| n.v[i]).collect());
    check(&x.slice(0, -3, isize::MAX, 1)?, &pick(&[7, 8, 9]), "x[-3:]");
    check(&x.slice(0, 0, -7, 1)?, &pick(&[0, 1, 2]), "x[:-7]");
    check(&x.slice(0, 1, 9, 3)?, &pick(&[1, 4, 7]), "x[1:9:3]");
    check(&x.slice(0, -100, 100, 4)?, &pick(&[0, 4, 8]), "x[-100:100:4]");
    check(&x.slice(0, 5, 2, 1)?, &pick(&[]), "x[5:2]");
    check(&x.slice(0, 0, 10, 5)?, &pick(&[0, 5]), "x[::5]");
    check(&x.slice(-1, -1, 10, 2)?, &pick(&[9]), "x[-1::2]");
    assert!(x.slice(0, 0, 10, 0).is_err(), "step 0");
    assert!(x.slice(1, 0, 1, 1).is_err(), "dim out of range");
    assert!(x.narrow(0, 11, 0).is_err());
    // Slices of slices.
    let n = iota(&[7, 13]);
    let x = f64_tensor(&n);
    let y = x.slice(1, 1, 12, 2)?.slice(1, 1, -1, 2)?.slice(0, -5, -1, 3)?;
    check(&y, &n.slice(1, 1, 12, 2).slice(1, 1, -1, 2).slice(0, -5, -1, 3), "slice of slice of slice");
    Ok(())
}

#[test]
fn squeeze_unsqueeze_flatten() -> Res {
    let n = iota(&[2, 1, 3, 1]);
    let x = f64_tensor(&n);
    assert_eq!(x.squeeze(1)?.dims(), &[2, 3, 1]);
    assert_eq!(x.squeeze(-1)?.dims(), &[2, 1, 3]);
    assert_eq!(x.squeeze(0)?.dims(), &[2, 1, 3, 1], "squeezing a dim that is not 1 changes nothing");
    assert_eq!(x.squeeze_all()?.dims(), &[2, 3]);
    assert!(x.squeeze(4).is_err());
    for t in [x.squeeze(1)?, x.squeeze_all()?, x.unsqueeze(0)?, x.unsqueeze(-1)?, x.unsqueeze(2)?, x.flatten(0, -1)?] {
        assert!(t.same_storage(&x));
        assert_same(&t.to_f64_vec()?, &n.v, "same values in the same order");
    }
    assert_eq!(x.unsqueeze(0)?.dims(), &[1, 2, 1, 3, 1]);
    assert_eq!(x.unsqueeze(4)?.dims(), &[2, 1, 3, 1, 1]);
    assert_eq!(x.unsqueeze(-1)?.dims(), &[2, 1, 3, 1, 1]);
    assert_eq!(x.unsqueeze(-5)?.dims(), &[1, 2, 1, 3, 1]);
    assert!(x.unsqueeze(5).is_err());
    assert!(x.unsqueeze(-6).is_err());
    assert_eq!(x.flatten(1, 2)?.dims(), &[2, 3, 1]);
    assert_eq!(x.flatten(-3, -1)?.dims(), &[2, 3]);
    assert_eq!(x.flatten(2, 2)?.dims(), &[2, 1, 3, 1]);
    assert_eq!(x.flatten_all()?.dims(), &[6]);
    assert!(x.flatten(2, 1).is_err());
    let s = Tensor::scalar(4.0f64, CPU)?;
    assert_eq!(s.flatten(0, 0)?.dims(), &[1]);
    assert_eq!(s.unsqueeze(0)?.dims(), &[1]);
    assert_eq!(s.squeeze_all()?.dims(), &[] as &[usize]);
    // On a non-contiguous view: unsqueeze then expand, flatten of a transposed view.
    let n = iota(&[3, 4]);
    let x = f64_tensor(&n);
    let y = x.t()?.unsqueeze(1)?.expand(&[4, 2, 3])?;
    check(&y, &n.permute(&[1, 0]).reshape(&[4, 1, 3]).expand(&[4, 2, 3]), "t, unsqueeze, expand");
    check(&x.t()?.flatten(0, 1)?, &n.permute(&[1, 0]).reshape(&[12]), "flatten of t");
    check(&x.t()?.unsqueeze(0)?.squeeze(0)?, &n.permute(&[1, 0]), "unsqueeze then squeeze");
    Ok(())
}

#[test]
fn contiguous_and_storage_sharing() -> Res {
    let n = iota(&[4, 6]);
    let x = f64_tensor(&n);
    assert!(x.is_contiguous());
    let c = x.contiguous()?;
    assert!(c.same_storage(&x), "contiguous() of a contiguous tensor is the tensor itself");
    assert_eq!(c.layout(), x.layout());
    let views = [
        x.t()?,
        x.narrow(0, 1, 2)?,
        x.slice(1, 0, 6, 2)?,
        x.reshape(&[2, 12])?,
        x.unsqueeze(1)?,
        x.permute(&[1, 0])?,
        x.unsqueeze(0)?.expand(&[3, 4, 6])?,
        x.narrow(1, 2, 3)?,
    ];
    for v in &views {
        assert!(v.same_storage(&x), "{v:?} is a view");
        let c = v.contiguous()?;
        assert!(c.is_contiguous());
        assert_same(&c.to_f64_vec()?, &v.to_f64_vec()?, "contiguous keeps the values");
        if v.is_contiguous() {
            assert!(c.same_storage(&x));
        } else {
            assert!(!c.same_storage(&x), "a copy for a non-contiguous view");
        }
    }
    // A row narrow is contiguous (offset only); a column narrow is not.
    assert!(x.narrow(0, 1, 2)?.is_contiguous());
    assert!(!x.narrow(1, 2, 3)?.is_contiguous());
    assert!(!x.t()?.is_contiguous());
    // Results of ops own new buffers; the input is unchanged.
    let y = x.add(1.0)?;
    assert!(!y.same_storage(&x));
    assert_same(&x.to_f64_vec()?, &n.v, "input unchanged");
    // A view of a pending result shares the pending node.
    let z = y.t()?;
    assert!(z.same_storage(&y));
    check(&z, &Naive::new(&[4, 6], n.v.iter().map(|v| v + 1.0).collect()).permute(&[1, 0]), "view of pending");
    assert!(y.is_realized());
    // Empty tensors: contiguous of an empty view works.
    let e = x.narrow(0, 2, 0)?;
    assert_eq!(e.contiguous()?.dims(), &[0, 6]);
    assert_eq!(e.t()?.contiguous()?.to_f64_vec()?, Vec::<f64>::new());
    Ok(())
}

#[test]
fn ops_on_non_contiguous_inputs() -> Res {
    let n = iota(&[6, 8]);
    let x = f64_tensor(&n);
    let m = Naive::new(&[8, 6], (0..48).map(|i| (i as f64).sin()).collect());
    let y = f64_tensor(&m);
    // transposed + contiguous
    let s = x.t()?.add(&y)?;
    let want = Naive::gen(vec![8, 6], |i| n.at(&[i[1], i[0]]) + m.at(i));
    check(&s, &want, "t(x) + y");
    // both transposed
    let s = x.t()?.mul(&y.t()?.t()?)?;
    check(&s, &Naive::gen(vec![8, 6], |i| n.at(&[i[1], i[0]]) * m.at(i)), "t(x) * t(t(y))");
    // stepped slices of both sides
    let a = x.slice(0, 1, 6, 2)?; // [3, 8]
    let b = y.t()?.slice(1, 0, 8, 3)?; // [6, 3] -> t: [3, 6]
    let s = a.slice(1, -6, 8, 1)?.sub(&b.t()?)?; // [3, 6]
    let na = n.slice(0, 1, 6, 2).slice(1, -6, 8, 1);
    let nb = m.permute(&[1, 0]).slice(1, 0, 8, 3).permute(&[1, 0]);
    check(&s, &Naive::gen(vec![3, 6], |i| na.at(i) - nb.at(i)), "sliced - sliced");
    // expanded inputs on both sides of a comparison and a where
    let col = f64_tensor(&iota(&[6, 1])).expand(&[6, 8])?;
    let row = f64_tensor(&iota(&[1, 8]));
    let w = col.lt(&row.expand(&[6, 8])?)?.where_cond(&x, &x.t()?.t()?.neg()?)?;
    let nc = iota(&[6, 1]);
    let nr = iota(&[1, 8]);
    check(&w, &Naive::gen(vec![6, 8], |i| if nc.at(&[i[0], 0]) < nr.at(&[0, i[1]]) { n.at(i) } else { -n.at(i) }), "where on expanded");
    // unary of a permuted 3-d view, and a reduction of it
    let n3 = iota(&[3, 4, 5]);
    let x3 = f64_tensor(&n3);
    let p = x3.permute(&[2, 0, 1])?.abs()?;
    let np = n3.permute(&[2, 0, 1]);
    check(&p, &Naive::new(&np.dims, np.v.iter().map(|v| v.abs()).collect()), "abs of permuted");
    let s = x3.permute(&[2, 0, 1])?.sum(&[1], false)?;
    check(&s, &Naive::gen(vec![5, 4], |i| (0..3).map(|k| np.at(&[i[0], k, i[1]])).sum()), "sum of permuted");
    // Integer and bool views.
    let iv = Tensor::from_vec((0..12).collect::<Vec<i32>>(), &[3, 4], CPU)?;
    assert_eq!(iv.t()?.mul(2i32)?.to_vec::<i32>()?, vec![0, 8, 16, 2, 10, 18, 4, 12, 20, 6, 14, 22]);
    let bv = iv.gt(5i32)?.t()?.slice(0, 0, 4, 3)?;
    // Columns 0 and 3 of x > 5: [0, 4, 8] and [3, 7, 11].
    assert_eq!(bv.to_vec::<bool>()?, vec![false, false, true, false, true, true]);
    assert_eq!(bv.logical_not()?.to_vec::<bool>()?, vec![true, true, false, true, false, false]);
    Ok(())
}

/// One random view step applied to both the tensor and the model.
fn random_view_step(rng: &mut Rng, t: &Tensor, n: &Naive) -> voltaic::Result<(Tensor, Naive, String)> {
    let r = n.dims.len();
    loop {
        match rng.below(10) {
            0 if r >= 2 => {
                let perm = rng.perm(r);
                let p: Vec<isize> = perm.iter().map(|&p| p as isize).collect();
                return Ok((t.permute(&p)?, n.permute(&perm), format!("permute{perm:?}")));
            }
            1 if r >= 1 => {
                let d = rng.below(r);
                let size = n.dims[d] as isize;
                let (s, e) = (rng.below((size + 3) as usize) as isize - 2, rng.below((size + 3) as usize) as isize + 1 - 2);
                let step = 1 + rng.below(3);
                return Ok((t.slice(d as isize, s, e, step)?, n.slice(d, s, e, step), format!("slice({d}, {s}, {e}, {step})")));
            }
            2 => {
                let nd = random_reshape(rng, &n.dims);
                let spelled: Vec<isize> = nd.iter().map(|&d| d as isize).collect();
                return Ok((t.reshape(&spelled)?, n.reshape(&nd), format!("reshape{nd:?}")));
            }
            3 if numel(&n.dims) <= 400 => {
                // Expand size-1 dims and maybe add a leading one.
                let mut nd: Vec<usize> = n.dims.iter().map(|&d| if d == 1 { 1 + rng.below(3) } else { d }).collect();
                if rng.below(2) == 0 {
                    nd.insert(0, 1 + rng.below(3));
                }
                if numel(&nd) > 3000 {
                    continue;
                }
                return Ok((t.broadcast_to(&nd)?, n.expand(&nd), format!("expand{nd:?}")));
            }
            4 if r < 5 => {
                let d = rng.below(r + 1);
                let mut nd = n.dims.clone();
                nd.insert(d, 1);
                return Ok((t.unsqueeze(d as isize)?, n.reshape(&nd), format!("unsqueeze({d})")));
            }
            5 if n.dims.contains(&1) => {
                let d = n.dims.iter().position(|&x| x == 1).unwrap();
                let mut nd = n.dims.clone();
                nd.remove(d);
                return Ok((t.squeeze(d as isize)?, n.reshape(&nd), format!("squeeze({d})")));
            }
            6 if r >= 2 => {
                let (a, b) = (rng.below(r), rng.below(r));
                let mut p: Vec<usize> = (0..r).collect();
                p.swap(a, b);
                return Ok((t.transpose(a as isize, b as isize)?, n.permute(&p), format!("transpose({a}, {b})")));
            }
            7 => {
                // An elementwise op: exact in f64 (one multiply, one add).
                let y = t.mul(1.5)?.add(0.25)?;
                return Ok((y, Naive::new(&n.dims, n.v.iter().map(|v| v * 1.5 + 0.25).collect()), "x*1.5+0.25".into()));
            }
            8 => {
                let what = match rng.below(3) {
                    0 => {
                        t.realize()?;
                        "realize"
                    }
                    1 => return Ok((t.contiguous()?, n.clone(), "contiguous".into())),
                    _ => return Ok((t.add(t)?.sub(t)?, n.clone(), "x+x-x".into())),
                };
                return Ok((t.clone(), n.clone(), what.into()));
            }
            9 if r >= 1 => {
                // Combine with a pending result read through a permutation and its inverse.
                let perm = rng.perm(r);
                let mut inv = vec![0; r];
                for (k, &p) in perm.iter().enumerate() {
                    inv[p] = k as isize;
                }
                let p: Vec<isize> = perm.iter().map(|&p| p as isize).collect();
                let u = t.mul(2.0)?.permute(&p)?.contiguous()?.permute(&inv)?;
                return Ok((t.add(&u)?, Naive::new(&n.dims, n.v.iter().map(|v| v + 2.0 * v).collect()), format!("x+2x via {perm:?}")));
            }
            _ => {}
        }
    }
}

#[test]
fn random_chains_of_views_and_ops() -> Res {
    let mut rng = Rng::new(24);
    for case in 0..300 {
        let dims = rng.shape(4, 600);
        let n0 = Naive::new(&dims, (0..numel(&dims)).map(|i| ((i * 37 % 101) as f64) - 50.0).collect());
        let t0 = f64_tensor(&n0);
        // Start from the realized buffer or from a pending op over it.
        let (mut t, mut n) =
            if rng.below(2) == 0 { (t0.clone(), n0.clone()) } else { (t0.neg()?, Naive::new(&dims, n0.v.iter().map(|v| -v).collect())) };
        let mut trail = vec![format!("{dims:?}")];
        for _ in 0..(3 + rng.below(6)) {
            let (t2, n2, what) = random_view_step(&mut rng, &t, &n)?;
            trail.push(what);
            t = t2;
            n = n2;
            if rng.below(4) == 0 {
                check(&t, &n, &format!("case {case}: {}", trail.join(" -> ")));
            }
        }
        let ctx = format!("case {case}: {}", trail.join(" -> "));
        check(&t, &n, &ctx);
        // An op over the final view, combined with a fresh tensor of its shape.
        let other = Naive::new(&n.dims, (0..numel(&n.dims)).map(|i| (i % 7) as f64).collect());
        let y = t.mul(f64_tensor(&other))?.sub(&t)?;
        check(&y, &Naive::new(&n.dims, n.v.iter().zip(&other.v).map(|(a, b)| a * b - a).collect()), &format!("{ctx} -> x*o-x"));
        // A reduction over the last dim of the final view.
        if !n.dims.is_empty() && *n.dims.last().unwrap() > 0 {
            let r = n.dims.len();
            let (od, gs) = {
                let mut od = n.dims.clone();
                od.pop();
                let last = n.dims[r - 1];
                let gs: Vec<f64> = (0..numel(&od)).map(|g| n.v[g * last..(g + 1) * last].iter().sum()).collect();
                (od, gs)
            };
            let s = t.sum(&[-1], false)?;
            assert_eq!(s.dims(), &od[..], "{ctx} -> sum(-1)");
            let got = s.to_f64_vec()?;
            for (i, (&g, &w)) in got.iter().zip(&gs).enumerate() {
                assert!((g - w).abs() <= 1e-9 * (1.0 + w.abs()), "{ctx} -> sum(-1) output {i}: {g} vs {w}");
            }
        }
    }
    Ok(())
}

/// Views whose innermost dim is short (pooling taps, RGB channels) are read
/// through a table of a plane's offsets on the CPU: planes that straddle
/// the executor's blocks of 1024 elements, broadcasts and offsets included.
#[test]
fn short_inner_dims_read_through_planes_match_the_model() -> Res {
    let mut rng = Rng::new(77);
    for (dims, perm) in [(vec![40, 50, 3], vec![1, 0, 2]), (vec![7, 9, 2, 5], vec![3, 1, 0, 2]), (vec![3, 31, 2, 2], vec![1, 0, 3, 2])] {
        let n = numel(&dims);
        let v: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let x = Tensor::from_vec(v.iter().map(|&f| f as f32).collect::<Vec<_>>(), &dims, CPU)?;
        let model = Naive::new(&dims, v.clone()).permute(&perm);
        let perm_i: Vec<isize> = perm.iter().map(|&p| p as isize).collect();
        let got = x.permute(&perm_i)?.mul(2.0)?.to_vec::<f32>()?;
        for (g, w) in got.iter().zip(&model.v) {
            assert!((*g as f64 - 2.0 * w).abs() <= 1e-6 * w.abs().max(1.0), "{dims:?} permuted {perm:?}");
        }
        // A broadcast plane: [d0, 1, d2] read as [d0, 8, d2], narrowed to start mid-plane.
        let b = x.narrow(1, 1, 1)?.broadcast_to(&[dims[0], 8].iter().chain(&dims[2..]).copied().collect::<Vec<_>>())?;
        let got = b.narrow(0, 1, dims[0] - 1)?.add(1.0)?.to_vec::<f32>()?;
        let mut k = 0;
        for i in 1..dims[0] {
            for _ in 0..8 {
                for rest in 0..n / (dims[0] * dims[1]) {
                    let src = i * dims[1] * (n / (dims[0] * dims[1])) + (n / (dims[0] * dims[1])) + rest;
                    assert!((got[k] as f64 - (v[src] as f32 as f64 + 1.0)).abs() <= 1e-6 * v[src].abs().max(1.0), "{dims:?} broadcast at {k}");
                    k += 1;
                }
            }
        }
        assert_eq!(k, got.len());
    }
    Ok(())
}
