//! `matmul` values against a naive f64 reference with PyTorch's semantics:
//! 1-D operands, batch broadcasting, strided inputs, odd and empty sizes, dtypes.

mod common;
use common::*;
use voltaic::{DType, Device, Tensor};

/// Reference `torch.matmul` over logical (row-major) values: the product, the
/// sum of |a||b| of each output (an error scale) and the output shape.
fn ref_matmul(a: &[f64], ad: &[usize], b: &[f64], bd: &[usize]) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
    assert!(!ad.is_empty() && !bd.is_empty());
    let a2: Vec<usize> = if ad.len() == 1 { vec![1, ad[0]] } else { ad.to_vec() };
    let b2: Vec<usize> = if bd.len() == 1 { vec![bd[0], 1] } else { bd.to_vec() };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    assert_eq!(k, k2);
    let ab = &a2[..a2.len() - 2];
    let bb = &b2[..b2.len() - 2];
    let r = ab.len().max(bb.len());
    let get = |d: &[usize], i: usize| if i + d.len() >= r { d[i + d.len() - r] } else { 1 };
    let batch: Vec<usize> = (0..r)
        .map(|i| {
            let (x, y) = (get(ab, i), get(bb, i));
            assert!(x == y || x == 1 || y == 1);
            if x == 1 { y } else { x }
        })
        .collect();
    let nb = numel(&batch);
    let (na, nbb) = (numel(ab), numel(bb));
    let mut out = vec![0.0; nb * m * n];
    let mut scale = vec![0.0; nb * m * n];
    for bi in 0..nb {
        let idx = unravel(bi, &batch);
        // Batch position in a and in b (size-1 dims broadcast).
        let pos = |d: &[usize]| -> usize {
            let lead = r - d.len();
            let mut p = 0;
            for (j, &dj) in d.iter().enumerate() {
                p = p * dj + if dj == 1 { 0 } else { idx[lead + j] };
            }
            p
        };
        let (pa, pb) = (pos(ab), pos(bb));
        assert!(pa < na.max(1) && pb < nbb.max(1));
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut sa) = (0.0, 0.0);
                for p in 0..k {
                    let x = a[(pa * m + i) * k + p];
                    let y = b[(pb * k + p) * n + j];
                    s += x * y;
                    sa += (x * y).abs();
                }
                out[(bi * m + i) * n + j] = s;
                scale[(bi * m + i) * n + j] = sa;
            }
        }
    }
    let mut dims = batch;
    if ad.len() > 1 {
        dims.push(m);
    }
    if bd.len() > 1 {
        dims.push(n);
    }
    (out, scale, dims)
}

/// Relative tolerance (against the |a||b| scale) per dtype.
fn tol(dt: DType) -> f64 {
    match dt {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 1e-2,
        DType::BF16 => 2e-2,
        _ => 0.0, // integers: exact
    }
}

fn check_contiguous(ad: &[usize], bd: &[usize], dt: DType, seed: u64) -> voltaic::Result<()> {
    let mut rng = Rng::new(seed);
    let (a, av) = rand_tensor(&mut rng, ad, dt);
    let (b, bv) = rand_tensor(&mut rng, bd, dt);
    let (want, scale, dims) = ref_matmul(&av, ad, &bv, bd);
    let c = a.matmul(&b)?;
    let what = format!("{ad:?} @ {bd:?} ({dt})");
    assert_eq!(c.dims(), dims.as_slice(), "{what}");
    assert_eq!(c.dtype(), dt, "{what}");
    // A small absolute floor for half precision, where a tiny scale can still round.
    let scale: Vec<f64> = scale.iter().map(|s| if dt.is_float() && dt != DType::F64 && dt != DType::F32 { s + 1e-3 } else { *s }).collect();
    assert_close_scaled(&c.to_f64_vec()?, &want, &scale, tol(dt), &what);
    Ok(())
}

const ODD: [usize; 5] = [1, 2, 7, 33, 129];

#[test]
fn dot_1d_1d() -> voltaic::Result<()> {
    for (s, &k) in [0usize, 1, 2, 7, 33, 129, 1000].iter().enumerate() {
        for dt in [DType::F32, DType::F64, DType::I32] {
            check_contiguous(&[k], &[k], dt, 10 + s as u64)?;
        }
    }
    // The result is 0-d.
    let a = Tensor::from_vec(vec![1f32, 2., 3.], &[3], Device::Cpu)?;
    let b = Tensor::from_vec(vec![4f32, -5., 6.], &[3], Device::Cpu)?;
    let c = a.matmul(&b)?;
    assert_eq!(c.dims(), &[] as &[usize]);
    assert_eq!(c.item::<f32>()?, 12.0);
    Ok(())
}

#[test]
fn vector_matrix_and_matrix_vector() -> voltaic::Result<()> {
    let mut seed = 100;
    for &k in &[0, 1, 7, 33] {
        for &n in &[1, 2, 7, 129] {
            seed += 1;
            check_contiguous(&[k], &[k, n], DType::F32, seed)?;
            check_contiguous(&[n, k], &[k], DType::F32, seed + 1000)?;
            check_contiguous(&[k], &[k, n], DType::F64, seed + 2000)?;
            check_contiguous(&[n, k], &[k], DType::I32, seed + 3000)?;
        }
    }
    Ok(())
}

#[test]
fn matrix_matrix_odd_sizes() -> voltaic::Result<()> {
    let mut seed = 200;
    for &m in &ODD {
        for &k in &ODD {
            for &n in &ODD {
                if m * k * n > 129 * 33 * 33 {
                    continue;
                }
                seed += 1;
                check_contiguous(&[m, k], &[k, n], DType::F32, seed)?;
            }
        }
    }
    for (m, k, n) in [(1, 1, 1), (7, 33, 2), (33, 7, 129), (129, 65, 33), (64, 64, 64)] {
        check_contiguous(&[m, k], &[k, n], DType::F64, seed + (m * k * n) as u64)?;
        check_contiguous(&[m, k], &[k, n], DType::I32, seed + 1 + (m * k * n) as u64)?;
    }
    Ok(())
}

#[test]
fn empty_inner_dim_gives_zeros_and_empty_outer_dims_give_empty() -> voltaic::Result<()> {
    for dt in [DType::F32, DType::F64, DType::I32, DType::F16, DType::BF16] {
        let a = Tensor::ones(&[3, 0], dt, Device::Cpu)?;
        let b = Tensor::ones(&[0, 4], dt, Device::Cpu)?;
        let c = a.matmul(&b)?;
        assert_eq!(c.dims(), &[3, 4]);
        assert_eq!(c.to_f64_vec()?, vec![0.0; 12], "{dt}");
        // Batched, with k = 0.
        let c = Tensor::ones(&[2, 3, 0], dt, Device::Cpu)?.matmul(&Tensor::ones(&[0, 5], dt, Device::Cpu)?)?;
        assert_eq!(c.dims(), &[2, 3, 5]);
        assert_eq!(c.to_f64_vec()?, vec![0.0; 30], "{dt}");
        // 1-D of length 0.
        let c = Tensor::ones(&[0], dt, Device::Cpu)?.matmul(&Tensor::ones(&[0], dt, Device::Cpu)?)?;
        assert_eq!(c.dims(), &[] as &[usize]);
        assert_eq!(c.to_f64_vec()?, vec![0.0], "{dt}");
    }
    check_contiguous(&[0, 5], &[5, 3], DType::F32, 1)?;
    check_contiguous(&[5, 3], &[3, 0], DType::F32, 2)?;
    check_contiguous(&[0, 3, 4], &[4, 5], DType::F32, 3)?;
    check_contiguous(&[2, 0, 4], &[4, 5], DType::F32, 4)?;
    check_contiguous(&[2, 1, 3, 4], &[0, 4, 6], DType::F32, 5)?;
    Ok(())
}

#[test]
fn batched_with_broadcasting() -> voltaic::Result<()> {
    let cases: &[(&[usize], &[usize])] = &[
        (&[2, 1, 3, 4], &[5, 4, 6]),
        (&[5, 4, 6], &[2, 1, 6, 3]),
        (&[3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[4, 5]),
        (&[2, 3, 4], &[4]),
        (&[4], &[2, 4, 5]),
        (&[1, 3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[1, 4, 5]),
        (&[2, 1, 7, 1], &[1, 3, 1, 33]),
        (&[1, 1, 1, 2, 3], &[3, 2]),
        (&[7, 2, 5], &[7, 5, 3]),
        (&[9, 7, 7], &[9, 7, 7]),
        (&[3, 1, 1], &[1, 1, 1]),
    ];
    for (i, (ad, bd)) in cases.iter().enumerate() {
        for dt in [DType::F32, DType::F64, DType::I32] {
            check_contiguous(ad, bd, dt, 300 + i as u64)?;
        }
    }
    Ok(())
}

#[test]
fn half_precision_with_loose_tolerance() -> voltaic::Result<()> {
    let cases: &[(&[usize], &[usize])] =
        &[(&[7], &[7]), (&[3, 7], &[7, 5]), (&[2, 1, 3, 4], &[5, 4, 6]), (&[33, 17], &[17]), (&[1, 65], &[65, 9])];
    for (i, (ad, bd)) in cases.iter().enumerate() {
        check_contiguous(ad, bd, DType::F16, 400 + i as u64)?;
        check_contiguous(ad, bd, DType::BF16, 500 + i as u64)?;
    }
    Ok(())
}

#[test]
fn mixed_dtypes_promote() -> voltaic::Result<()> {
    let mut rng = Rng::new(7);
    let (a, av) = rand_tensor(&mut rng, &[3, 4], DType::F32);
    let (b, bv) = rand_tensor(&mut rng, &[4, 2], DType::F64);
    let (want, scale, _) = ref_matmul(&av, &[3, 4], &bv, &[4, 2]);
    let c = a.matmul(&b)?;
    assert_eq!(c.dtype(), DType::F64);
    assert_close_scaled(&c.to_f64_vec()?, &want, &scale, 1e-12, "f32 @ f64");

    let (a, av) = rand_tensor(&mut rng, &[3, 4], DType::I32);
    let (b, bv) = rand_tensor(&mut rng, &[4, 2], DType::F32);
    let (want, scale, _) = ref_matmul(&av, &[3, 4], &bv, &[4, 2]);
    let c = a.matmul(&b)?;
    assert_eq!(c.dtype(), DType::F32);
    assert_close_scaled(&c.to_f64_vec()?, &want, &scale, 1e-5, "i32 @ f32");
    Ok(())
}

#[test]
fn transposed_and_strided_inputs() -> voltaic::Result<()> {
    let mut rng = Rng::new(11);
    for &(m, k, n) in &[(1, 1, 1), (3, 4, 5), (7, 33, 2), (33, 7, 129), (2, 129, 3)] {
        for dt in [DType::F32, DType::F64, DType::I32] {
            let what = format!("{m}x{k}x{n} {dt}");
            // a = at.t(), with at stored as [k, m].
            let (at, atv) = rand_tensor(&mut rng, &[k, m], dt);
            let a = at.t()?;
            let a_log = strided(&atv, &[m, k], &[1, m], 0);
            // b = bt.t(), with bt stored as [n, k].
            let (bt, btv) = rand_tensor(&mut rng, &[n, k], dt);
            let b = bt.t()?;
            let b_log = strided(&btv, &[k, n], &[1, k], 0);
            let (want, scale, _) = ref_matmul(&a_log, &[m, k], &b_log, &[k, n]);
            assert_close_scaled(&a.matmul(&b)?.to_f64_vec()?, &want, &scale, tol(dt), &format!("aT bT {what}"));
            // Only one side transposed.
            let (bc, bcv) = rand_tensor(&mut rng, &[k, n], dt);
            let (want, scale, _) = ref_matmul(&a_log, &[m, k], &bcv, &[k, n]);
            assert_close_scaled(&a.matmul(&bc)?.to_f64_vec()?, &want, &scale, tol(dt), &format!("aT b {what}"));

            // Step-2 slice of the columns, starting at 1: base [m, 2k + 1].
            let (base, basev) = rand_tensor(&mut rng, &[m, 2 * k + 1], dt);
            let a = base.slice(1, 1, (2 * k + 1) as isize, 2)?;
            assert_eq!(a.dims(), &[m, k]);
            let a_log = strided(&basev, &[m, k], &[2 * k + 1, 2], 1);
            let (want, scale, _) = ref_matmul(&a_log, &[m, k], &bcv, &[k, n]);
            assert_close_scaled(&a.matmul(&bc)?.to_f64_vec()?, &want, &scale, tol(dt), &format!("sliced a {what}"));

            // A row expanded to m rows (stride 0), times a narrowed b.
            let (row, rowv) = rand_tensor(&mut rng, &[1, k], dt);
            let a = row.expand(&[m as isize, k as isize])?;
            let a_log = strided(&rowv, &[m, k], &[0, 1], 0);
            let (bb, bbv) = rand_tensor(&mut rng, &[k + 2, n], dt);
            let b = bb.narrow(0, 2, k)?;
            let b_log = strided(&bbv, &[k, n], &[n, 1], 2 * n);
            let (want, scale, _) = ref_matmul(&a_log, &[m, k], &b_log, &[k, n]);
            assert_close_scaled(&a.matmul(&b)?.to_f64_vec()?, &want, &scale, tol(dt), &format!("expanded a {what}"));
        }
    }
    Ok(())
}

#[test]
fn strided_batched_inputs() -> voltaic::Result<()> {
    let mut rng = Rng::new(12);
    for &(bsz, m, k, n) in &[(1, 1, 1, 1), (3, 4, 5, 2), (5, 7, 3, 9), (8, 7, 7, 7), (2, 33, 17, 5)] {
        for dt in [DType::F32, DType::F64] {
            let what = format!("b{bsz} {m}x{k}x{n} {dt}");
            // a: base [m, bsz, k] permuted to [bsz, m, k].
            let (abase, abv) = rand_tensor(&mut rng, &[m, bsz, k], dt);
            let a = abase.permute(&[1, 0, 2])?;
            let a_log = strided(&abv, &[bsz, m, k], &[k, bsz * k, 1], 0);
            // b: one [k, n] matrix broadcast over the batch (stride 0).
            let (b1, b1v) = rand_tensor(&mut rng, &[k, n], dt);
            let b = b1.broadcast_to(&[bsz, k, n])?;
            let b_log = strided(&b1v, &[bsz, k, n], &[0, n, 1], 0);
            let (want, scale, _) = ref_matmul(&a_log, &[bsz, m, k], &b_log, &[bsz, k, n]);
            assert_close_scaled(&a.matmul(&b)?.to_f64_vec()?, &want, &scale, tol(dt), &format!("permuted a, broadcast b {what}"));
            // b: base [bsz + 1, n, k], narrowed on the batch and transposed on the matrix dims.
            let (bbase, bbv) = rand_tensor(&mut rng, &[bsz + 1, n, k], dt);
            let b = bbase.narrow(0, 1, bsz)?.transpose(1, 2)?;
            let b_log = strided(&bbv, &[bsz, k, n], &[n * k, 1, k], n * k);
            let (want, scale, _) = ref_matmul(&a_log, &[bsz, m, k], &b_log, &[bsz, k, n]);
            assert_close_scaled(&a.matmul(&b)?.to_f64_vec()?, &want, &scale, tol(dt), &format!("permuted a, narrowed bT {what}"));
            // Batch-transposed 4-D: a [2, bsz, m, k] from base [bsz, 2, m, k].
            let (a4, a4v) = rand_tensor(&mut rng, &[bsz, 2, m, k], dt);
            let a = a4.transpose(0, 1)?;
            let a_log = strided(&a4v, &[2, bsz, m, k], &[m * k, 2 * m * k, k, 1], 0);
            let (b4, b4v) = rand_tensor(&mut rng, &[bsz, k, n], dt);
            let (want, scale, _) = ref_matmul(&a_log, &[2, bsz, m, k], &b4v, &[bsz, k, n]);
            let c = a.matmul(&b4)?;
            assert_eq!(c.dims(), &[2, bsz, m, n]);
            assert_close_scaled(&c.to_f64_vec()?, &want, &scale, tol(dt), &format!("4-D transposed batch {what}"));
        }
    }
    Ok(())
}

#[test]
fn pending_and_shared_inputs() -> voltaic::Result<()> {
    let mut rng = Rng::new(13);
    let (x, xv) = rand_tensor(&mut rng, &[5, 7], DType::F32);
    // a = 2x + 1 (a fused elementwise result), c = a @ a^T.
    let a = x.mul(2.0)?.add(1.0)?;
    let av: Vec<f64> = xv.iter().map(|v| 2.0 * v + 1.0).collect();
    let at = strided(&av, &[7, 5], &[1, 7], 0);
    let (want, scale, _) = ref_matmul(&av, &[5, 7], &at, &[7, 5]);
    let c = a.matmul(&a.t()?)?;
    assert_close_scaled(&c.to_f64_vec()?, &want, &scale, 1e-5, "a @ a.T with pending a");
    // And the product feeds further ops.
    let d = c.sum(&[-1], false)?;
    let want_d: Vec<f64> = (0..5).map(|i| want[i * 5..(i + 1) * 5].iter().sum()).collect();
    let scale_d: Vec<f64> = (0..5).map(|i| scale[i * 5..(i + 1) * 5].iter().sum()).collect();
    assert_close_scaled(&d.to_f64_vec()?, &want_d, &scale_d, 1e-5, "row sums of the product");
    Ok(())
}

#[test]
fn exact_values_in_i32() -> voltaic::Result<()> {
    // [[1, 2, 3], [4, 5, 6]] @ [[7, 8], [9, 10], [11, 12]] = [[58, 64], [139, 154]]
    let a = Tensor::from_vec(vec![1i32, 2, 3, 4, 5, 6], &[2, 3], Device::Cpu)?;
    let b = Tensor::from_vec(vec![7i32, 8, 9, 10, 11, 12], &[3, 2], Device::Cpu)?;
    assert_eq!(a.matmul(&b)?.to_vec::<i32>()?, vec![58, 64, 139, 154]);
    Ok(())
}

#[test]
fn errors_name_the_op_and_shapes() -> voltaic::Result<()> {
    let a = Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?;
    let b = Tensor::ones(&[4, 5], DType::F32, Device::Cpu)?;
    let e = a.matmul(&b).unwrap_err();
    assert!(e.is_shape());
    assert_eq!(e.to_string(), "matmul: cannot multiply [2, 3] by [4, 5]: inner dimensions 3 and 4 differ");

    let v = Tensor::ones(&[4], DType::F32, Device::Cpu)?;
    assert_err_mentions(a.matmul(&v), &["matmul", "[2, 3]", "[4]"]);
    assert_err_mentions(v.matmul(&a), &["matmul", "[4]", "[2, 3]"]);
    let s = Tensor::ones(&[], DType::F32, Device::Cpu)?;
    assert_err_mentions(s.matmul(&a), &["matmul", "[]", "[2, 3]"]);
    assert_err_mentions(a.matmul(&s), &["matmul"]);
    // Batch dims that do not broadcast.
    let x = Tensor::ones(&[2, 3, 4], DType::F32, Device::Cpu)?;
    let y = Tensor::ones(&[3, 4, 5], DType::F32, Device::Cpu)?;
    assert_err_mentions(x.matmul(&y), &["matmul", "[2]", "[3]"]);
    // Bool operands.
    let bl = Tensor::ones(&[3, 3], DType::Bool, Device::Cpu)?;
    assert_err_mentions(bl.matmul(&bl), &["matmul", "bool"]);
    Ok(())
}

#[test]
fn bias_and_activation_fused_after_batched_products() -> voltaic::Result<()> {
    // The CPU applies a product's epilogue to each batch's block as gemm
    // writes it (batches over tasks), or over the whole product after gemm's
    // own threads (one large product), or to zeros (empty inner dim): each
    // against `relu(a @ b + bias) * 2` in f64, the bias broadcast per row.
    let mut rng = Rng::new(21);
    for (ad, bd) in [
        (vec![6, 5, 7], vec![6, 7, 9]),
        (vec![3, 33, 17], vec![17, 65]),
        (vec![1, 70, 60], vec![60, 80]),
        (vec![4, 3, 0], vec![4, 0, 5]),
    ] {
        let (a, av) = rand_tensor(&mut rng, &ad, DType::F32);
        let (b, bv) = rand_tensor(&mut rng, &bd, DType::F32);
        let m = ad[ad.len() - 2];
        let (bias, biasv) = rand_tensor(&mut rng, &[m, 1], DType::F32);
        let got = a.matmul(&b)?.add(&bias)?.relu()?.mul(2.0)?;
        let (prod, scale, dims) = ref_matmul(&av, &ad, &bv, &bd);
        let n = dims[dims.len() - 1];
        let want: Vec<f64> = prod.iter().enumerate().map(|(i, p)| 2.0 * (p + biasv[(i / n) % m]).max(0.0)).collect();
        let scale: Vec<f64> = scale.iter().map(|s| 2.0 * (s + 1.0)).collect();
        assert_eq!(got.dims(), dims.as_slice(), "{ad:?} @ {bd:?}");
        assert_close_scaled(&got.to_f64_vec()?, &want, &scale, tol(DType::F32), &format!("relu({ad:?} @ {bd:?} + bias) * 2"));
    }
    Ok(())
}

#[test]
fn long_inner_dims_split_over_threads_with_the_epilogue_after() -> voltaic::Result<()> {
    // A small output over a long inner dim (a weight gradient with its batch
    // folded into k) is multiplied as partial products over slices of k,
    // then added: against f64, with a transposed operand, an inner dim that
    // does not divide by the thread count, f16, and an epilogue. The
    // partials are column-major where that is cheaper (both operands
    // contiguous along k and fewer rows than columns), else row-major.
    let mut rng = Rng::new(22);
    for (m, k, n, dt, b_transposed) in
        [(16, 16411, 24, DType::F32, true), (9, 20000, 32, DType::F32, true), (16, 16400, 16, DType::F16, true), (30, 16411, 7, DType::F32, true), (7, 16411, 30, DType::F32, false)]
    {
        let (a, av) = rand_tensor(&mut rng, &[m, k], dt);
        let (b, bv) = if b_transposed {
            let (bt, btv) = rand_tensor(&mut rng, &[n, k], dt);
            (bt.t()?, (0..k * n).map(|i| btv[(i % n) * k + i / n]).collect())
        } else {
            rand_tensor(&mut rng, &[k, n], dt)
        };
        let (prod, scale, dims) = ref_matmul(&av, &[m, k], &bv, &[k, n]);
        let got = a.matmul(&b)?;
        assert_eq!(got.dims(), dims.as_slice());
        assert_close_scaled(&got.to_f64_vec()?, &prod, &scale, tol(dt), &format!("[{m}, {k}] @ [{k}, {n}] {dt}"));
        if dt == DType::F32 {
            let got = a.matmul(&b)?.relu()?;
            let want: Vec<f64> = prod.iter().map(|p| p.max(0.0)).collect();
            assert_close_scaled(&got.to_f64_vec()?, &want, &scale, tol(dt), &format!("relu([{m}, {k}] @ [{k}, {n}])"));
        }
    }
    Ok(())
}
