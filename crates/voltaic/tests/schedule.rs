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

#[test]
fn impossible_allocation_is_an_error_not_an_abort() -> voltaic::Result<()> {
    let huge = Tensor::zeros(&[1 << 40], DType::F32, Device::Cpu)?; // a broadcast constant: free
    let err = huge.contiguous()?.realize().unwrap_err();
    assert!(matches!(err, voltaic::Error::OutOfMemory(_)), "{err}");
    // The process goes on and later work still runs.
    assert_eq!(Tensor::ones(&[3], DType::F32, Device::Cpu)?.sum_all()?.item::<f32>()?, 3.0);
    Ok(())
}

#[test]
fn intermediates_held_by_the_user_keep_their_values() -> voltaic::Result<()> {
    let a = Tensor::randn(&[8, 5], DType::F32, Device::Cpu)?;
    let h = a.matmul(&a.t()?)?; // materialized: matmul
    let e = h.exp()?; // inlined into the sum below, but held here
    let s = e.sum_all()?;
    s.realize()?;
    assert!(h.is_realized(), "a matmul output the user holds is kept");
    let ev = e.to_vec::<f32>()?;
    let hv = h.to_vec::<f32>()?;
    let total: f64 = hv.iter().map(|&v| (v as f64).exp()).sum();
    assert!((s.item::<f32>()? as f64 - total).abs() <= 1e-4 * total);
    for (x, y) in ev.iter().zip(&hv) {
        assert!((*x as f64 - (*y as f64).exp()).abs() <= 1e-5 * (*y as f64).exp());
    }
    Ok(())
}

#[test]
fn long_pending_chains_neither_overflow_nor_lose_values() -> voltaic::Result<()> {
    let x = Tensor::full(&[4], 1.0, DType::F32, Device::Cpu)?;
    let mut t = x.clone();
    for _ in 0..5000 {
        t = t.add(1.0)?;
    }
    assert_eq!(t.to_vec::<f32>()?, vec![5001.0; 4]);
    Ok(())
}

#[test]
fn bias_and_activation_run_in_the_matmul_kernel() -> voltaic::Result<()> {
    voltaic::manual_seed(4);
    let x = Tensor::randn(&[5, 7], DType::F32, Device::Cpu)?;
    let w = Tensor::randn(&[3, 7], DType::F32, Device::Cpu)?;
    let b = Tensor::randn(&[3], DType::F32, Device::Cpu)?;
    let y = x.matmul(&w.t()?)?.add(&b)?.relu()?;
    let plan = inspect(&[&y]);
    assert_eq!(plan.len(), 1, "{plan:?}");
    assert_eq!(plan[0].kind, "matmul");
    assert_eq!(plan[0].ops, ["matmul", "relu", "add"], "{plan:?}");
    drop(y);
    // (While `y` is held its product must be kept, so nothing could fold into it.)
    let g = x.matmul(&w.t()?)?.add(&b)?.relu()?.gelu()?.mul(2.0)?;
    assert_eq!(inspect(&[&g]).len(), 1, "GELU chains fuse too: {:?}", inspect(&[&g]));
    // The product is kept when someone else holds it: no fusion then.
    let p = x.matmul(&w.t()?)?;
    let q = p.relu()?;
    assert_eq!(inspect(&[&p, &q]).len(), 2);
    // Values against a naive loop.
    let (xv, wv, bv) = (x.to_vec::<f32>()?, w.to_vec::<f32>()?, b.to_vec::<f32>()?);
    let got = g.to_vec::<f32>()?;
    for i in 0..5 {
        for j in 0..3 {
            let s: f64 = (0..7).map(|k| xv[i * 7 + k] as f64 * wv[j * 7 + k] as f64).sum::<f64>() + bv[j] as f64;
            let r = s.max(0.0);
            let want = 2.0 * 0.5 * r * (1.0 + common_erf(r / std::f64::consts::SQRT_2));
            assert!((got[i * 3 + j] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "({i},{j}): {} vs {want}", got[i * 3 + j]);
        }
    }
    Ok(())
}

#[test]
fn in_training_relu_keeps_its_output_not_its_input() -> voltaic::Result<()> {
    // relu's gradient reads its output (as PyTorch's threshold_backward
    // does): the pre-activation is not kept for the backward pass, so the
    // bias add and the relu still run in the product's kernel.
    voltaic::manual_seed(5);
    let x = Tensor::randn(&[6, 5], DType::F32, Device::Cpu)?;
    let w = Tensor::randn(&[4, 5], DType::F32, Device::Cpu)?.requires_grad()?;
    let b = Tensor::randn(&[4], DType::F32, Device::Cpu)?.requires_grad()?;
    let y = x.matmul(&w.t()?)?.add(&b)?.relu()?;
    let plan = inspect(&[&y]);
    assert_eq!(plan.len(), 1, "{plan:?}");
    assert_eq!(plan[0].ops, ["matmul", "relu", "add"], "{plan:?}");
    // The gradients against a naive loop: d(sum y)/dw[j][k] = sum_i [s_ij > 0] x_ik.
    y.sum(&[0, 1], false)?.backward()?;
    let (xv, wv, bv) = (x.to_vec::<f32>()?, w.to_vec::<f32>()?, b.to_vec::<f32>()?);
    let (gw, gb) = (w.grad().expect("w has a gradient").to_vec::<f32>()?, b.grad().expect("b has a gradient").to_vec::<f32>()?);
    for j in 0..4 {
        let mut want_b = 0.0f64;
        let mut want_w = [0.0f64; 5];
        for i in 0..6 {
            let s: f64 = (0..5).map(|k| xv[i * 5 + k] as f64 * wv[j * 5 + k] as f64).sum::<f64>() + bv[j] as f64;
            if s > 0.0 {
                want_b += 1.0;
                for k in 0..5 {
                    want_w[k] += xv[i * 5 + k] as f64;
                }
            }
        }
        assert!((gb[j] as f64 - want_b).abs() < 1e-5, "b[{j}]: {} vs {want_b}", gb[j]);
        for k in 0..5 {
            assert!((gw[j * 5 + k] as f64 - want_w[k]).abs() < 1e-4, "w[{j}][{k}]: {} vs {}", gw[j * 5 + k], want_w[k]);
        }
    }
    Ok(())
}

/// erf by its series (|x| small) or continued fraction, independent of the library.
fn common_erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.5 * x.abs());
    let y = 1.0
        - t * (-x * x - 1.26551223
            + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
            .exp();
    if x >= 0.0 { y } else { -y }
}
