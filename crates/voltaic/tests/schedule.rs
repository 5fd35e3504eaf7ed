//! The schedule is inspectable: fusion decisions are asserted here.

use voltaic::{inspect, DType, Device, Tensor};

#[test]
fn twenty_op_chain_over_broadcast_input_is_one_kernel() -> voltaic::Result<()> {
    let x = Tensor::randn(&[1, 37], DType::F32, Device::Cpu)?.broadcast_to(&[23, 37])?;
    let y = Tensor::randn(&[23, 1], DType::F32, Device::Cpu)?;
    let mut t = x.clone();
    for i in 0..20 {
        t = match i % 5 {
            0 => t.mul(1.01)?,
            1 => t.add(&y)?,
            2 => t.tanh()?,
            3 => t.sub(0.5)?,
            _ => t.abs()?.sqrt()?,
        };
    }
    let plan = inspect(&[&t]);
    assert_eq!(plan.len(), 1, "{plan:?}");
    assert_eq!(plan[0].kind, "elementwise");
    assert!(plan[0].ops.len() >= 20, "{plan:?}");
    // And it computes the same as step by step.
    let xs = x.to_f64_vec()?;
    let ys = y.to_f64_vec()?;
    let got = t.to_f64_vec()?;
    for r in 0..23 {
        for c in 0..37 {
            let mut v = xs[r * 37 + c] as f32;
            for i in 0..20 {
                v = match i % 5 {
                    0 => v * 1.01,
                    1 => v + ys[r] as f32,
                    2 => v.tanh(),
                    3 => v - 0.5,
                    _ => v.abs().sqrt(),
                };
            }
            let g = got[r * 37 + c] as f32;
            assert!((g - v).abs() <= 1e-5 * (1.0 + v.abs()), "{r},{c}: {g} vs {v}");
        }
    }
    Ok(())
}

#[test]
fn softmax_is_at_most_three_kernels() -> voltaic::Result<()> {
    let x = Tensor::randn(&[17, 29], DType::F32, Device::Cpu)?;
    let s = x.softmax(-1)?;
    let plan = inspect(&[&s]);
    assert!(plan.len() <= 3, "{plan:?}");
    let v = s.to_vec::<f32>()?;
    let xs = x.to_vec::<f32>()?;
    for r in 0..17 {
        let row = &xs[r * 29..(r + 1) * 29];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
        let z: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        for c in 0..29 {
            let want = (row[c] as f64 - m).exp() / z;
            assert!((v[r * 29 + c] as f64 - want).abs() < 1e-6);
        }
    }
    Ok(())
}
