//! Every public op, thrown random shapes (rank 0-4, dims 0-5), random axes
//! (in and out of range, negative), random index values and random argument
//! values, must return `Ok` or `Err` and never panic; `Ok` results must also
//! realize (and print) to `Ok` or `Err` without panicking.

mod common;
use common::Rng;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Mutex;
use proptest::test_runner::{Config, RngSeed};
use voltaic::primitive::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use voltaic::{Conv2dOpts, DType, Device, Generator, Reduction, Result, Tensor};

const DTYPES: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::U32, DType::Bool];

/// Names the op being called if it panics (the proptest then reports the case).
struct Ctx(&'static str);
impl Drop for Ctx {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("panic inside op `{}`", self.0);
        }
    }
}

/// Per-op counts of (recorded Ok, realized Ok, Err anywhere), kept when
/// `NO_PANIC_STATS` is set and printed by `zz_stats` (to check coverage).
static STATS: Mutex<BTreeMap<&'static str, [usize; 3]>> = Mutex::new(BTreeMap::new());

fn count(name: &'static str, k: usize) {
    if std::env::var_os("NO_PANIC_STATS").is_some() {
        STATS.lock().unwrap_or_else(|e| e.into_inner()).entry(name).or_default()[k] += 1;
    }
}

/// Realize an op's result: every outcome but a panic is fine.
trait Outcome {
    fn settle(self, name: &'static str);
}
fn settle_tensor(t: &Tensor, name: &'static str) {
    match t.to_f64_vec() {
        Ok(v) => {
            assert_eq!(v.len(), t.numel(), "realized {} values for shape {:?}", v.len(), t.dims());
            let _ = format!("{t}");
            let _ = format!("{t:?}");
            count(name, 1);
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
            count(name, 2);
        }
    }
}
impl Outcome for Result<Tensor> {
    fn settle(self, name: &'static str) {
        match self {
            Ok(t) => {
                count(name, 0);
                settle_tensor(&t, name)
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                count(name, 2);
            }
        }
    }
}
impl Outcome for Result<Vec<Tensor>> {
    fn settle(self, name: &'static str) {
        match self {
            Ok(ts) => {
                count(name, 0);
                ts.iter().for_each(|t| settle_tensor(t, name))
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                count(name, 2);
            }
        }
    }
}

/// Run `f` (a closure, so that an op's expression can use `?`).
fn call<T>(f: impl FnOnce() -> T) -> T {
    f()
}

macro_rules! op {
    ($name:expr, $e:expr) => {{
        let _ctx = Ctx($name);
        // In a closure, so that `$e` may use `?`.
        let r = call(|| $e);
        Outcome::settle(r, $name);
    }};
}

#[derive(Debug, Clone)]
struct Case {
    shapes: [Vec<usize>; 3],
    dtypes: [usize; 3],
    kinds: [u8; 3],
    axes: Vec<isize>,
    ax: [isize; 3],
    isz: Vec<isize>,
    us: [usize; 6],
    fl: [f64; 3],
    flags: [bool; 3],
    seed: u64,
}

fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..=5, 0..=4)
}
fn axis() -> impl Strategy<Value = isize> {
    prop_oneof![12 => -6isize..6, 1 => Just(isize::MIN), 1 => Just(isize::MAX)]
}
/// Small sizes mostly; a few that overflow anything they touch. (Nothing huge
/// that would merely be slow or allocate: that would not be a bug.)
fn usz() -> impl Strategy<Value = usize> {
    prop_oneof![10 => 0usize..8, 1 => Just(usize::MAX), 1 => Just(usize::MAX / 2), 1 => Just(usize::MAX / 3)]
}
fn flt() -> impl Strategy<Value = f64> {
    prop::sample::select(vec![0.0, 0.5, 1.0, -1.0, 2.0, 1e-5, 0.1, 0.999, 1.5, -0.1, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 3.0, -2.5])
}

fn case() -> impl Strategy<Value = Case> {
    (
        [shape(), shape(), shape()],
        [0usize..7, 0usize..7, 0usize..7],
        [0u8..8, 0u8..8, 0u8..8],
        prop::collection::vec(axis(), 0..=4),
        [axis(), axis(), axis()],
        prop::collection::vec(prop_oneof![10 => -2isize..7, 1 => Just(isize::MAX), 1 => Just(isize::MIN), 1 => Just(isize::MAX / 2)], 0..=5),
        [usz(), usz(), usz(), usz(), usz(), usz()],
        [flt(), flt(), flt()],
        [any::<bool>(), any::<bool>(), any::<bool>()],
        any::<u64>(),
    )
        .prop_map(|(shapes, dtypes, kinds, axes, ax, isz, us, fl, flags, seed)| Case { shapes, dtypes, kinds, axes, ax, isz, us, fl, flags, seed })
}

/// Random values for a dtype, with some NaN / infinities among floats.
fn values(rng: &mut Rng, n: usize, dt: DType) -> Vec<f64> {
    (0..n)
        .map(|_| match dt {
            DType::I32 => rng.below(11) as f64 - 3.0,
            DType::U32 => rng.below(8) as f64,
            DType::Bool => rng.below(2) as f64,
            _ => match rng.below(40) {
                0 => f64::NAN,
                1 => f64::INFINITY,
                2 => f64::NEG_INFINITY,
                3 => 0.0,
                _ => 2.0 * rng.normal(),
            },
        })
        .collect()
}

/// A tensor of shape `dims` built one of several ways: contiguous, transposed
/// view, broadcast view, constant, pending node, strided slice, views of pending nodes.
fn make(rng: &mut Rng, dims: &[usize], dt: DType, kind: u8) -> Result<Tensor> {
    let r = dims.len();
    match kind {
        1 if r >= 2 => {
            let mut d = dims.to_vec();
            d.swap(r - 2, r - 1);
            let (t, _) = common::tensor(&values(rng, common::numel(&d), dt), &d, dt);
            t.transpose(-2, -1)
        }
        2 if r >= 1 => {
            let d: Vec<usize> = dims.iter().map(|&s| if rng.below(2) == 0 { 1 } else { s }).collect();
            let (t, _) = common::tensor(&values(rng, common::numel(&d), dt), &d, dt);
            t.broadcast_to(dims)
        }
        3 => Tensor::full(dims, values(rng, 1, dt)[0], dt, Device::Cpu),
        4 => {
            let (t, _) = common::tensor(&values(rng, common::numel(dims), dt), dims, dt);
            t.eq(&t)?.where_cond(&t, &t)
        }
        5 if r >= 1 => {
            let mut d = dims.to_vec();
            d[0] *= 2;
            let (t, _) = common::tensor(&values(rng, common::numel(&d), dt), &d, dt);
            t.slice(0, 1, d[0] as isize + 1, 2)
        }
        // Views of pending nodes: reversed dims, or every other row from offset 1.
        6 if r >= 2 => {
            let d: Vec<usize> = dims.iter().rev().copied().collect();
            let p: Vec<isize> = (0..r as isize).rev().collect();
            make(rng, &d, dt, 4)?.permute(&p)
        }
        7 if r >= 1 => {
            let mut d = dims.to_vec();
            d[0] = 2 * d[0] + 1;
            make(rng, &d, dt, 4)?.slice(0, 1, d[0] as isize, 2)
        }
        _ => Ok(common::tensor(&values(rng, common::numel(dims), dt), dims, dt).0),
    }
}

/// An index tensor: i32 mostly, sometimes u32 or (wrongly) f32; values mostly
/// small, a few out of range either way.
fn index(rng: &mut Rng, dims: &[usize], hi: usize) -> Tensor {
    let n = common::numel(dims);
    let v: Vec<i64> = (0..n)
        .map(|_| match rng.below(30) {
            0 => -1,
            1 => i32::MAX as i64,
            2 => i32::MIN as i64,
            3 => hi as i64,
            _ => rng.below(hi.max(1)) as i64,
        })
        .collect();
    match rng.below(8) {
        0 => Tensor::from_vec(v.iter().map(|&x| x as u32).collect::<Vec<u32>>(), dims, Device::Cpu).unwrap(),
        1 => Tensor::from_vec(v.iter().map(|&x| x as f32).collect::<Vec<f32>>(), dims, Device::Cpu).unwrap(),
        _ => common::idx_tensor(&v, dims),
    }
}

/// A shape that is often "almost right" for `of`: the same, with one dim
/// changed, removed or added, or entirely random.
fn near_shape(rng: &mut Rng, of: &[usize], random: &[usize]) -> Vec<usize> {
    let mut d = of.to_vec();
    match rng.below(5) {
        0 => return random.to_vec(),
        1 if !d.is_empty() => {
            let i = rng.below(d.len());
            d[i] = rng.below(6);
        }
        2 if !d.is_empty() => {
            d.remove(rng.below(d.len()));
        }
        3 => d.insert(rng.below(d.len() + 1), rng.below(4)),
        _ => {}
    }
    d
}

/// Size of dim `d` of `t`, or 3 when `d` is out of range.
fn hi_of(t: &Tensor, d: isize) -> usize {
    let r = t.rank() as isize;
    let d = if d < 0 { d.saturating_add(r) } else { d };
    if d >= 0 && d < r {
        t.dims()[d as usize]
    } else {
        3
    }
}

fn run_case(c: &Case) -> Result<()> {
    let mut rng = Rng::new(c.seed);
    let dts = c.dtypes.map(|i| DTYPES[i]);
    let a = make(&mut rng, &c.shapes[0], dts[0], c.kinds[0])?;
    let b = make(&mut rng, &c.shapes[1], dts[1], c.kinds[1])?;
    let cc = make(&mut rng, &c.shapes[2], dts[2], c.kinds[2])?;
    let (ax, ax2, ax3) = (c.ax[0], c.ax[1], c.ax[2]);
    let [u0, u1, u2, u3, u4, u5] = c.us;
    // An axis that is in range for `a` (when it has any), negative half the time.
    let axr = match a.rank() as isize {
        0 => 0,
        r => ax.rem_euclid(r) - if ax2 < 0 { r } else { 0 },
    };
    let [f0, f1, f2] = c.fl;
    let [keep, train, flag] = c.flags;
    let axes = c.axes.as_slice();
    let isz = c.isz.as_slice();
    let usz_list: Vec<usize> = isz.iter().map(|&v| v.unsigned_abs()).collect();
    // Tensors shaped like `a`, or nearly: more of the ops then get past their shape checks.
    let a_like = make(&mut rng, a.dims(), dts[1], c.kinds[1])?;
    let near = near_shape(&mut rng, a.dims(), &c.shapes[1]);
    let a_near = make(&mut rng, &near, dts[2], c.kinds[2])?;

    // ---- creation and accessors
    op!("full", Tensor::full(&c.shapes[0], f0, dts[1], Device::Cpu));
    op!("zeros", Tensor::zeros(&c.shapes[1], dts[0], Device::Cpu));
    op!("ones", Tensor::ones(&usz_list, dts[0], Device::Cpu));
    op!("arange", Tensor::arange(f0, f1, f2, dts[0], Device::Cpu));
    op!("arange2", Tensor::arange(isz.first().copied().unwrap_or(0).clamp(-9, 9) as f64, u0.min(20) as f64, f1, dts[1], Device::Cpu));
    op!("linspace", Tensor::linspace(f0, f1, u0 % 64, dts[2], Device::Cpu));
    op!("eye", Tensor::eye(u1 % 16, dts[0], Device::Cpu));
    op!("rand", Tensor::rand(&c.shapes[0], dts[0], Device::Cpu));
    op!("randn", Tensor::randn(&c.shapes[1], dts[1], Device::Cpu));
    op!("rand_with", Tensor::rand_with(&mut Generator::new(c.seed), &c.shapes[2], dts[2], Device::Cpu));
    op!("bernoulli", a.bernoulli());
    op!("bernoulli_with", b.bernoulli_with(&mut Generator::new(c.seed)));
    op!("from_vec", Tensor::from_vec(vec![1f32; u0 % 8], &c.shapes[0], Device::Cpu));
    op!("from_vec_gpu", Tensor::from_vec(vec![1f32; common::numel(&c.shapes[0])], &c.shapes[0], Device::Gpu(u0 % 4)));
    op!("full_gpu", Tensor::full(&c.shapes[0], f0, dts[0], Device::Gpu(0)));
    op!("zeros_like", a.zeros_like());
    op!("ones_like", b.ones_like());
    op!("full_like", cc.full_like(f0));
    op!("to_device", a.to_device(Device::Gpu(0)));
    op!("to_vec_f32", a.to_vec::<f32>().map(|_| ()).and(Ok(a.clone())));
    op!("to_vec_i32", a.to_vec::<i32>().map(|_| ()).and(Ok(a.clone())));
    op!("item", a.item::<f32>().map(|_| a.clone()));
    op!("item_f64", a.item_f64().map(|_| a.clone()));
    op!("size", a.size(ax).map(|_| a.clone()));
    op!("realize_all", Tensor::realize_all(&[&a, &b, &cc]).map(|_| a.clone()));
    op!("scalar", Tensor::scalar(f0, Device::Cpu));
    op!("from_slice", Tensor::from_slice(&[1i32, 2, 3, 4][..u0.min(4)], &c.shapes[1], Device::Cpu));
    op!("realize", a.realize().cloned());
    op!("realize_pending", a.add(&a_like)?.realize().cloned());
    let _ = (a.stride(), a.layout(), a.is_contiguous(), a.is_realized(), a.same_storage(&b), a.shape());
    let _ = voltaic::inspect(&[&a, &b]);
    let _ = Device::parse(["cpu", "gpu:3", "cuda:x", "", "gpu:99999999999999999999"][u0 % 5]);

    // ---- elementwise
    for &u in UnaryOp::ALL {
        op!(u.name(), a.unary(u));
    }
    for &bop in BinaryOp::ALL {
        op!(bop.name(), a.binary(bop, &b));
        op!(bop.name(), a.binary(bop, &a));
        op!(bop.name(), a.binary(bop, f0));
        op!(bop.name(), b.binary(bop, isz.first().copied().unwrap_or(3) as i32));
        op!(bop.name(), cc.binary(bop, u0 as u32));
        op!(bop.name(), a.binary(bop, flag));
    }
    for cop in [CmpOp::Eq, CmpOp::Ne, CmpOp::Lt, CmpOp::Le, CmpOp::Gt, CmpOp::Ge] {
        op!(cop.name(), a.compare(cop, &b));
        op!(cop.name(), b.compare(cop, f1));
    }
    op!("std_ops", (&a + &b).and_then(|x| &x - 1.0).and_then(|x| x * &cc).and_then(|x| x / 2).and_then(|x| x % f0));
    op!("neg", -&a);
    op!("where", a.where_cond(&b, &cc));
    op!("where_near", a_near.where_cond(&a, &a_like));
    op!("binary_near", a.add(&a_near));
    op!("where_scalar", cc.where_cond(f0, &a));
    op!("masked_fill", a.masked_fill(&b.ne(0)?, f0));
    op!("masked_fill_nonbool", a.masked_fill(&b, 1));
    op!("to_dtype", a.to_dtype(dts[1]));
    for dt in DTYPES {
        op!("to_dtype_all", b.to_dtype(dt));
    }
    op!("sqr", a.sqr());
    op!("leaky_relu", a.leaky_relu(f0));
    op!("gelu", a.gelu());
    op!("gelu_tanh", b.gelu_tanh());
    op!("silu", cc.silu());
    op!("softplus", a.softplus());
    op!("clamp", a.clamp(Some(f0), Some(f1)));
    op!("clamp_lo", b.clamp(Some(f2), None));
    op!("clamp_hi", cc.clamp(None, Some(f1)));
    op!("clamp_none", cc.clamp(None, None));

    // ---- reductions
    for rop in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax, ReduceOp::ArgMin] {
        op!(rop.name(), a.reduce(rop, axes, keep));
        op!(rop.name(), b.reduce(rop, &[ax], !keep));
        op!(rop.name(), cc.reduce(rop, &[], keep));
    }
    op!("sum", a.sum(axes, keep));
    op!("sum_all", b.sum_all());
    op!("prod", cc.prod(axes, keep));
    op!("max", a.max(&[ax, ax2], keep));
    op!("min", b.min(axes, keep));
    op!("argmax_none", a.argmax(None, keep));
    op!("argmax", a.argmax(Some(ax), keep));
    op!("argmin_none", b.argmin(None, !keep));
    op!("argmin", cc.argmin(Some(ax2), keep));
    op!("mean", a.mean(axes, keep));
    op!("var", a.var(axes, u0, keep));
    op!("std", b.std(&[ax], u1, keep));
    op!("logsumexp", a.logsumexp(axes, keep));
    op!("softmax", a.softmax(ax));
    op!("softmax_r", a.softmax(axr));
    op!("cumsum_r", a.cumsum(axr));
    op!("argmax_r", a.argmax(Some(axr), keep));
    op!("var_r", a.var(&[axr], u0 % 3, keep));
    op!("log_softmax", b.log_softmax(ax2));
    op!("cumsum", a.cumsum(ax));
    op!("cumsum_b", cc.cumsum(ax3));

    // ---- views
    op!("contiguous", a.contiguous());
    op!("reshape", a.reshape(isz));
    op!("reshape_b", b.reshape(&[-1]));
    op!("reshape_dims", a.reshape_dims(&usz_list));
    op!("reshape_dims_b", b.reshape_dims(&c.shapes[2]));
    op!("view_as", a.view_as(&b));
    op!("permute", a.permute(axes));
    op!("permute_full", {
        let mut p: Vec<isize> = (0..a.rank() as isize).collect();
        if !p.is_empty() && flag {
            let i = rng.below(p.len());
            p[i] = p[rng.below(p.len())]; // maybe a repeat
        }
        if keep {
            p.reverse();
        }
        a.permute(&p)
    });
    op!("transpose", a.transpose(ax, ax2));
    op!("t", b.t());
    op!("broadcast_to", a.broadcast_to(&c.shapes[1]));
    op!("broadcast_to_b", b.broadcast_to(&near_shape(&mut rng, b.dims(), &c.shapes[0])));
    op!("expand", a.expand(isz));
    op!("narrow", a.narrow(ax, u0, u1));
    op!("narrow_b", b.narrow(ax2, u2, u3));
    op!("narrow_in_range", {
        let n = hi_of(&a, axr);
        let start = rng.below(n + 1);
        a.narrow(axr, start, rng.below(n - start + 1))
    });
    op!("slice", a.slice(ax, isz.first().copied().unwrap_or(0), isz.get(1).copied().unwrap_or(5), u0));
    op!("slice_b", b.slice(ax2, -(u1 as isize % 7), u2 as isize, u3));
    op!("squeeze", a.squeeze(ax));
    op!("squeeze_all", b.squeeze_all());
    op!("unsqueeze", a.unsqueeze(ax));
    op!("flatten", a.flatten(ax, ax2));
    op!("flatten_all", cc.flatten_all());

    // ---- linalg
    op!("matmul", a.matmul(&b));
    op!("matmul_self_t", a.matmul(&a.t().unwrap_or_else(|_| a.clone())));
    op!("matmul_near", {
        let bd = near_shape(&mut rng, &a.dims().iter().rev().copied().collect::<Vec<_>>(), &c.shapes[1]);
        a.matmul(&make(&mut rng, &bd, dts[1], c.kinds[1])?)
    });

    // ---- joins
    op!("cat", Tensor::cat(&[&a, &b], ax));
    op!("cat_same", Tensor::cat(&[&a, &a, &b], ax2));
    op!("cat_near", {
        let d = near_shape(&mut rng, a.dims(), &c.shapes[2]);
        Tensor::cat(&[&a, &make(&mut rng, &d, dts[2], c.kinds[2])?], ax)
    });
    op!("cat_one", Tensor::cat(&[&cc], ax3));
    op!("cat_like", Tensor::cat(&[&a, &a_like, &a_near], axr));
    op!("cat_near", Tensor::cat(&[&a_near, &a], ax2));
    op!("cat_none", Tensor::cat(&[], ax));
    op!("stack", Tensor::stack(&[&a, &b], ax));
    op!("stack_same", Tensor::stack(&[&a, &a], ax2));
    op!("stack_like", Tensor::stack(&[&a, &a_like], axr));
    op!("stack_near", Tensor::stack(&[&a_like, &a_near], ax));
    op!("stack_none", Tensor::stack(&[], ax));
    op!("split", a.split(u0, ax));
    op!("split_b", b.split(u1, ax2));
    op!("split_with_sizes", a.split_with_sizes(&usz_list, ax));
    op!("split_with_sizes_b", b.split_with_sizes(&[u0, u1], ax2));
    op!("split_with_sizes_fit", {
        let mut left = hi_of(&a, axr);
        let mut sizes = vec![];
        while left > 0 {
            let s = rng.below(left + 1);
            sizes.push(s);
            left -= s;
        }
        if flag {
            sizes.push(0);
        }
        a.split_with_sizes(&sizes, axr)
    });
    op!("chunk", a.chunk(u2, ax));
    op!("chunk_b", cc.chunk(u3, ax3));

    // ---- indexing
    let hi = hi_of;
    // Index shaped like the input but no larger (the kernel then runs).
    let fit = |rng: &mut Rng, t: &Tensor, d: isize| -> Vec<usize> {
        let r = t.rank() as isize;
        let dd = if d < 0 { d + r } else { d };
        t.dims().iter().enumerate().map(|(i, &s)| if i as isize == dd { rng.below(6) } else { rng.below(s + 1) }).collect()
    };
    let idx_fit = {
        let d = fit(&mut rng, &a, ax);
        index(&mut rng, &d, hi(&a, ax))
    };
    let idx_any = index(&mut rng, &c.shapes[2], hi(&a, ax));
    op!("gather", a.gather(ax, &idx_fit));
    op!("gather_r", {
        let d = fit(&mut rng, &a, axr);
        let i = index(&mut rng, &d, hi(&a, axr));
        a.gather(axr, &i)
    });
    op!("gather_any", a.gather(ax, &idx_any));
    op!("gather_b", b.gather(ax2, &idx_fit));
    let sd = if rng.below(3) > 0 {
        idx_fit.dims().iter().map(|&s| s + rng.below(2)).collect()
    } else {
        near_shape(&mut rng, idx_fit.dims(), &c.shapes[1])
    };
    let src = make(&mut rng, &sd, dts[1], c.kinds[1])?;
    op!("scatter_add", a.scatter_add(ax, &idx_fit, &src));
    op!("scatter_add_same", a.scatter_add(ax, &idx_fit, &a));
    op!("scatter_add_r", {
        let d = fit(&mut rng, &a, axr);
        let i = index(&mut rng, &d, hi(&a, axr));
        let sd: Vec<usize> = d.iter().map(|&s| s + rng.below(2)).collect();
        a.scatter_add(axr, &i, &make(&mut rng, &sd, dts[1], c.kinds[1])?)
    });
    op!("scatter_add_any", a.scatter_add(ax2, &idx_any, &b));
    let idx1 = {
        let n = rng.below(6);
        let d = if flag { vec![n] } else { near_shape(&mut rng, &[n], &c.shapes[2]) };
        index(&mut rng, &d, hi(&a, ax))
    };
    op!("index_select", a.index_select(ax, &idx1));
    op!("index_select_b", b.index_select(ax2, &idx1));
    op!("index_select_any", a.index_select(ax, &idx_any));
    op!("index_select_r", {
        let n = rng.below(5);
        a.index_select(axr, &index(&mut rng, &[n], hi(&a, axr)))
    });
    op!("embedding", a.embedding(&idx_any));
    op!("embedding_1", a.embedding(&idx1));
    let w2 = make(&mut rng, &[u0 % 6, u1 % 6], dts[0], c.kinds[0])?;
    op!("embedding_2d", w2.embedding(&index(&mut rng, &c.shapes[1], u0 % 6)));
    op!("one_hot", idx_any.one_hot(u0));
    op!("one_hot_b", idx1.one_hot(u1 % 9));
    op!("one_hot_nonidx", a.one_hot(u2 % 9));

    // ---- nn
    let conv_opts = Conv2dOpts { stride: [u0, u1], padding: [u2, u3], dilation: [u4, u5], groups: isz.first().copied().unwrap_or(1).unsigned_abs() };
    let sane = Conv2dOpts {
        stride: [1 + u0 % 3, 1 + u1 % 3],
        padding: [u2 % 3, u3 % 3],
        dilation: [1 + u4 % 2, 1 + u5 % 2],
        groups: 1 + isz.first().copied().unwrap_or(1).unsigned_abs() % 3,
    };
    op!("conv2d", a.conv2d(&b, Some(&cc), conv_opts));
    op!("conv2d_nobias", a.conv2d(&b, None, sane));
    op!("conv2d_shaped", {
        // 4-D input and weight with plausible channel counts.
        let xd = [c.shapes[0].first().copied().unwrap_or(1), 1 + u0 % 4, 1 + u1 % 6, 1 + u2 % 6];
        let cin = xd[1];
        let g = if cin % sane.groups == 0 { sane.groups } else { 1 };
        let cout = g * (1 + u3 % 3);
        let wd = if rng.below(4) > 0 { [cout, cin / g, 1 + u4 % 3, 1 + u5 % 3] } else { [cout, (u4 % 4), 1 + u5 % 3, u0 % 3] };
        let x = make(&mut rng, &xd, dts[0], c.kinds[0])?;
        let w = make(&mut rng, &wd, dts[1], c.kinds[1])?;
        let bd = if rng.below(3) > 0 { vec![cout] } else { near_shape(&mut rng, &[cout], &[]) };
        let bias = make(&mut rng, &bd, dts[2], 0)?;
        op!("conv2d_shaped_wild", x.conv2d(&w, Some(&bias), conv_opts));
        x.conv2d(&w, if keep { Some(&bias) } else { None }, Conv2dOpts { groups: g, ..sane })
    });
    let pool_in = {
        let d = [1 + u5 % 2, 1 + u4 % 3, u0 % 7, u1 % 7];
        make(&mut rng, &d, dts[0], c.kinds[0])?
    };
    for (k, s, p) in [
        ([u0, u1], Some([u2, u3]), [u4, u5]),
        ([1 + u0 % 4, 1 + u1 % 4], if flag { None } else { Some([1 + u2 % 3, 1 + u3 % 3]) }, [u4 % 3, u5 % 3]),
        ([u2, u3], None, [u4, u5]),
    ] {
        op!("max_pool2d", pool_in.max_pool2d(k, s, p));
        op!("avg_pool2d", pool_in.avg_pool2d(k, s, p));
        op!("max_pool2d_any", a.max_pool2d(k, s, p));
        op!("avg_pool2d_any", b.avg_pool2d(k, s, p));
    }
    let ns_suffix: Vec<usize> = {
        let k = rng.below(a.rank() + 2).min(a.rank());
        a.dims()[a.rank() - k..].to_vec()
    };
    let ns = if flag { ns_suffix.clone() } else { near_shape(&mut rng, &ns_suffix, &c.shapes[1]) };
    let lwd = near_shape(&mut rng, &ns, &c.shapes[2]);
    let lw = make(&mut rng, &lwd, dts[1], c.kinds[1])?;
    let lb = make(&mut rng, &ns, dts[2], c.kinds[2])?;
    op!("layer_norm", a.layer_norm(&ns, Some(&lw), Some(&lb), f0.abs()));
    op!("layer_norm_nw", a.layer_norm(&ns, None, if keep { Some(&lb) } else { None }, 1e-5));
    op!("layer_norm_b", b.layer_norm(&c.shapes[1], None, None, f1));
    op!("dropout", a.dropout(f0, train));
    op!("dropout_b", b.dropout(f1, !train));
    op!("dropout_c", cc.dropout(f2, true));
    for red in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        let target = {
            let mut td = a.dims().to_vec();
            if td.len() >= 2 {
                td.remove(1);
            }
            let td = if flag { td } else { near_shape(&mut rng, &td, &c.shapes[1]) };
            index(&mut rng, &td, hi(&a, 1))
        };
        op!("cross_entropy", a.cross_entropy(&target, f0, red));
        op!("cross_entropy_any", a.cross_entropy(&idx_any, f1, red));
        op!("cross_entropy_b", b.cross_entropy(&target, f2, red));
        op!("mse_loss", a.mse_loss(&b, red));
        op!("mse_loss_near", a.mse_loss(&a_near, red));
        op!("mse_loss_same", a.mse_loss(&a.add(1.0)?, red));
    }
    Ok(())
}

/// 256 cases from a fixed seed, so that runs are reproducible;
/// `PROPTEST_CASES` and `PROPTEST_RNG_SEED` override both.
fn config() -> Config {
    let d = Config::default();
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() { d.cases } else { 256 };
    let rng_seed = match d.rng_seed {
        RngSeed::Random => RngSeed::Fixed(0x0B5E_55ED),
        fixed => fixed,
    };
    Config { cases, rng_seed, failure_persistence: None, ..d }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn no_public_op_panics(c in case()) {
        // Construction errors are fine too (e.g. a bad shape for `make`).
        let r = run_case(&c);
        prop_assert!(r.is_ok(), "building the case's inputs failed: {:?}", r);
    }
}

// ---- Regressions found by the property test (and the value tests), pinned down.

#[test]
fn reductions_of_constants() -> Result<()> {
    // The reduction's prologue is a lone constant with no buffer to read.
    let x = Tensor::full(&[2, 4], 3.0, DType::F32, Device::Cpu)?;
    assert_eq!(x.sum(&[], false)?.item::<f32>()?, 24.0);
    assert_eq!(x.max(&[-1], false)?.to_vec::<f32>()?, vec![3.0, 3.0]);
    assert_eq!(x.argmax(None, false)?.item::<i32>()?, 0);
    assert_eq!(Tensor::ones(&[3], DType::I32, Device::Cpu)?.sum_all()?.item::<i32>()?, 3);
    Ok(())
}

#[test]
fn views_of_empty_pending_nodes() -> Result<()> {
    // Composing a view with an empty inner shape divided by a zero stride.
    let x = Tensor::zeros(&[2, 0], DType::F32, Device::Cpu)?.add(1.0)?;
    let y = x.t()?.exp()?;
    assert_eq!(y.dims(), &[0, 2]);
    assert_eq!(y.to_vec::<f32>()?, Vec::<f32>::new());
    let z = Tensor::zeros(&[3, 0, 2], DType::F32, Device::Cpu)?.mul(2.0)?.narrow(0, 1, 2)?.sum(&[0], false)?;
    assert_eq!(z.to_vec::<f32>()?, Vec::<f32>::new());
    Ok(())
}

#[test]
fn empty_shapes_with_huge_dims_are_errors() -> Result<()> {
    // numel is 0, but the strides would overflow.
    let e = Tensor::zeros(&[0, usize::MAX / 2, usize::MAX / 2], DType::F32, Device::Cpu).unwrap_err();
    assert!(e.to_string().contains("too many elements"), "{e}");
    let idx = Tensor::zeros(&[0], DType::I32, Device::Cpu)?;
    assert!(idx.one_hot(usize::MAX).is_err());
    assert!(idx.reshape_dims(&[0, usize::MAX / 2, 4]).is_err());
    // Empty shapes with ordinary dims still work.
    assert_eq!(Tensor::zeros(&[0, 5, 7], DType::F32, Device::Cpu)?.to_vec::<f32>()?, Vec::<f32>::new());
    assert_eq!(idx.one_hot(4)?.dims(), &[0, 4]);
    Ok(())
}

#[test]
fn huge_slice_steps_and_split_sizes() -> Result<()> {
    let x = Tensor::from_vec((0..12).map(|v| v as f32).collect(), &[3, 4], Device::Cpu)?;
    let s = x.slice(1, 1, 4, usize::MAX)?;
    assert_eq!(s.dims(), &[3, 1]);
    assert_eq!(s.to_vec::<f32>()?, vec![1., 5., 9.]);
    assert_eq!(x.slice(0, 0, 3, usize::MAX / 2)?.to_vec::<f32>()?, vec![0., 1., 2., 3.]);
    let e = x.split_with_sizes(&[usize::MAX, 5], 1).unwrap_err();
    assert!(e.to_string().contains("split_with_sizes"), "{e}");
    Ok(())
}

#[test]
fn huge_conv_and_pool_parameters() -> Result<()> {
    let x = Tensor::from_vec((0..25).map(|v| v as f32).collect(), &[1, 1, 5, 5], Device::Cpu)?;
    let w = Tensor::ones(&[1, 1, 2, 2], DType::F32, Device::Cpu)?;
    let opts = |stride: usize, padding: usize, dilation: usize, groups: usize| Conv2dOpts {
        stride: [stride, stride],
        padding: [padding, padding],
        dilation: [dilation, dilation],
        groups,
    };
    // A stride past the input gives the top-left window only: 0 + 1 + 5 + 6.
    for stride in [5, 1 << 40, usize::MAX / 2, usize::MAX] {
        let y = x.conv2d(&w, None, opts(stride, 0, 1, 1))?;
        assert_eq!(y.dims(), &[1, 1, 1, 1]);
        assert_eq!(y.to_vec::<f32>()?, vec![12.0], "stride {stride}");
    }
    assert_eq!(x.max_pool2d([2, 2], Some([usize::MAX, usize::MAX]), [1, 1])?.to_vec::<f32>()?, vec![0.0]);
    // Overflowing padding or dilation, and groups, are errors.
    for big in [usize::MAX, usize::MAX / 2, usize::MAX / 3, 1 << 40] {
        assert!(x.conv2d(&w, None, opts(1, big, 1, 1)).is_err());
        assert!(x.conv2d(&w, None, opts(1, 0, big, 1)).is_err());
        assert!(x.max_pool2d([2, 2], None, [big, big]).is_err());
        assert!(x.avg_pool2d([big, 2], Some([big, 1]), [0, 0]).is_err());
    }
    let e0 = Tensor::zeros(&[1, 0, 3, 3], DType::F32, Device::Cpu)?;
    let w0 = Tensor::zeros(&[0, 2, 1, 1], DType::F32, Device::Cpu)?;
    assert!(e0.conv2d(&w0, None, opts(1, 0, 1, 1 << 63)).is_err());
    Ok(())
}

#[test]
fn zz_stats() {
    if std::env::var_os("NO_PANIC_STATS").is_none() {
        return;
    }
    no_public_op_panics();
    for (name, [rec, real, err]) in STATS.lock().unwrap().iter() {
        eprintln!("{name:>24}: recorded {rec:>6}  realized {real:>6}  err {err:>6}");
    }
}
