//! Helpers shared by the value tests: a deterministic RNG independent of the
//! library's, tensor construction from f64 data rounded to a dtype, naive
//! index arithmetic and tolerance checks. Nothing here calls the ops under test.
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

/// `v` rounded to what `dtype` holds.
pub fn round_to(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => v,
        DType::F32 => v as f32 as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::I32 => v as i32 as f64,
        DType::U32 => v as u32 as f64,
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
