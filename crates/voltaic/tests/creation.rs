//! Creation functions, random numbers, scalar access and `Display`.

mod common;

use common::*;
use std::sync::Mutex;
use voltaic::{DType, Device, Generator, Tensor};

type Res = voltaic::Result<()>;
const CPU: Device = Device::Cpu;

/// Tests that use the default generator hold this, so that no other test of
/// this file draws from it between `manual_seed` and the draw.
static DEFAULT_RNG: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    DEFAULT_RNG.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn zeros_ones_full_and_likes() -> Res {
    for dtype in DType::ALL {
        for dims in [vec![], vec![0], vec![3], vec![2, 0, 4], vec![1031], vec![3, 1, 5]] {
            let n = numel(&dims);
            for (t, v) in [
                (Tensor::zeros(&dims, dtype, CPU)?, 0.0),
                (Tensor::ones(&dims, dtype, CPU)?, 1.0),
                (Tensor::full(&dims, 2.7, dtype, CPU)?, round_to(2.7, dtype)),
                (Tensor::full(&dims, -3.0, dtype, CPU)?, round_to(-3.0, dtype)),
            ] {
                assert_eq!(t.dims(), &dims[..]);
                assert_eq!(t.dtype(), dtype);
                assert_eq!(t.numel(), n);
                assert_same(&t.to_f64_vec()?, &vec![v; n], &format!("{dtype} {dims:?} filled with {v}"));
                // And as a contiguous buffer.
                let c = t.contiguous()?;
                assert!(c.is_contiguous());
                assert_same(&c.to_f64_vec()?, &vec![v; n], "contiguous fill");
            }
            let (x, _) = tensor(&vec![0.5; n], &dims, dtype);
            for (t, v) in [(x.zeros_like()?, 0.0), (x.ones_like()?, 1.0), (x.full_like(4.0)?, 4.0)] {
                assert_eq!(t.dims(), &dims[..]);
                assert_eq!(t.dtype(), dtype);
                assert_same(&t.to_f64_vec()?, &vec![round_to(v, dtype); n], "like");
            }
        }
    }
    // Rounding of the fill value: f16, bf16 and bool.
    assert_eq!(Tensor::full(&[1], 1.0 / 3.0, DType::F16, CPU)?.to_f64_vec()?, vec![round_f16(1.0 / 3.0)]);
    assert_eq!(Tensor::full(&[1], 1.0 / 3.0, DType::BF16, CPU)?.to_f64_vec()?, vec![round_bf16(1.0 / 3.0)]);
    assert_eq!(Tensor::full(&[2], 0.25, DType::Bool, CPU)?.to_vec::<bool>()?, vec![true, true]);
    assert!(Tensor::zeros(&[usize::MAX, 2], DType::F32, CPU).is_err(), "too many elements");
    Ok(())
}

/// `start, start + step, ...` strictly before `end`, counted naively.
fn arange_ref(start: f64, end: f64, step: f64) -> Vec<f64> {
    let mut out = vec![];
    let mut i = 0.0;
    loop {
        let v = start + i * step;
        if (step > 0.0 && v >= end) || (step < 0.0 && v <= end) {
            return out;
        }
        out.push(v);
        i += 1.0;
    }
}

#[test]
fn arange_values() -> Res {
    let cases = [
        (0.0, 5.0, 1.0),
        (1.0, 2.0, 0.3),
        (5.0, 0.0, -1.5),
        (3.0, 3.0, 1.0),
        (-2.5, 2.5, 0.5),
        (0.0, 1031.0, 1.0),
        (10.0, -10.0, -3.0),
        (0.0, 1.0, 0.1),
    ];
    for (s, e, st) in cases {
        let want = arange_ref(s, e, st);
        let t = Tensor::arange(s, e, st, DType::F64, CPU)?;
        assert_eq!(t.dims(), &[want.len()], "arange({s}, {e}, {st})");
        assert_close(&t.to_f64_vec()?, &want, 1e-12, 1e-12, &format!("arange({s}, {e}, {st})"));
        let t = Tensor::arange(s, e, st, DType::F32, CPU)?;
        assert_eq!(t.dtype(), DType::F32);
        assert_same(&t.to_f64_vec()?, &want.iter().map(|&v| round_f32(v)).collect::<Vec<_>>(), "arange f32");
    }
    assert_eq!(Tensor::arange(0.0, 5.0, 1.0, DType::I32, CPU)?.to_vec::<i32>()?, vec![0, 1, 2, 3, 4]);
    assert_eq!(Tensor::arange(7.0, -1.0, -2.0, DType::I32, CPU)?.to_vec::<i32>()?, vec![7, 5, 3, 1]);
    assert_eq!(Tensor::arange(0.0, 3.0, 1.0, DType::U32, CPU)?.to_vec::<u32>()?, vec![0, 1, 2]);
    assert!(Tensor::arange(0.0, 1.0, 0.0, DType::F32, CPU).is_err(), "step 0");
    assert!(Tensor::arange(0.0, 1.0, -1.0, DType::F32, CPU).is_err(), "wrong direction");
    assert!(Tensor::arange(0.0, f64::INFINITY, 1.0, DType::F32, CPU).is_err());
    assert!(Tensor::arange(f64::NAN, 1.0, 1.0, DType::F32, CPU).is_err());
    Ok(())
}

#[test]
fn linspace_values() -> Res {
    for (s, e, n) in [(0.0, 1.0, 5), (-1.0, 1.0, 7), (3.0, -3.0, 13), (2.0, 2.0, 4), (0.0, 1.0, 1031), (1.5, 9.0, 2)] {
        let t = Tensor::linspace(s, e, n, DType::F64, CPU)?;
        let want: Vec<f64> = (0..n).map(|i| s + (e - s) * i as f64 / (n - 1) as f64).collect();
        assert_eq!(t.dims(), &[n]);
        let got = t.to_f64_vec()?;
        assert_close(&got, &want, 1e-12, 1e-12, &format!("linspace({s}, {e}, {n})"));
        // The ends are exact.
        assert_eq!(got[0], s);
        assert_eq!(got[n - 1], e);
        let t = Tensor::linspace(s, e, n, DType::F32, CPU)?;
        assert_close(&t.to_f64_vec()?, &want, 1e-6, 1e-6, "linspace f32");
    }
    assert_eq!(Tensor::linspace(4.0, 9.0, 1, DType::F32, CPU)?.to_vec::<f32>()?, vec![4.0]);
    assert_eq!(Tensor::linspace(4.0, 9.0, 0, DType::F32, CPU)?.dims(), &[0]);
    assert_eq!(Tensor::linspace(0.0, 10.0, 6, DType::I32, CPU)?.to_vec::<i32>()?, vec![0, 2, 4, 6, 8, 10]);
    Ok(())
}

#[test]
fn eye_values() -> Res {
    for dtype in DType::ALL {
        for n in [0, 1, 4, 13] {
            let t = Tensor::eye(n, dtype, CPU)?;
            assert_eq!(t.dims(), &[n, n]);
            assert_eq!(t.dtype(), dtype);
            let want: Vec<f64> = (0..n * n).map(|i| if i / n.max(1) == i % n.max(1) { 1.0 } else { 0.0 }).collect();
            assert_same(&t.to_f64_vec()?, &want, &format!("eye({n}) {dtype}"));
        }
    }
    Ok(())
}

#[test]
fn same_seed_same_numbers() -> Res {
    let _g = lock();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        voltaic::manual_seed(1234);
        let a = Tensor::rand(&[257], dtype, CPU)?.to_f64_vec()?;
        let b = Tensor::randn(&[3, 5], dtype, CPU)?.to_f64_vec()?;
        voltaic::manual_seed(1234);
        let a2 = Tensor::rand(&[257], dtype, CPU)?.to_f64_vec()?;
        let b2 = Tensor::randn(&[3, 5], dtype, CPU)?.to_f64_vec()?;
        assert_eq!(a, a2, "rand {dtype}");
        assert_eq!(b, b2, "randn {dtype}");
        // The stream moves on: a second draw differs from the first.
        let a3 = Tensor::rand(&[257], dtype, CPU)?.to_f64_vec()?;
        assert_ne!(a, a3);
        voltaic::manual_seed(1235);
        assert_ne!(Tensor::rand(&[257], dtype, CPU)?.to_f64_vec()?, a, "another seed");
    }
    // Bernoulli too.
    let p = Tensor::full(&[500], 0.5, DType::F32, CPU)?;
    voltaic::manual_seed(7);
    let x = p.bernoulli()?.to_f64_vec()?;
    voltaic::manual_seed(7);
    assert_eq!(p.bernoulli()?.to_f64_vec()?, x);
    // Explicit generators are independent of the default one and of each other.
    let mut g1 = Generator::new(99);
    let mut g2 = Generator::new(99);
    let r1 = Tensor::randn_with(&mut g1, &[100], DType::F32, CPU)?.to_f64_vec()?;
    voltaic::manual_seed(99);
    let _ = Tensor::randn(&[50], DType::F32, CPU)?;
    let r2 = Tensor::randn_with(&mut g2, &[100], DType::F32, CPU)?.to_f64_vec()?;
    assert_eq!(r1, r2);
    Ok(())
}

#[test]
fn generator_streams_split_consistently() -> Res {
    // Drawing n then m numbers gives the same as drawing n + m at once.
    let mut g = Generator::new(5);
    let a = Tensor::rand_with(&mut g, &[100], DType::F32, CPU)?.to_f64_vec()?;
    let b = Tensor::rand_with(&mut g, &[37], DType::F32, CPU)?.to_f64_vec()?;
    let mut h = Generator::new(5);
    let all = Tensor::rand_with(&mut h, &[137], DType::F32, CPU)?.to_f64_vec()?;
    assert_eq!([a, b].concat(), all);
    // The shape does not matter, only the count.
    let mut g = Generator::new(6);
    let x = Tensor::randn_with(&mut g, &[4, 25], DType::F64, CPU)?.to_f64_vec()?;
    let mut h = Generator::new(6);
    let y = Tensor::randn_with(&mut h, &[100], DType::F64, CPU)?.to_f64_vec()?;
    assert_eq!(x, y);
    Ok(())
}

#[test]
fn rand_is_uniform_in_unit_interval() -> Res {
    let n = 100_000;
    for (k, dtype) in [DType::F32, DType::F64, DType::F16, DType::BF16].into_iter().enumerate() {
        let mut g = Generator::new(17 + k as u64);
        let v = Tensor::rand_with(&mut g, &[n], dtype, CPU)?.to_f64_vec()?;
        assert!(v.iter().all(|&x| (0.0..1.0).contains(&x)), "rand {dtype} outside [0, 1)");
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "rand {dtype} mean {mean}");
        assert!((var - 1.0 / 12.0).abs() < 0.01, "rand {dtype} var {var}");
        // Every tenth of the interval gets about a tenth of the samples.
        let mut bins = [0usize; 10];
        for &x in &v {
            bins[(x * 10.0) as usize] += 1;
        }
        assert!(bins.iter().all(|&b| (b as f64 - n as f64 / 10.0).abs() < n as f64 / 100.0), "rand {dtype} bins {bins:?}");
    }
    // f64 uses more than 24 random bits.
    let mut g = Generator::new(3);
    let v = Tensor::rand_with(&mut g, &[1000], DType::F64, CPU)?.to_f64_vec()?;
    assert!(v.iter().any(|&x| x as f32 as f64 != x), "f64 rand has only f32 resolution");
    assert!(Tensor::rand(&[2], DType::I32, CPU).is_err());
    assert!(Tensor::randn(&[2], DType::Bool, CPU).is_err());
    Ok(())
}

#[test]
fn randn_has_mean_zero_and_std_one() -> Res {
    let n = 100_000;
    for (k, dtype) in [DType::F32, DType::F64].into_iter().enumerate() {
        let mut g = Generator::new(31 + k as u64);
        let v = Tensor::randn_with(&mut g, &[n], dtype, CPU)?.to_f64_vec()?;
        let mean = v.iter().sum::<f64>() / n as f64;
        let std = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64).sqrt();
        assert!(mean.abs() < 0.02, "randn {dtype} mean {mean}");
        assert!((std - 1.0).abs() < 0.02, "randn {dtype} std {std}");
        // About 68.3% within one sigma, 95.4% within two.
        let within = |s: f64| v.iter().filter(|x| x.abs() < s).count() as f64 / n as f64;
        assert!((within(1.0) - 0.6827).abs() < 0.01, "randn {dtype} within 1: {}", within(1.0));
        assert!((within(2.0) - 0.9545).abs() < 0.01, "randn {dtype} within 2: {}", within(2.0));
        assert!(v.iter().all(|x| x.is_finite()));
    }
    // The default generator, and the shape of the result.
    let _g = lock();
    voltaic::manual_seed(0);
    let t = Tensor::randn(&[7, 13, 0], DType::F32, CPU)?;
    assert_eq!(t.dims(), &[7, 13, 0]);
    let t = Tensor::randn(&[], DType::F64, CPU)?;
    assert!(t.item::<f64>()?.is_finite());
    Ok(())
}

#[test]
fn bernoulli_follows_its_probabilities() -> Res {
    let _g = lock();
    voltaic::manual_seed(11);
    let m: usize = 33_333;
    let p = Tensor::from_vec(vec![0.0f32, 1.0, 0.3], &[3, 1], CPU)?.expand(&[3, m as isize])?;
    let b = p.bernoulli()?;
    assert_eq!(b.dtype(), DType::F32);
    assert_eq!(b.dims(), &[3, m]);
    let v = b.to_f64_vec()?;
    assert!(v.iter().all(|&x| x == 0.0 || x == 1.0));
    assert!(v[..m].iter().all(|&x| x == 0.0), "p = 0 must give 0");
    assert!(v[m..2 * m].iter().all(|&x| x == 1.0), "p = 1 must give 1");
    let mean = v[2 * m..].iter().sum::<f64>() / m as f64;
    assert!((mean - 0.3).abs() < 0.015, "p = 0.3 gave mean {mean}");
    // dtype follows the probabilities; integer probabilities are refused.
    let p64 = Tensor::full(&[1000], 0.5, DType::F64, CPU)?;
    let b64 = p64.bernoulli()?;
    assert_eq!(b64.dtype(), DType::F64);
    let mean = b64.to_f64_vec()?.iter().sum::<f64>() / 1000.0;
    assert!((mean - 0.5).abs() < 0.08, "{mean}");
    assert!(Tensor::ones(&[2], DType::I32, CPU)?.bernoulli().is_err());
    Ok(())
}

#[test]
fn from_vec_scalar_item_and_to_vec() -> Res {
    let e = Tensor::from_vec(vec![1f32, 2., 3.], &[2, 2], CPU).unwrap_err();
    assert!(e.is_shape(), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("from_vec") && msg.contains("[2, 2]") && msg.contains('3'), "{msg}");
    assert!(Tensor::from_vec(Vec::<f32>::new(), &[1], CPU).is_err());
    assert!(Tensor::from_vec(vec![1i32], &[], CPU).is_ok());
    assert_eq!(Tensor::from_vec(Vec::<f64>::new(), &[0, 3], CPU)?.dims(), &[0, 3]);
    let t = Tensor::from_slice(&[1u32, 2, 3, 4, 5, 6], &[3, 2], CPU)?;
    assert_eq!(t.dtype(), DType::U32);
    assert_eq!(t.to_vec::<u32>()?, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(t.shape(), &[3, 2]);
    assert_eq!(t.size(-1)?, 2);
    assert_eq!(t.rank(), 2);
    assert!(t.size(2).is_err());

    // item on one-element tensors of any rank.
    assert_eq!(Tensor::scalar(2.5f32, CPU)?.item::<f32>()?, 2.5);
    assert_eq!(Tensor::from_vec(vec![7i32], &[1, 1, 1], CPU)?.item::<i32>()?, 7);
    assert!(Tensor::scalar(true, CPU)?.item::<bool>()?);
    assert_eq!(Tensor::scalar(half::f16::from_f32(0.5), CPU)?.item_f64()?, 0.5);
    let s = Tensor::from_vec(vec![1f32, 2.], &[2], CPU)?;
    assert!(s.item::<f32>().unwrap_err().is_shape());
    assert!(s.item_f64().is_err());
    assert!(Tensor::zeros(&[0], DType::F32, CPU)?.item::<f32>().is_err());
    // item and to_vec of the wrong type are errors, not conversions.
    assert!(Tensor::scalar(2.5f32, CPU)?.item::<f64>().is_err());
    assert!(s.to_vec::<i32>().is_err());
    // item of a pending result and of a view.
    assert_eq!(s.sum(&[], false)?.item::<f32>()?, 3.0);
    assert_eq!(s.narrow(0, 1, 1)?.item::<f32>()?, 2.0);
    Ok(())
}

fn show(t: &Tensor) -> String {
    format!("{t}")
}

#[test]
fn display_like_pytorch() -> Res {
    let f = |v: Vec<f32>, d: &[usize]| Tensor::from_vec(v, d, CPU).unwrap();
    assert_eq!(show(&f(vec![1., 2., 3.], &[3])), "tensor([1., 2., 3.])");
    assert_eq!(show(&f(vec![1.5, 2.0, 3.0, 4.25], &[2, 2])), "tensor([[1.5000, 2.0000],\n        [3.0000, 4.2500]])");
    assert_eq!(show(&f(vec![-1., 2.], &[2])), "tensor([-1.,  2.])");
    assert_eq!(show(&f(vec![1.5, -2.25], &[2])), "tensor([ 1.5000, -2.2500])");
    assert_eq!(show(&f(vec![1.0 / 3.0], &[1])), "tensor([0.3333])");
    assert_eq!(show(&Tensor::scalar(3.5f32, CPU)?), "tensor(3.5000)");
    assert_eq!(show(&Tensor::scalar(2.0f32, CPU)?), "tensor(2.)");
    assert_eq!(
        show(&Tensor::arange(0.0, 8.0, 1.0, DType::F32, CPU)?.reshape(&[2, 2, 2])?),
        "tensor([[[0., 1.],\n         [2., 3.]],\n\n        [[4., 5.],\n         [6., 7.]]])"
    );
    // dtype suffix for everything but f32 (and bool, as PyTorch).
    assert_eq!(show(&Tensor::from_vec(vec![1i32, -2, 30], &[3], CPU)?), "tensor([ 1, -2, 30], dtype=i32)");
    assert_eq!(show(&Tensor::from_vec(vec![7u32], &[1], CPU)?), "tensor([7], dtype=u32)");
    assert_eq!(show(&Tensor::from_vec(vec![true, false], &[2], CPU)?), "tensor([ True, False])");
    assert_eq!(show(&Tensor::from_vec(vec![0.5f64, 1.0], &[2], CPU)?), "tensor([0.5000, 1.0000], dtype=f64)");
    assert_eq!(show(&Tensor::ones(&[2], DType::F16, CPU)?), "tensor([1., 1.], dtype=f16)");
    assert_eq!(show(&Tensor::full(&[1], 0.5, DType::BF16, CPU)?), "tensor([0.5000], dtype=bf16)");
    // Scientific notation: tiny values, a wide range, or huge values.
    assert_eq!(show(&f(vec![1e-5, 1.0], &[2])), "tensor([1.0000e-05, 1.0000e+00])");
    assert_eq!(show(&f(vec![0.5, 1234.5], &[2])), "tensor([5.0000e-01, 1.2345e+03])");
    assert_eq!(show(&f(vec![1.0, 2000.0], &[2])), "tensor([1.0000e+00, 2.0000e+03])");
    assert_eq!(show(&f(vec![1e9, 1.0], &[2])), "tensor([1.0000e+09, 1.0000e+00])");
    assert_eq!(show(&f(vec![0.0, 100.0], &[2])), "tensor([  0., 100.])");
    // Non-finite values do not widen the columns.
    assert_eq!(show(&f(vec![1.0, f32::NAN, f32::INFINITY], &[3])), "tensor([1., nan, inf])");
    assert_eq!(show(&f(vec![f32::NEG_INFINITY, 0.5], &[2])), "tensor([  -inf, 0.5000])");
    // A view prints its own values.
    assert_eq!(show(&f(vec![1., 2., 3., 4.], &[2, 2]).t()?), "tensor([[1., 3.],\n        [2., 4.]])");
    Ok(())
}

#[test]
fn display_summarises_large_tensors() -> Res {
    // 1000 elements are shown in full, 1001 are summarised.
    let full = show(&Tensor::arange(0.0, 1000.0, 1.0, DType::I32, CPU)?);
    assert!(!full.contains("..."), "{full}");
    assert!(full.starts_with("tensor([  0,   1,   2,") && full.ends_with(" 998, 999], dtype=i32)"), "{full}");
    assert_eq!(show(&Tensor::arange(0.0, 2000.0, 1.0, DType::I32, CPU)?), "tensor([   0,    1,    2,  ..., 1997, 1998, 1999], dtype=i32)");
    let ones = show(&Tensor::ones(&[50, 50], DType::F32, CPU)?);
    let row = "[1., 1., 1.,  ..., 1., 1., 1.]";
    let want = format!("tensor([{row},\n        {row},\n        {row},\n        ...,\n        {row},\n        {row},\n        {row}])");
    assert_eq!(ones, want);
    // The style is decided by the shown values only.
    let mut v = vec![0.5f32; 1500];
    v[700] = 1e-9;
    let s = show(&Tensor::from_vec(v, &[1500], CPU)?);
    assert_eq!(s, "tensor([0.5000, 0.5000, 0.5000,  ..., 0.5000, 0.5000, 0.5000])");
    // Empty tensors print without failing.
    let e = show(&Tensor::zeros(&[0], DType::F32, CPU)?);
    assert!(e.starts_with("tensor([]"), "{e}");
    let e = show(&Tensor::zeros(&[2, 0], DType::F32, CPU)?);
    assert!(e.starts_with("tensor(") && e.contains("size="), "{e}");
    Ok(())
}
