//! Reference checks shared by the bench suites: each row's result is
//! compared with an f64 computation here before the row is timed, so a fast
//! wrong kernel cannot make a row.

use anyhow::ensure;
use voltaic::Tensor;

/// `|got - want| <= tol * (scale + |want|)`.
pub fn close(got: f64, want: f64, tol: f64, scale: f64) -> bool {
    (got - want).abs() <= tol * (scale + want.abs())
}

/// Sampled entries of a (batched, row-major) matmul against f64 dot products,
/// the tolerance relative to the size of the summed terms.
pub fn matmul(a: &[f32], b: &[f32], c: &[f32], batch: usize, m: usize, k: usize, n: usize, tol: f64) -> anyhow::Result<()> {
    let picks = [(0, 0, 0), (batch - 1, m - 1, n - 1), (batch / 2, m / 2, n / 3), (0, m - 1, 0), (batch - 1, 0, n - 1)];
    for &(z, i, j) in &picks {
        let mut want = 0.0f64;
        let mut scale = 0.0f64;
        for p in 0..k {
            let t = a[(z * m + i) * k + p] as f64 * b[(z * k + p) * n + j] as f64;
            want += t;
            scale += t.abs();
        }
        let got = c[(z * m + i) * n + j] as f64;
        ensure!(close(got, want, tol, scale / (k as f64).sqrt()), "matmul check failed at ({z},{i},{j}): {got} vs {want}");
    }
    Ok(())
}

/// The ten-op elementwise chain of the `chain10` rows.
pub fn chain10(x: &Tensor, y: &Tensor) -> voltaic::Result<Tensor> {
    x.mul(2.0)?.add(1.0)?.relu()?.sub(y)?.abs()?.sqrt()?.mul(y)?.add(3.0)?.mul(0.5)?.sub(y)
}

/// Every 9973rd element of `chain10(x, y)` against the same arithmetic in f32.
pub fn chain10_values(x: &[f32], y: &[f32], got: &[f32]) -> anyhow::Result<()> {
    for i in (0..got.len()).step_by(9973) {
        let (x, y) = (x[i], y[i]);
        let want = ((((x * 2.0 + 1.0).max(0.0) - y).abs().sqrt() * y) + 3.0) * 0.5 - y;
        ensure!(close(got[i] as f64, want as f64, 1e-5, 1.0), "chain check failed at {i}");
    }
    Ok(())
}

/// Softmax of one row in f64.
pub fn softmax_row(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
    row.iter().map(|v| (v - m).exp() / z).collect()
}

/// Layer norm of one row in f64, with elementwise weight and bias.
pub fn layernorm_row(row: &[f64], w: &[f32], b: &[f32], eps: f64) -> Vec<f64> {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    row.iter().enumerate().map(|(c, v)| (v - mean) / (var + eps).sqrt() * w[c] as f64 + b[c] as f64).collect()
}

/// A few columns of a row against its reference.
pub fn row_entries(what: &str, r: usize, got: &[f32], want: &[f64]) -> anyhow::Result<()> {
    let n = got.len();
    for c in [0usize, 77.min(n - 1), n - 1] {
        ensure!(close(got[c] as f64, want[c], 1e-4, 1e-6), "{what} check failed at ({r},{c})");
    }
    Ok(())
}

/// A sum against its f64 reference.
pub fn sum(got: f64, want: f64) -> anyhow::Result<()> {
    ensure!(close(got, want, 1e-5, 0.0), "sum check failed: {got} vs {want}");
    Ok(())
}

/// Sampled outputs of the ResNet block convolution (`[8, 64, 56, 56]` with
/// `[64, 64, 3, 3]`, padding 1) against f64 sums.
pub fn conv2d_resnet(x: &[f32], w: &[f32], y: &[f32]) -> anyhow::Result<()> {
    for &(n, co, i, j) in &[(0usize, 0usize, 0usize, 0usize), (7, 63, 55, 55), (3, 17, 20, 31)] {
        let mut want = 0.0f64;
        for ci in 0..64 {
            for ki in 0..3 {
                for kj in 0..3 {
                    let (yy, xx) = (i as isize + ki as isize - 1, j as isize + kj as isize - 1);
                    if (0..56).contains(&yy) && (0..56).contains(&xx) {
                        want += x[((n * 64 + ci) * 56 + yy as usize) * 56 + xx as usize] as f64 * w[((co * 64 + ci) * 3 + ki) * 3 + kj] as f64;
                    }
                }
            }
        }
        ensure!(close(y[((n * 64 + co) * 56 + i) * 56 + j] as f64, want, 1e-4, 1.0), "conv2d check failed at ({n},{co},{i},{j})");
    }
    Ok(())
}
