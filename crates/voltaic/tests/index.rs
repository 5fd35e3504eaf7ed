//! Index ops and joins against naive references: gather, scatter_add,
//! index_select, masked_fill, embedding, one_hot, cat, stack, split,
//! split_with_sizes, chunk. Out-of-range indices must be errors, never panics.

mod common;
use common::*;
use voltaic::{DType, Device, Reduction, Tensor};

fn norm(d: isize, r: usize) -> usize {
    if d < 0 {
        (d + r as isize) as usize
    } else {
        d as usize
    }
}

/// Reference gather: out[p] = x[p with p[d] = idx[p]], out shaped like idx.
fn ref_gather(x: &[f64], xd: &[usize], d: usize, idx: &[i64], id: &[usize]) -> Vec<f64> {
    (0..numel(id))
        .map(|i| {
            let mut p = unravel(i, id);
            p[d] = idx[i] as usize;
            x[ravel(&p, xd)]
        })
        .collect()
}

/// Reference scatter_add.
fn ref_scatter_add(x: &[f64], xd: &[usize], d: usize, idx: &[i64], id: &[usize], src: &[f64], sd: &[usize]) -> Vec<f64> {
    let mut out = x.to_vec();
    for (i, &ix) in idx.iter().enumerate().take(numel(id)) {
        let mut p = unravel(i, id);
        let s = src[ravel(&p, sd)];
        p[d] = ix as usize;
        out[ravel(&p, xd)] += s;
    }
    out
}

fn rand_index(rng: &mut Rng, n: usize, size: usize) -> Vec<i64> {
    (0..n).map(|_| rng.below(size) as i64).collect()
}

#[test]
fn gather_along_every_dim() -> voltaic::Result<()> {
    let mut rng = Rng::new(1);
    let shapes: &[&[usize]] = &[&[5], &[3, 4], &[2, 3, 5], &[1, 7, 3], &[3, 1, 2, 4]];
    for xd in shapes {
        let r = xd.len();
        for dim in -(r as isize)..r as isize {
            let d = norm(dim, r);
            for dt in [DType::F32, DType::F64, DType::I32] {
                let (x, xv) = rand_tensor(&mut rng, xd, dt);
                // Index: any size along d (incl. 0 and larger than the input), at most the input elsewhere.
                let mut id: Vec<usize> = xd.iter().map(|&s| 1 + rng.below(s)).collect();
                id[d] = rng.below(2 * xd[d] + 2);
                let iv = rand_index(&mut rng, numel(&id), xd[d]);
                let out = x.gather(dim, &idx_tensor(&iv, &id))?;
                assert_eq!(out.dims(), id.as_slice());
                assert_eq!(out.dtype(), dt);
                assert_eq!(out.to_f64_vec()?, ref_gather(&xv, xd, d, &iv, &id), "gather {xd:?} dim {dim} index {id:?} {dt}");
            }
        }
    }
    Ok(())
}

#[test]
fn gather_with_strided_input_and_index_and_u32() -> voltaic::Result<()> {
    let mut rng = Rng::new(2);
    // x = base.t(), base [5, 3]: x is [3, 5] with strides [1, 3].
    let (base, bv) = rand_tensor(&mut rng, &[5, 3], DType::F32);
    let x = base.t()?;
    let xv = strided(&bv, &[3, 5], &[1, 3], 0);
    // Index [4, 3] stored, transposed to [3, 4].
    let iv_base = rand_index(&mut rng, 12, 5);
    let idx = idx_tensor(&iv_base, &[4, 3]).t()?;
    let iv: Vec<i64> = strided(&iv_base.iter().map(|&v| v as f64).collect::<Vec<_>>(), &[3, 4], &[1, 3], 0)
        .iter()
        .map(|&v| v as i64)
        .collect();
    let out = x.gather(1, &idx)?;
    assert_eq!(out.to_f64_vec()?, ref_gather(&xv, &[3, 5], 1, &iv, &[3, 4]));
    // u32 indices.
    let idx_u = Tensor::from_vec(iv.iter().map(|&v| v as u32).collect::<Vec<u32>>(), &[3, 4], Device::Cpu)?;
    assert_eq!(x.gather(-1, &idx_u)?.to_f64_vec()?, ref_gather(&xv, &[3, 5], 1, &iv, &[3, 4]));
    // Pending input (x * 3).
    let out = x.mul(3.0)?.gather(1, &idx)?;
    let x3: Vec<f64> = xv.iter().map(|v| ((*v as f32) * 3.0) as f64).collect();
    assert_eq!(out.to_f64_vec()?, ref_gather(&x3, &[3, 5], 1, &iv, &[3, 4]));
    // PyTorch's example: gather([[1, 2], [3, 4]], 1, [[0, 0], [1, 0]]) = [[1, 1], [4, 3]].
    let t = Tensor::from_vec(vec![1f32, 2., 3., 4.], &[2, 2], Device::Cpu)?;
    assert_eq!(t.gather(1, &idx_tensor(&[0, 0, 1, 0], &[2, 2]))?.to_vec::<f32>()?, vec![1., 1., 4., 3.]);
    Ok(())
}

#[test]
fn scatter_add_with_repeated_indices() -> voltaic::Result<()> {
    let mut rng = Rng::new(3);
    let shapes: &[&[usize]] = &[&[6], &[3, 4], &[2, 3, 5], &[4, 1, 3]];
    for xd in shapes {
        let r = xd.len();
        for dim in -(r as isize)..r as isize {
            let d = norm(dim, r);
            for dt in [DType::F32, DType::F64, DType::I32] {
                let (x, xv) = rand_tensor(&mut rng, xd, dt);
                // src may be larger than the index everywhere; the index along d may be longer than the input.
                let mut id: Vec<usize> = xd.iter().map(|&s| 1 + rng.below(s)).collect();
                id[d] = 1 + rng.below(2 * xd[d] + 1);
                let sd: Vec<usize> = id.iter().map(|&s| s + rng.below(2)).collect();
                // Few distinct values, so indices repeat.
                let iv = rand_index(&mut rng, numel(&id), xd[d].min(2));
                let (src, sv) = rand_tensor(&mut rng, &sd, dt);
                let out = x.scatter_add(dim, &idx_tensor(&iv, &id), &src)?;
                assert_eq!(out.dims(), *xd);
                let want = ref_scatter_add(&xv, xd, d, &iv, &id, &sv, &sd);
                let tol = if dt == DType::F32 { 1e-6 } else { 0.0 };
                assert_close(&out.to_f64_vec()?, &want, tol, tol, &format!("scatter_add {xd:?} dim {dim} {id:?} src {sd:?} {dt}"));
            }
        }
    }
    // All into one slot: 1 + 2 + 3 + 4 added at position 2.
    let z = Tensor::zeros(&[4], DType::F32, Device::Cpu)?;
    let src = Tensor::from_vec(vec![1f32, 2., 3., 4.], &[4], Device::Cpu)?;
    let out = z.scatter_add(0, &idx_tensor(&[2, 2, 2, 2], &[4]), &src)?;
    assert_eq!(out.to_vec::<f32>()?, vec![0., 0., 10., 0.]);
    // Broadcast (stride 0) input and transposed src.
    let base = Tensor::from_vec(vec![1f64, 2., 3.], &[3, 1], Device::Cpu)?.broadcast_to(&[3, 2])?;
    let s = Tensor::from_vec(vec![10f64, 20., 30., 40., 50., 60.], &[2, 3], Device::Cpu)?.t()?;
    // s logical = [[10, 40], [20, 50], [30, 60]]; index along dim 1.
    let out = base.scatter_add(1, &idx_tensor(&[1, 1, 0, 1, 0, 0], &[3, 2]), &s)?;
    assert_eq!(out.to_vec::<f64>()?, vec![1., 1. + 10. + 40., 2. + 20., 2. + 50., 3. + 30. + 60., 3.]);
    // A mixed-dtype src is cast to the input's dtype.
    let out = Tensor::zeros(&[2], DType::F64, Device::Cpu)?.scatter_add(0, &idx_tensor(&[1, 1], &[2]), &Tensor::from_vec(vec![1i32, 2], &[2], Device::Cpu)?)?;
    assert_eq!(out.dtype(), DType::F64);
    assert_eq!(out.to_vec::<f64>()?, vec![0., 3.]);
    Ok(())
}

#[test]
fn index_select_along_every_dim() -> voltaic::Result<()> {
    let mut rng = Rng::new(4);
    let shapes: &[&[usize]] = &[&[5], &[3, 4], &[2, 3, 5], &[1, 7, 3]];
    for xd in shapes {
        let r = xd.len();
        for dim in -(r as isize)..r as isize {
            let d = norm(dim, r);
            for len in [0, 1, 3, 9] {
                let (x, xv) = rand_tensor(&mut rng, xd, DType::F32);
                let iv = rand_index(&mut rng, len, xd[d]);
                let out = x.index_select(dim, &idx_tensor(&iv, &[len]))?;
                let mut od = xd.to_vec();
                od[d] = len;
                assert_eq!(out.dims(), od.as_slice());
                let want: Vec<f64> = (0..numel(&od))
                    .map(|i| {
                        let mut p = unravel(i, &od);
                        p[d] = iv[p[d]] as usize;
                        xv[ravel(&p, xd)]
                    })
                    .collect();
                assert_eq!(out.to_f64_vec()?, want, "index_select {xd:?} dim {dim} {iv:?}");
            }
        }
    }
    // Non-contiguous input: columns of a transposed matrix.
    let m = Tensor::from_vec((0..12).map(|v| v as f64).collect(), &[3, 4], Device::Cpu)?.t()?; // [4, 3]
    let out = m.index_select(0, &idx_tensor(&[3, 0, 3], &[3]))?;
    // m[r][c] = c * 4 + r
    assert_eq!(out.to_vec::<f64>()?, vec![3., 7., 11., 0., 4., 8., 3., 7., 11.]);
    Ok(())
}

#[test]
fn masked_fill_values() -> voltaic::Result<()> {
    let mut rng = Rng::new(5);
    let (x, xv) = rand_tensor(&mut rng, &[3, 4, 5], DType::F32);
    // Same-shape mask.
    let mv: Vec<f64> = rng.ints(60, 0, 2);
    let (mask, _) = tensor(&mv, &[3, 4, 5], DType::Bool);
    let out = x.masked_fill(&mask, -7.5)?;
    let want: Vec<f64> = xv.iter().zip(&mv).map(|(&v, &m)| if m != 0.0 { -7.5 } else { v }).collect();
    assert_eq!(out.dtype(), DType::F32);
    assert_eq!(out.to_f64_vec()?, want);
    // Broadcast mask [4, 1].
    let mv: Vec<f64> = vec![1., 0., 0., 1.];
    let (mask, _) = tensor(&mv, &[4, 1], DType::Bool);
    let out = x.masked_fill(&mask, f64::NEG_INFINITY)?;
    let want: Vec<f64> = (0..60).map(|i| if mv[unravel(i, &[3, 4, 5])[1]] != 0.0 { f64::NEG_INFINITY } else { xv[i] }).collect();
    assert_eq!(out.to_f64_vec()?, want);
    // i32 tensor with an integer fill; the dtype stays i32.
    let (xi, xiv) = rand_tensor(&mut rng, &[2, 3], DType::I32);
    let mask = Tensor::from_vec(vec![true, false, true], &[3], Device::Cpu)?;
    let out = xi.masked_fill(&mask, 42)?;
    assert_eq!(out.dtype(), DType::I32);
    let want: Vec<f64> = (0..6).map(|i| if i % 3 != 1 { 42.0 } else { xiv[i] }).collect();
    assert_eq!(out.to_f64_vec()?, want);
    // Errors: a mask that would grow the tensor, and a non-bool mask.
    let big = Tensor::ones(&[2, 3, 4, 5], DType::Bool, Device::Cpu)?;
    assert_err_mentions(x.masked_fill(&big, 0.0), &["masked_fill", "[2, 3, 4, 5]", "[3, 4, 5]"]);
    assert_err_mentions(x.masked_fill(&x, 0.0), &["masked_fill", "bool"]);
    Ok(())
}

#[test]
fn embedding_lookup() -> voltaic::Result<()> {
    let mut rng = Rng::new(6);
    let (w, wv) = rand_tensor(&mut rng, &[7, 3], DType::F32);
    for id in [vec![0usize], vec![4], vec![2, 3], vec![2, 0, 3], vec![1, 1, 1, 5]] {
        let iv = rand_index(&mut rng, numel(&id), 7);
        let out = w.embedding(&idx_tensor(&iv, &id))?;
        let mut od = id.clone();
        od.push(3);
        assert_eq!(out.dims(), od.as_slice());
        let want: Vec<f64> = iv.iter().flat_map(|&r| wv[r as usize * 3..r as usize * 3 + 3].to_vec()).collect();
        assert_eq!(out.to_f64_vec()?, want, "embedding {id:?}");
    }
    // 0-d index gives one row.
    let out = w.embedding(&Tensor::scalar(6i32, Device::Cpu)?)?;
    assert_eq!(out.dims(), &[3]);
    assert_eq!(out.to_f64_vec()?, wv[18..21].to_vec());
    // Transposed table.
    let wt = Tensor::from_vec((0..12).map(|v| v as f32).collect(), &[3, 4], Device::Cpu)?.t()?; // [4, 3]; wt[r][c] = c*4 + r
    let out = wt.embedding(&idx_tensor(&[3, 1], &[2]))?;
    assert_eq!(out.to_vec::<f32>()?, vec![3., 7., 11., 1., 5., 9.]);
    // Out of range.
    assert!(w.embedding(&idx_tensor(&[7], &[1])).and_then(|t| t.to_f64_vec()).is_err());
    assert!(w.embedding(&idx_tensor(&[-1], &[1])).and_then(|t| t.to_f64_vec()).is_err());
    assert_err_mentions(wv_tensor_3d()?.embedding(&idx_tensor(&[0], &[1])), &["embedding", "[2, 2, 2]"]);
    Ok(())
}

fn wv_tensor_3d() -> voltaic::Result<Tensor> {
    Tensor::zeros(&[2, 2, 2], DType::F32, Device::Cpu)
}

#[test]
fn one_hot_values() -> voltaic::Result<()> {
    let mut rng = Rng::new(7);
    for (id, c) in [(vec![5usize], 4usize), (vec![2, 3], 7), (vec![0], 3), (vec![], 5), (vec![3, 1], 1)] {
        let iv = rand_index(&mut rng, numel(&id), c);
        let out = idx_tensor(&iv, &id).one_hot(c)?;
        let mut od = id.clone();
        od.push(c);
        assert_eq!(out.dims(), od.as_slice());
        assert_eq!(out.dtype(), DType::I32);
        let want: Vec<f64> = (0..numel(&od)).map(|i| (iv[i / c] == (i % c) as i64) as u8 as f64).collect();
        assert_eq!(out.to_f64_vec()?, want, "one_hot {id:?} {c}");
    }
    // u32 classes.
    let out = Tensor::from_vec(vec![2u32, 0], &[2], Device::Cpu)?.one_hot(3)?;
    assert_eq!(out.to_vec::<i32>()?, vec![0, 0, 1, 1, 0, 0]);
    // Out of range: too big, negative, or no classes at all.
    assert!(idx_tensor(&[0, 4], &[2]).one_hot(4).and_then(|t| t.to_f64_vec()).is_err());
    assert!(idx_tensor(&[-1], &[1]).one_hot(4).and_then(|t| t.to_f64_vec()).is_err());
    assert!(idx_tensor(&[0], &[1]).one_hot(0).and_then(|t| t.to_f64_vec()).is_err());
    assert_err_mentions(Tensor::ones(&[2], DType::F32, Device::Cpu)?.one_hot(3), &["one_hot", "f32"]);
    Ok(())
}

#[test]
fn out_of_range_indices_are_errors() -> voltaic::Result<()> {
    let x = Tensor::from_vec((0..12).map(|v| v as f32).collect(), &[3, 4], Device::Cpu)?;
    for bad in [-1i64, 4, 100, i32::MIN as i64, i32::MAX as i64] {
        let idx = idx_tensor(&[0, bad, 1], &[1, 3]);
        let e = x.gather(1, &idx).and_then(|t| t.to_f64_vec()).unwrap_err();
        assert!(e.to_string().contains("gather"), "{e}");
        assert!(e.to_string().contains(&bad.to_string()), "{e}");
        let src = Tensor::ones(&[1, 3], DType::F32, Device::Cpu)?;
        let e = x.scatter_add(1, &idx, &src).and_then(|t| t.to_f64_vec()).unwrap_err();
        assert!(e.to_string().contains("scatter_add"), "{e}");
        let e = x.index_select(1, &idx_tensor(&[0, bad], &[2])).and_then(|t| t.to_f64_vec()).unwrap_err();
        assert!(e.to_string().contains("index_select"), "{e}");
        // Along dim 0 (size 3) too.
        let bad0 = if bad == 4 { 3 } else { bad };
        assert!(x.index_select(0, &idx_tensor(&[bad0], &[1])).and_then(|t| t.to_f64_vec()).is_err());
        assert!(x.gather(0, &idx_tensor(&[bad0], &[1, 1])).and_then(|t| t.to_f64_vec()).is_err());
    }
    // u32 indices beyond i32 range.
    let big = Tensor::from_vec(vec![u32::MAX], &[1, 1], Device::Cpu)?;
    assert!(x.gather(1, &big).and_then(|t| t.to_f64_vec()).is_err());
    assert!(x.index_select(0, &big.flatten_all()?).and_then(|t| t.to_f64_vec()).is_err());
    // Indexing an empty dim.
    let e = Tensor::zeros(&[3, 0], DType::F32, Device::Cpu)?;
    assert!(e.index_select(1, &idx_tensor(&[0], &[1])).and_then(|t| t.to_f64_vec()).is_err());
    assert!(e.gather(1, &idx_tensor(&[0], &[1, 1])).and_then(|t| t.to_f64_vec()).is_err());
    // An error from a lazily recorded op does not poison the later, valid ones.
    assert_eq!(x.index_select(0, &idx_tensor(&[2], &[1]))?.to_vec::<f32>()?, vec![8., 9., 10., 11.]);
    // Shape and dtype errors are reported at once and name the op.
    assert_err_mentions(x.gather(1, &idx_tensor(&[0], &[1])), &["gather", "[1]", "[3, 4]"]);
    assert_err_mentions(x.gather(1, &idx_tensor(&[0; 5], &[5, 1])), &["gather", "[5, 1]", "[3, 4]"]);
    assert_err_mentions(x.gather(2, &idx_tensor(&[0], &[1, 1])), &["gather", "axis 2"]);
    assert_err_mentions(x.gather(1, &x), &["gather", "f32"]);
    assert_err_mentions(x.index_select(0, &idx_tensor(&[0; 4], &[2, 2])), &["index_select", "[2, 2]"]);
    assert_err_mentions(
        x.scatter_add(0, &idx_tensor(&[0; 4], &[2, 2]), &Tensor::ones(&[1, 2], DType::F32, Device::Cpu)?),
        &["scatter_add", "[2, 2]", "[1, 2]"],
    );
    Ok(())
}

/// Reference cat of logical values along `d`.
fn ref_cat(parts: &[(Vec<f64>, Vec<usize>)], d: usize) -> (Vec<f64>, Vec<usize>) {
    let mut od = parts[0].1.clone();
    od[d] = parts.iter().map(|p| p.1[d]).sum();
    let out = (0..numel(&od))
        .map(|i| {
            let mut p = unravel(i, &od);
            let mut k = 0;
            while p[d] >= parts[k].1[d] {
                p[d] -= parts[k].1[d];
                k += 1;
            }
            parts[k].0[ravel(&p, &parts[k].1)]
        })
        .collect();
    (out, od)
}

#[test]
fn cat_along_several_dims_with_different_sizes() -> voltaic::Result<()> {
    let mut rng = Rng::new(8);
    let shapes: &[&[usize]] = &[&[4], &[3, 5], &[2, 3, 4], &[2, 1, 3, 2]];
    for xd in shapes {
        let r = xd.len();
        for dim in -(r as isize)..r as isize {
            let d = norm(dim, r);
            for nparts in [1, 2, 3, 5] {
                let mut parts = vec![];
                let mut tensors = vec![];
                for _ in 0..nparts {
                    let mut pd = xd.to_vec();
                    pd[d] = rng.below(4); // sizes 0..3 along the dim
                    let (t, v) = rand_tensor(&mut rng, &pd, DType::F32);
                    tensors.push(t);
                    parts.push((v, pd));
                }
                let refs: Vec<&Tensor> = tensors.iter().collect();
                let out = Tensor::cat(&refs, dim)?;
                let (want, od) = ref_cat(&parts, d);
                assert_eq!(out.dims(), od.as_slice());
                assert_eq!(out.to_f64_vec()?, want, "cat {xd:?} dim {dim} parts {:?}", parts.iter().map(|p| &p.1).collect::<Vec<_>>());
            }
        }
    }
    Ok(())
}

#[test]
fn cat_of_non_contiguous_and_mixed_parts() -> voltaic::Result<()> {
    let mut rng = Rng::new(9);
    // Part 1: transposed [4, 3] -> [3, 4].
    let (b1, b1v) = rand_tensor(&mut rng, &[4, 3], DType::F32);
    let p1 = b1.t()?;
    let v1 = strided(&b1v, &[3, 4], &[1, 3], 0);
    // Part 2: step-2 slice of a [3, 5] along dim 1 -> [3, 3]... then narrow to [3, 2].
    let (b2, b2v) = rand_tensor(&mut rng, &[3, 5], DType::F32);
    let p2 = b2.slice(1, 1, 5, 2)?;
    let v2 = strided(&b2v, &[3, 2], &[5, 2], 1);
    // Part 3: a row broadcast to [3, 1].
    let (b3, b3v) = rand_tensor(&mut rng, &[1, 1], DType::F32);
    let p3 = b3.broadcast_to(&[3, 1])?;
    let v3 = vec![b3v[0]; 3];
    // Part 4: pending (exp of something).
    let (b4, b4v) = rand_tensor(&mut rng, &[3, 2], DType::F32);
    let p4 = b4.mul(2.0)?;
    let v4: Vec<f64> = b4v.iter().map(|v| 2.0 * v).collect();
    let out = Tensor::cat(&[&p1, &p2, &p3, &p4], 1)?;
    let (want, od) = ref_cat(&[(v1.clone(), vec![3, 4]), (v2.clone(), vec![3, 2]), (v3, vec![3, 1]), (v4, vec![3, 2])], 1);
    assert_eq!(out.dims(), od.as_slice());
    assert_eq!(out.to_f64_vec()?, want);
    // Along dim 0 with a transposed part and a permuted 3-D tensor reshaped.
    let out = Tensor::cat(&[&p1.t()?, &b1], 0)?; // [4, 3] + [4, 3]
    let (want, _) = ref_cat(&[(b1v.clone(), vec![4, 3]), (b1v.clone(), vec![4, 3])], 0);
    assert_eq!(out.to_f64_vec()?, want);
    // A part narrowed from the middle of a larger buffer along the cat dim's neighbour.
    let (b5, b5v) = rand_tensor(&mut rng, &[5, 4], DType::F32);
    let p5 = b5.narrow(0, 2, 3)?; // rows 2..5
    let v5 = b5v[8..20].to_vec();
    let out = Tensor::cat(&[&p5, &p1], 1)?;
    let (want, _) = ref_cat(&[(v5, vec![3, 4]), (v1, vec![3, 4])], 1);
    assert_eq!(out.to_f64_vec()?, want);
    // Mixed dtypes promote: i32 and f64 -> f64.
    let a = Tensor::from_vec(vec![1i32, 2], &[2], Device::Cpu)?;
    let b = Tensor::from_vec(vec![0.5f64], &[1], Device::Cpu)?;
    let out = Tensor::cat(&[&a, &b], 0)?;
    assert_eq!(out.dtype(), DType::F64);
    assert_eq!(out.to_vec::<f64>()?, vec![1., 2., 0.5]);
    // Errors.
    let x = Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?;
    let y = Tensor::ones(&[2, 4], DType::F32, Device::Cpu)?;
    assert_err_mentions(Tensor::cat(&[&x, &y], 0), &["cat", "[2, 3]", "[2, 4]"]);
    assert_err_mentions(Tensor::cat(&[&x, &Tensor::ones(&[6], DType::F32, Device::Cpu)?], 0), &["cat", "[6]"]);
    assert_err_mentions(Tensor::cat(&[&x, &y], 2), &["cat"]);
    assert_err_mentions(Tensor::cat(&[], 0), &["cat"]);
    let s = Tensor::scalar(1f32, Device::Cpu)?;
    assert_err_mentions(Tensor::cat(&[&s, &s], 0), &["cat"]);
    Ok(())
}

#[test]
fn stack_along_every_dim() -> voltaic::Result<()> {
    let mut rng = Rng::new(10);
    let shapes: &[&[usize]] = &[&[], &[3], &[2, 3], &[2, 0, 3]];
    for xd in shapes {
        let r = xd.len() + 1;
        for dim in -(r as isize)..r as isize {
            let d = norm(dim, r);
            for n in [1, 2, 3] {
                let parts: Vec<(Tensor, Vec<f64>)> = (0..n).map(|_| rand_tensor(&mut rng, xd, DType::F64)).collect();
                let refs: Vec<&Tensor> = parts.iter().map(|p| &p.0).collect();
                let out = Tensor::stack(&refs, dim)?;
                let mut od = xd.to_vec();
                od.insert(d, n);
                assert_eq!(out.dims(), od.as_slice());
                let want: Vec<f64> = (0..numel(&od))
                    .map(|i| {
                        let mut p = unravel(i, &od);
                        let k = p.remove(d);
                        parts[k].1[ravel(&p, xd)]
                    })
                    .collect();
                assert_eq!(out.to_f64_vec()?, want, "stack {xd:?} dim {dim} n {n}");
            }
        }
    }
    let x = Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?;
    let y = Tensor::ones(&[3, 2], DType::F32, Device::Cpu)?;
    assert_err_mentions(Tensor::stack(&[&x, &y], 0), &["stack", "[2, 3]", "[3, 2]"]);
    assert_err_mentions(Tensor::stack(&[&x, &x], 3), &["stack"]);
    assert_err_mentions(Tensor::stack(&[], 0), &["stack"]);
    Ok(())
}

/// Values of x narrowed to `start..start+len` along `d`.
fn ref_narrow(xv: &[f64], xd: &[usize], d: usize, start: usize, len: usize) -> Vec<f64> {
    let mut od = xd.to_vec();
    od[d] = len;
    (0..numel(&od))
        .map(|i| {
            let mut p = unravel(i, &od);
            p[d] += start;
            xv[ravel(&p, xd)]
        })
        .collect()
}

fn check_pieces(pieces: &[Tensor], xv: &[f64], xd: &[usize], d: usize, sizes: &[usize]) -> voltaic::Result<()> {
    assert_eq!(pieces.len(), sizes.len(), "pieces of {xd:?} along {d}: {:?}", pieces.iter().map(|p| p.dims().to_vec()).collect::<Vec<_>>());
    let mut start = 0;
    for (p, &len) in pieces.iter().zip(sizes) {
        let mut od = xd.to_vec();
        od[d] = len;
        assert_eq!(p.dims(), od.as_slice());
        assert_eq!(p.to_f64_vec()?, ref_narrow(xv, xd, d, start, len));
        start += len;
    }
    assert_eq!(start, xd[d]);
    Ok(())
}

#[test]
fn split_split_with_sizes_and_chunk() -> voltaic::Result<()> {
    let mut rng = Rng::new(11);
    let shapes: &[&[usize]] = &[&[7], &[5, 3], &[2, 6, 3], &[4, 0, 2]];
    for xd in shapes {
        let r = xd.len();
        for dim in -(r as isize)..r as isize {
            let d = norm(dim, r);
            let n = xd[d];
            let (x, xv) = rand_tensor(&mut rng, xd, DType::F32);
            for size in 1..=n + 2 {
                let mut sizes = vec![];
                let mut s = 0;
                while s < n {
                    sizes.push(size.min(n - s));
                    s += size;
                }
                if n == 0 {
                    sizes.push(0);
                }
                check_pieces(&x.split(size, dim)?, &xv, xd, d, &sizes)?;
            }
            // split_with_sizes, including zero-length pieces.
            let mut sizes = vec![];
            let mut left = n;
            while left > 0 {
                let s = rng.below(left + 1);
                sizes.push(s);
                left -= s;
            }
            sizes.push(0);
            check_pieces(&x.split_with_sizes(&sizes, dim)?, &xv, xd, d, &sizes)?;
            assert_err_mentions(x.split_with_sizes(&[n + 1], dim), &["split_with_sizes", &format!("{}", n + 1)]);
            // chunk: PyTorch gives pieces of ceil(n / chunks), the last smaller, possibly fewer pieces.
            for chunks in 1..=n + 2 {
                let size = n.div_ceil(chunks).max(1);
                let mut sizes = vec![];
                let mut s = 0;
                while s < n {
                    sizes.push(size.min(n - s));
                    s += size;
                }
                if n == 0 {
                    // An empty dim gives `chunks` empty pieces, as PyTorch.
                    sizes = vec![0; chunks];
                }
                check_pieces(&x.chunk(chunks, dim)?, &xv, xd, d, &sizes)?;
            }
        }
    }
    // PyTorch examples: arange(6).chunk(4) -> 3 pieces of 2; arange(5).chunk(3) -> [2, 2, 1].
    let a6 = Tensor::arange(0.0, 6.0, 1.0, DType::F32, Device::Cpu)?;
    assert_eq!(a6.chunk(4, 0)?.iter().map(|t| t.dims()[0]).collect::<Vec<_>>(), vec![2, 2, 2]);
    let a5 = Tensor::arange(0.0, 5.0, 1.0, DType::F32, Device::Cpu)?;
    assert_eq!(a5.chunk(3, 0)?.iter().map(|t| t.dims()[0]).collect::<Vec<_>>(), vec![2, 2, 1]);
    // Pieces of a transposed tensor.
    let t = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[2, 3], Device::Cpu)?.t()?; // [3, 2]
    let p = t.split(2, 0)?;
    assert_eq!(p[0].to_vec::<f32>()?, vec![0., 3., 1., 4.]);
    assert_eq!(p[1].to_vec::<f32>()?, vec![2., 5.]);
    // Errors.
    assert_err_mentions(a6.split(0, 0), &["split"]);
    assert_err_mentions(a6.chunk(0, 0), &["chunk"]);
    assert_err_mentions(a6.split(2, 1), &["split", "axis 1"]);
    Ok(())
}

#[test]
fn errors_name_the_op_the_user_called() {
    let cpu = Device::Cpu;
    let table = Tensor::ones(&[4, 3], DType::F32, cpu).unwrap();
    let bad = Tensor::from_vec(vec![1i32, 9], &[2], cpu).unwrap();
    let e = table.embedding(&bad).unwrap().to_vec::<f32>().unwrap_err().to_string();
    assert!(e.starts_with("embedding:") && e.contains('9'), "{e}");
    let e = table.embedding(&Tensor::zeros(&[2], DType::F32, cpu).unwrap()).unwrap_err().to_string();
    assert!(e.starts_with("embedding:") && e.contains("f32"), "{e}");
    let e = bad.one_hot(5).unwrap().to_vec::<i32>().unwrap_err().to_string();
    assert!(e.starts_with("one_hot:"), "{e}");
    let logits = Tensor::zeros(&[2, 5], DType::F32, cpu).unwrap();
    let e = logits.cross_entropy(&bad, 0.0, Reduction::Mean).unwrap().item::<f32>().unwrap_err().to_string();
    assert!(e.starts_with("cross_entropy:") && e.contains('9'), "{e}");
    let e = voltaic::nn::nll_loss(&logits, &bad, Reduction::Mean).unwrap().item::<f32>().unwrap_err().to_string();
    assert!(e.starts_with("nll_loss:"), "{e}");
    let e = Tensor::ones(&[2, 3, 4], DType::F32, cpu).unwrap().matmul(&Tensor::ones(&[5, 4, 2], DType::F32, cpu).unwrap()).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]") && e.contains("[5, 4, 2]"), "{e}");
    let e = Tensor::scalar(1.0f32, cpu).unwrap().argmax(Some(2), false).unwrap_err().to_string();
    assert!(e.contains("0-d") && !e.contains("rank 1"), "{e}");
}
