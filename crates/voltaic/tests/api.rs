//! The operators (`+ - * / %`, unary `-`) in every form they accept:
//! owned and borrowed tensors, scalars on either side, `Result<Tensor>`
//! operands; each against a naive f64 loop here, over broadcasting, a
//! transposed view and an empty tensor, on the CPU and on the GPU. Shape
//! mismatches and error operands come back as `Err`.

mod common;

use common::*;
use voltaic::{DType, Device, Tensor};

fn gpu() -> Device {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0))
}

/// `f` applied elementwise with broadcasting, in f64.
fn reference(a: &[f64], ad: &[usize], b: &[f64], bd: &[usize], f: impl Fn(f64, f64) -> f64) -> (Vec<f64>, Vec<usize>) {
    let od = bcast_shape(ad, bd).expect("broadcastable");
    let v = (0..numel(&od))
        .map(|i| {
            let idx = unravel(i, &od);
            f(a[bcast_pos(&idx, ad)], b[bcast_pos(&idx, bd)])
        })
        .collect();
    (v, od)
}

fn close(got: &Tensor, want: &[f64], dims: &[usize], what: &str) {
    assert_eq!(got.dims(), dims, "{what}: shape");
    let g = got.to_f64_vec().unwrap();
    for (i, (x, y)) in g.iter().zip(want).enumerate() {
        let tol = 1e-5 * (1.0 + y.abs());
        assert!((x - round_f32(*y)).abs() <= tol || (x.is_nan() && y.is_nan()), "{what}: element {i} is {x}, expected {y}");
    }
}

/// A binary op in f64.
type Op = fn(f64, f64) -> f64;

fn fmod_floor(x: f64, y: f64) -> f64 {
    // PyTorch's remainder: the sign of the divisor.
    let r = x % y;
    if r != 0.0 && (r < 0.0) != (y < 0.0) {
        r + y
    } else {
        r
    }
}

fn check_on(dev: Device) {
    let mut rng = Rng::new(11);
    // (a dims, b dims, transpose a?)
    let cases: &[(&[usize], &[usize], bool)] = &[(&[3, 5], &[3, 5], false), (&[4, 1], &[1, 6], false), (&[2, 3, 4], &[4], false), (&[5, 3], &[3, 5], true), (&[0, 3], &[3], false), (&[], &[2, 2], false)];
    for &(ad, bd, transpose) in cases {
        let av = rng.normals(numel(ad));
        let bv: Vec<f64> = rng.normals(numel(bd)).iter().map(|x| if x.abs() < 0.1 { x + 0.5 } else { *x }).collect();
        let mut a = Tensor::from_vec(av.iter().map(|&x| x as f32).collect::<Vec<_>>(), ad, dev).unwrap();
        let (mut av, mut ad) = (av.clone(), ad.to_vec());
        if transpose {
            // A non-contiguous left operand: the transpose of a [m, n] tensor.
            a = a.t().unwrap();
            let (m, n) = (ad[0], ad[1]);
            av = (0..n * m).map(|i| av[(i % m) * n + i / m]).collect();
            ad = vec![n, m];
            assert!(!a.is_contiguous());
        }
        let b = Tensor::from_vec(bv.iter().map(|&x| x as f32).collect::<Vec<_>>(), bd, dev).unwrap();
        let what = |op: &str| format!("{op} {ad:?} {bd:?} on {dev}");
        let ops: [(&str, Op); 5] = [("+", |x, y| x + y), ("-", |x, y| x - y), ("*", |x, y| x * y), ("/", |x, y| x / y), ("%", fmod_floor)];
        for (name, f) in ops {
            let (want, od) = reference(&av, &ad, &bv, bd, f);
            let forms: Vec<(&str, voltaic::Result<Tensor>)> = match name {
                "+" => vec![("&a + &b", &a + &b), ("a + b", a.clone() + b.clone()), ("&a + b", &a + b.clone()), ("a + &b", a.clone() + &b), ("Ok(a) + &b", Ok(a.clone()) + &b), ("&a + Ok(b)", &a + Ok(b.clone()))],
                "-" => vec![("&a - &b", &a - &b), ("a - b", a.clone() - b.clone()), ("Ok(a) - b", Ok(a.clone()) - b.clone())],
                "*" => vec![("&a * &b", &a * &b), ("a * &b", a.clone() * &b)],
                "/" => vec![("&a / &b", &a / &b), ("Ok(a) / &b", Ok(a.clone()) / &b)],
                _ => vec![("&a % &b", &a % &b)],
            };
            for (form, got) in forms {
                close(&got.unwrap(), &want, &od, &format!("{} ({form})", what(name)));
            }
            // Scalars on either side.
            let s = 1.75;
            let (right, _) = reference(&av, &ad, &[s], &[], f);
            let (left, _) = reference(&[s], &[], &av, &ad, f);
            let (r, l) = match name {
                "+" => (&a + s, s + &a),
                "-" => (&a - s, s - &a),
                "*" => (&a * s, s * &a),
                "/" => (&a / s, s / &a),
                _ => (&a % s, s % &a),
            };
            close(&r.unwrap(), &right, &ad, &what(&format!("a {name} scalar")));
            close(&l.unwrap(), &left, &ad, &what(&format!("scalar {name} a")));
        }
        let neg: Vec<f64> = av.iter().map(|x| -x).collect();
        close(&(-&a).unwrap(), &neg, &ad, &what("-&a"));
        close(&(-a.clone()).unwrap(), &neg, &ad, &what("-a"));
        // A chain reads like the math: (2a + 1) * b - a / 4.
        let (two_a1, _) = reference(&av, &ad, &[0.0], &[], |x, _| 2.0 * x + 1.0);
        let (prod, od) = reference(&two_a1, &ad, &bv, bd, |x, y| x * y);
        let (quarter, _) = reference(&av, &ad, &[0.0], &[], |x, _| x / 4.0);
        let (want, od2) = reference(&prod, &od, &quarter, &ad, |x, y| x - y);
        let chain = (|| -> voltaic::Result<Tensor> { (((&a * 2.0)? + 1.0)? * &b)? - (&a / 4.0) })().unwrap();
        close(&chain, &want, &od2, &what("chain"));
    }
}

#[test]
fn operators_match_f64_loops_on_the_cpu() {
    check_on(Device::Cpu);
}

#[test]
fn operators_match_f64_loops_on_the_gpu() {
    check_on(gpu());
}

#[test]
fn integer_tensors_and_scalars_keep_pytorch_dtypes() {
    let a = Tensor::from_vec(vec![7i32, -7, 9], &[3], Device::Cpu).unwrap();
    let r = (&a + 2).unwrap();
    assert_eq!((r.dtype(), r.to_vec::<i32>().unwrap()), (DType::I32, vec![9, -5, 11]));
    let r = (10 - &a).unwrap();
    assert_eq!((r.dtype(), r.to_vec::<i32>().unwrap()), (DType::I32, vec![3, 17, 1]));
    let r = (&a * 0.5).unwrap(); // a float scalar makes the result float
    assert_eq!((r.dtype(), r.to_vec::<f32>().unwrap()), (DType::F32, vec![3.5, -3.5, 4.5]));
    let r = (1.0 / &a).unwrap();
    assert_eq!(r.dtype(), DType::F32);
    let r = (&a % 4).unwrap(); // the divisor's sign, as torch.remainder
    assert_eq!(r.to_vec::<i32>().unwrap(), vec![3, 1, 1]);
}

#[test]
fn mismatches_and_error_operands_are_errors() {
    let a = Tensor::ones(&[3, 4], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::ones(&[5], DType::F32, Device::Cpu).unwrap();
    let e = (&a + &b).unwrap_err().to_string();
    assert!(e.contains("[3, 4]") && e.contains("[5]"), "{e}");
    // An error on either side passes through, unchanged.
    let bad = &a * &b;
    let msg = bad.as_ref().unwrap_err().to_string();
    assert_eq!((bad + &a).unwrap_err().to_string(), msg);
    assert_eq!((&a - (&a * &b)).unwrap_err().to_string(), msg);
    assert!((2.0 - Tensor::ones(&[0], DType::F32, Device::Cpu).unwrap()).unwrap().dims() == [0]);
}
