//! Helpers shared by the tests: a deterministic generator independent of
//! the library's, naive index arithmetic, reference roundings, tensor
//! construction from f64 data, and tolerance checks. Nothing here calls the
//! ops under test (except `randn`, which draws from the library's
//! generator on purpose).
#![allow(dead_code)]

use voltaic::{DType, Device, Tensor};

/// SplitMix64: small, deterministic, and not the library's generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn normals(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.normal()).collect()
    }
    /// Integers in `lo..hi`, as f64.
    pub fn ints(&mut self, n: usize, lo: i64, hi: i64) -> Vec<f64> {
        (0..n).map(|_| (lo + self.below((hi - lo) as usize) as i64) as f64).collect()
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    /// A dimension size: mostly small odd sizes, sometimes 1, rarely 0.
    pub fn dim(&mut self) -> usize {
        self.pick(&[1, 2, 3, 5, 7, 13, 4, 6, 1, 3, 7, 0])
    }
    /// A dimension size that is never 0.
    pub fn dim_nz(&mut self) -> usize {
        self.pick(&[1, 2, 3, 5, 7, 13, 4, 6, 1, 3, 7])
    }
    /// A random shape of rank `0..=max_rank` with at most `max_numel` elements.
    pub fn shape(&mut self, max_rank: usize, max_numel: usize) -> Vec<usize> {
        loop {
            let r = self.below(max_rank + 1);
            let s: Vec<usize> = (0..r).map(|_| self.dim()).collect();
            if s.iter().product::<usize>() <= max_numel {
                return s;
            }
        }
    }
    /// Like `shape` but with no zero-size dims and rank at least `min_rank`.
    pub fn shape_nz(&mut self, min_rank: usize, max_rank: usize, max_numel: usize) -> Vec<usize> {
        loop {
            let r = min_rank + self.below(max_rank - min_rank + 1);
            let s: Vec<usize> = (0..r).map(|_| self.dim_nz()).collect();
            if s.iter().product::<usize>() <= max_numel {
                return s;
            }
        }
    }
    /// A random permutation of `0..n`.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.below(i + 1);
            p.swap(i, j);
        }
        p
    }
}

pub fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Row-major strides.
pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// Multi-index of linear position `i` in `dims` (row-major).
pub fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut out = vec![0; dims.len()];
    for k in (0..dims.len()).rev() {
        out[k] = i % dims[k];
        i /= dims[k];
    }
    out
}

/// Linear row-major position of a multi-index.
pub fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(strides(dims)).map(|(i, s)| i * s).sum()
}

/// The logical (row-major) values of a strided view of `base`, computed here.
pub fn strided(base: &[f64], dims: &[usize], st: &[usize], offset: usize) -> Vec<f64> {
    (0..numel(dims))
        .map(|i| {
            let idx = unravel(i, dims);
            base[offset + idx.iter().zip(st).map(|(a, b)| a * b).sum::<usize>()]
        })
        .collect()
}

/// NumPy broadcast shape, computed naively.
pub fn bcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![];
    for i in 0..r {
        let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out.push(if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return None;
        });
    }
    Some(out)
}

/// Linear position in an input of shape `dims` that broadcasts to `out_idx`.
pub fn bcast_pos(out_idx: &[usize], dims: &[usize]) -> usize {
    let lead = out_idx.len() - dims.len();
    let idx: Vec<usize> = dims.iter().enumerate().map(|(k, &d)| if d == 1 { 0 } else { out_idx[lead + k] }).collect();
    ravel(&idx, dims)
}

/// Round to a binary float with `mant` explicit mantissa bits, smallest normal
/// exponent `emin` and largest finite value `max` (ties to even), naively.
pub fn round_float(v: f64, mant: i32, emin: i32, max: f64) -> f64 {
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    // Binary exponent of |v| from its bits (v is normal in f64 for all our uses).
    let e = (((v.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(emin);
    let ulp = 2f64.powi(e - mant);
    let q = v.abs() / ulp;
    let f = q.floor();
    let d = q - f;
    let r = if d < 0.5 {
        f
    } else if d > 0.5 {
        f + 1.0
    } else if f % 2.0 == 0.0 {
        f
    } else {
        f + 1.0
    };
    let out = r * ulp;
    if out > max {
        return f64::INFINITY.copysign(v);
    }
    out.copysign(v)
}

pub fn round_f16(v: f64) -> f64 {
    round_float(v, 10, -14, 65504.0)
}
pub fn round_bf16(v: f64) -> f64 {
    round_float(v, 7, -126, 3.3895313892515355e38)
}
pub fn round_f32(v: f64) -> f64 {
    v as f32 as f64
}

/// `v` as the dtype stores it (Rust `as` semantics for ints: truncate, saturate, NaN -> 0).
pub fn round_to(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => v,
        DType::F32 => round_f32(v),
        DType::F16 => round_f16(round_f32(v)),
        DType::BF16 => round_bf16(round_f32(v)),
        DType::I32 => {
            if v.is_nan() {
                0.0
            } else {
                v.trunc().clamp(i32::MIN as f64, i32::MAX as f64)
            }
        }
        DType::U32 => {
            if v.is_nan() {
                0.0
            } else {
                v.trunc().clamp(0.0, u32::MAX as f64)
            }
        }
        DType::Bool => (v != 0.0) as u8 as f64,
    }
}

/// A CPU tensor of `dtype` holding `data` (rounded to the dtype), and the rounded values.
pub fn tensor(data: &[f64], dims: &[usize], dtype: DType) -> (Tensor, Vec<f64>) {
    let r: Vec<f64> = data.iter().map(|&v| round_to(v, dtype)).collect();
    let d = Device::Cpu;
    let t = match dtype {
        DType::F64 => Tensor::from_vec(r.clone(), dims, d),
        DType::F32 => Tensor::from_vec(r.iter().map(|&v| v as f32).collect(), dims, d),
        DType::F16 => Tensor::from_vec(r.iter().map(|&v| half::f16::from_f64(v)).collect(), dims, d),
        DType::BF16 => Tensor::from_vec(r.iter().map(|&v| half::bf16::from_f64(v)).collect(), dims, d),
        DType::I32 => Tensor::from_vec(r.iter().map(|&v| v as i32).collect(), dims, d),
        DType::U32 => Tensor::from_vec(r.iter().map(|&v| v as u32).collect(), dims, d),
        DType::Bool => Tensor::from_vec(r.iter().map(|&v| v != 0.0).collect(), dims, d),
    }
    .expect("from_vec");
    (t, r)
}

/// Random data from the library's generator (`randn`, or small ints for
/// integer dtypes), with its values read back as f64.
pub fn randn(dims: &[usize], dtype: DType) -> (Tensor, Vec<f64>) {
    let t = match dtype {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Tensor::randn(dims, dtype, Device::Cpu).unwrap(),
        DType::I32 => Tensor::randn(dims, DType::F64, Device::Cpu).unwrap().mul(4.0).unwrap().to_dtype(DType::I32).unwrap(),
        DType::U32 => Tensor::rand(dims, DType::F64, Device::Cpu).unwrap().mul(9.0).unwrap().to_dtype(DType::U32).unwrap(),
        DType::Bool => Tensor::rand(dims, DType::F64, Device::Cpu).unwrap().lt(0.5).unwrap(),
    };
    let v = t.to_f64_vec().unwrap();
    // Rebuild from the values so that the tensor under test is a plain realized buffer.
    tensor(&v, dims, dtype)
}

/// Random normal data of a shape in a dtype (integers: small ints).
pub fn rand_tensor(rng: &mut Rng, dims: &[usize], dtype: DType) -> (Tensor, Vec<f64>) {
    let n = numel(dims);
    let v = match dtype {
        DType::I32 => rng.ints(n, -5, 6),
        DType::U32 => rng.ints(n, 0, 6),
        DType::Bool => rng.ints(n, 0, 2),
        _ => rng.normals(n),
    };
    tensor(&v, dims, dtype)
}

/// An i32 index tensor.
pub fn idx_tensor(v: &[i64], dims: &[usize]) -> Tensor {
    Tensor::from_vec(v.iter().map(|&x| x as i32).collect::<Vec<i32>>(), dims, Device::Cpu).expect("index tensor")
}

/// `|got - want| <= atol + rtol * |want|` elementwise; NaN matches NaN, infinities must match exactly.
#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length {} vs expected {}", got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}: element {i} is {g}, expected NaN");
            continue;
        }
        if w.is_infinite() {
            assert_eq!(g, w, "{what}: element {i}");
            continue;
        }
        let tol = atol + rtol * w.abs();
        assert!((g - w).abs() <= tol, "{what}: element {i} is {g}, expected {w} (|diff| {} > tol {tol})", (g - w).abs());
    }
}

/// Exact equality, NaN matching NaN.
#[track_caller]
pub fn assert_same(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length {} vs expected {}", got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g == w || (g.is_nan() && w.is_nan()), "{what}: element {i} is {g}, expected {w}");
    }
}

/// Per-dtype default tolerances (rtol, atol) for a result compared with an f64 reference.
pub fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-5),
        DType::F16 => (2e-3, 1e-3),
        DType::BF16 => (1.6e-2, 1e-2),
        _ => (0.0, 0.0),
    }
}

/// The error function in f64: the everywhere-positive series
/// `erf(x) = 2/sqrt(pi) * exp(-x^2) * sum 2^n x^(2n+1) / (1*3*...*(2n+1))`
/// (no cancellation), and +-1 beyond |x| = 6 where erfc underflows f64's precision.
pub fn erf_ref(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x.abs() > 6.0 {
        return x.signum();
    }
    let mut term = x;
    let mut sum = x;
    let mut n = 0.0;
    loop {
        n += 1.0;
        term *= 2.0 * x * x / (2.0 * n + 1.0);
        sum += term;
        if term.abs() <= 1e-17 * sum.abs() {
            break;
        }
    }
    2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp() * sum
}

/// `|got - want| <= tol * scale` elementwise, `scale` being e.g. the sum of the
/// absolute values of the summed terms (so cancellation does not matter).
pub fn assert_close_scaled(got: &[f64], want: &[f64], scale: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length {} vs expected {}", got.len(), want.len());
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let t = tol * s;
        assert!((g - w).abs() <= t, "{what}: element {i} is {g}, expected {w} (|diff| {} > tol {t})", (g - w).abs());
    }
}

/// The error's message, asserting it mentions each of `parts`.
pub fn assert_err_mentions<T: std::fmt::Debug>(r: voltaic::Result<T>, parts: &[&str]) -> String {
    let e = r.expect_err("expected an error");
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "error message {msg:?} does not mention {p:?}");
    }
    msg
}
