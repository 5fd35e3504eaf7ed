//! An OpInfo-style table (after PyTorch's): every public op with the dtypes
//! it takes, run over shared sample inputs (random shapes, size-0 and size-1
//! dims, broadcasting, non-contiguous views, NaN and infinities, integer edge
//! values) on the CPU and on the GPU. Both are compared with an independent
//! f64 reference written here (never the library's ops), and every
//! differentiable op's gradient is checked against central differences in
//! f64, and on the GPU against the CPU's. `every_public_op_is_in_the_table`
//! reads the sources and fails when a public op is missing.

mod common;

use common::*;
use std::collections::BTreeSet;
use voltaic::{Conv2dOpts, DType, Device, Reduction, Result, Tensor};

use DType::{Bool, BF16, F16, F32, F64, I32, U32};

/// Row-major values with their shape: a reference's view of a tensor.
#[derive(Clone, Debug)]
struct Arr {
    dims: Vec<usize>,
    v: Vec<f64>,
}

impl Arr {
    fn new(dims: &[usize], v: Vec<f64>) -> Arr {
        assert_eq!(numel(dims), v.len());
        Arr { dims: dims.to_vec(), v }
    }
    fn scalar(v: f64) -> Arr {
        Arr::new(&[], vec![v])
    }
    fn at(&self, idx: &[usize]) -> f64 {
        self.v[ravel(idx, &self.dims)]
    }
}

/// One input of a sample: values, dtype, and whether the tensor is built as
/// a transposed (non-contiguous) view.
#[derive(Clone)]
struct Input {
    arr: Arr,
    dtype: DType,
    strided: bool,
}

/// Scalar arguments of a sample.
#[derive(Clone, Default, Debug)]
struct Args {
    axes: Vec<isize>,
    keep: bool,
    n: Vec<usize>,
    f: f64,
}

struct Sample {
    inputs: Vec<Input>,
    args: Args,
}

type Run = fn(&[Tensor], &Args) -> Result<Vec<Tensor>>;
type Reference = fn(&[Arr], &Args, DType) -> Vec<Arr>;
type Samples = fn(&mut Rng, DType) -> Vec<Sample>;

struct OpInfo {
    name: &'static str,
    dtypes: &'static [DType],
    samples: Samples,
    run: Run,
    reference: Reference,
    /// Gradients checked (float samples only).
    grad: bool,
    /// Inputs for gradient checks: drawn by this (default: normal).
    grad_values: Option<fn(&mut Rng) -> f64>,
    /// Extra tolerance factor over the dtype's default.
    slack: f64,
}

const FLOATS: &[DType] = &[F32, F64, F16, BF16];
const NUMERIC: &[DType] = &[F32, F64, F16, BF16, I32, U32];
const ALL: &[DType] = &[F32, F64, F16, BF16, I32, U32, Bool];
const CASTS: &[DType] = &[F32, F16, BF16, I32, U32, Bool];

fn op(name: &'static str, dtypes: &'static [DType], samples: Samples, run: Run, reference: Reference) -> OpInfo {
    OpInfo { name, dtypes, samples, run, reference, grad: false, grad_values: None, slack: 1.0 }
}

impl OpInfo {
    fn grad(mut self) -> OpInfo {
        self.grad = true;
        self
    }
    fn grad_on(mut self, g: fn(&mut Rng) -> f64) -> OpInfo {
        self.grad = true;
        self.grad_values = Some(g);
        self
    }
    fn slack(mut self, s: f64) -> OpInfo {
        self.slack = s;
        self
    }
}

// ---- sample inputs ----

/// Values for a dtype: normals, with edge values mixed in.
fn values(rng: &mut Rng, n: usize, dt: DType, specials: bool) -> Vec<f64> {
    let edge: &[f64] = match dt {
        I32 if specials => &[i32::MIN as f64, i32::MAX as f64, 0.0, -1.0, 1.0],
        U32 if specials => &[0.0, 1.0, u32::MAX as f64],
        I32 | U32 => &[0.0, 1.0],
        Bool => &[0.0, 1.0],
        _ if specials => &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1e30, -1e-30],
        _ => &[0.0],
    };
    (0..n)
        .map(|i| {
            if i % 5 == 3 {
                return edge[rng.below(edge.len())];
            }
            match dt {
                I32 => rng.ints(1, -20, 21)[0],
                U32 => rng.ints(1, 0, 21)[0],
                Bool => rng.ints(1, 0, 2)[0],
                _ => rng.normal() * 2.0,
            }
        })
        .collect()
}

fn input(rng: &mut Rng, dims: &[usize], dt: DType, specials: bool, strided: bool) -> Input {
    let v = values(rng, numel(dims), dt, specials);
    Input { arr: Arr::new(dims, v.into_iter().map(|x| round_to(x, dt)).collect()), dtype: dt, strided: strided && dims.len() >= 2 }
}

fn sample(inputs: Vec<Input>) -> Sample {
    Sample { inputs, args: Args::default() }
}

/// Shapes every op sees: 0-d, size 0, size 1, odd sizes, a strided view.
fn unary_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let shapes: &[(&[usize], bool)] = &[(&[], false), (&[0], false), (&[1], false), (&[7], false), (&[3, 5], true), (&[2, 1, 4], false), (&[0, 3], true)];
    shapes.iter().map(|&(s, strided)| sample(vec![input(rng, s, dt, true, strided)])).collect()
}

/// Broadcasting pairs, a strided operand, an empty one.
fn binary_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let pairs: &[(&[usize], &[usize], bool)] = &[(&[3, 4], &[3, 4], false), (&[3, 1], &[1, 4], false), (&[], &[2, 3], false), (&[0, 3], &[1, 3], false), (&[4, 3], &[3], true), (&[2, 3, 2], &[3, 1], true)];
    pairs.iter().map(|&(a, b, strided)| sample(vec![input(rng, a, dt, true, strided), input(rng, b, dt, true, false)])).collect()
}

fn ternary_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let cases: &[(&[usize], &[usize], &[usize])] = &[(&[3, 4], &[3, 4], &[3, 4]), (&[3, 1], &[1, 4], &[]), (&[0, 2], &[2], &[1, 2])];
    cases.iter().map(|&(c, a, b)| sample(vec![input(rng, c, Bool, false, false), input(rng, a, dt, true, false), input(rng, b, dt, true, true)])).collect()
}

/// Shapes with axes to reduce over (and keepdim).
fn reduce_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let cases: &[(&[usize], &[isize], bool, bool)] = &[
        (&[5], &[0], false, false),
        (&[3, 4], &[1], true, false),
        (&[3, 4], &[0], false, true),
        (&[2, 3, 4], &[0, 2], false, false),
        (&[2, 3, 4], &[], true, false),
        (&[4, 1, 3], &[-1], false, true),
        (&[], &[], false, false),
        (&[2, 0, 3], &[0], false, false),
    ];
    cases
        .iter()
        .map(|&(s, axes, keep, strided)| Sample { inputs: vec![input(rng, s, dt, true, strided)], args: Args { axes: axes.to_vec(), keep, ..Default::default() } })
        .collect()
}

/// Without the huge values whose squares overflow the compute type (var, std).
fn moderate_reduce_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let mut out = reduce_samples(rng, dt);
    for s in &mut out {
        s.inputs[0].arr.v.iter_mut().filter(|v| v.abs() > 1e20).for_each(|v| *v = 3.5);
    }
    out
}

/// Reductions that have no identity: no empty dims.
fn nonempty_reduce_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    reduce_samples(rng, dt).into_iter().filter(|s| !s.inputs[0].arr.dims.contains(&0)).collect()
}

/// One dim (`axes[0]`) of shapes of rank >= 1.
fn dim_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let cases: &[(&[usize], isize, bool)] = &[(&[6], 0, false), (&[3, 5], 1, true), (&[3, 5], 0, false), (&[2, 3, 4], -2, false), (&[2, 1, 3], 1, false), (&[0, 4], 1, false)];
    cases.iter().map(|&(s, d, strided)| Sample { inputs: vec![input(rng, s, dt, true, strided)], args: Args { axes: vec![d], ..Default::default() } }).collect()
}

fn finite_dim_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let mut out = dim_samples(rng, dt);
    for s in &mut out {
        let d = s.inputs[0].arr.dims.clone();
        s.inputs[0] = input(rng, &d, dt, false, s.inputs[0].strided);
    }
    out
}

// ---- reference helpers (plain loops over f64) ----

/// Shape two inputs broadcast to, with where each output element reads each input.
fn broadcast(arrs: &[Arr]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut out: Vec<usize> = vec![];
    for a in arrs {
        out = bcast_shape(&out, &a.dims).expect("samples broadcast");
    }
    let pos = arrs.iter().map(|a| (0..numel(&out)).map(|i| bcast_pos(&unravel(i, &out), &a.dims)).collect()).collect();
    (out, pos)
}

fn map1(a: &[Arr], f: impl Fn(f64) -> f64) -> Vec<Arr> {
    vec![Arr::new(&a[0].dims, a[0].v.iter().map(|&x| f(x)).collect())]
}

fn map2(a: &[Arr], f: impl Fn(f64, f64) -> f64) -> Vec<Arr> {
    let (dims, pos) = broadcast(&a[..2]);
    let v = (0..numel(&dims)).map(|i| f(a[0].v[pos[0][i]], a[1].v[pos[1][i]])).collect();
    vec![Arr::new(&dims, v)]
}

/// `x * y` in an integer dtype, wrapped exactly (f64 rounds products past 2^53).
fn imul(x: f64, y: f64, dt: DType) -> f64 {
    match dt {
        I32 => (x as i128 * y as i128) as i32 as f64,
        U32 => (x as i128 * y as i128) as u32 as f64,
        _ => x * y,
    }
}

/// Wrap an exact integer result into an integer dtype (two's complement).
fn wrap(v: f64, dt: DType) -> f64 {
    match dt {
        I32 => (v as i128 as i32) as f64,
        U32 => (v as i128 as u32) as f64,
        _ => v,
    }
}

/// The dims `args.axes` names (empty: all), normalised.
fn axes_of(dims: &[usize], axes: &[isize]) -> Vec<usize> {
    if dims.is_empty() {
        return vec![];
    }
    if axes.is_empty() {
        return (0..dims.len()).collect();
    }
    axes.iter().map(|&a| if a < 0 { (a + dims.len() as isize) as usize } else { a as usize }).collect()
}

/// Fold every group of elements that share the kept dims; returns the
/// output (reduced dims kept as 1 or dropped).
fn reduce_ref(a: &Arr, args: &Args, fold: impl Fn(&[f64]) -> f64) -> Arr {
    let axes = axes_of(&a.dims, &args.axes);
    let kept_dims: Vec<usize> = a.dims.iter().enumerate().map(|(d, &n)| if axes.contains(&d) { 1 } else { n }).collect();
    let mut groups: Vec<Vec<f64>> = vec![vec![]; numel(&kept_dims)];
    for i in 0..a.v.len() {
        let mut idx = unravel(i, &a.dims);
        for &d in &axes {
            idx[d] = 0;
        }
        groups[ravel(&idx, &kept_dims)].push(a.v[i]);
    }
    let v = groups.iter().map(|g| fold(g)).collect();
    let dims = if args.keep { kept_dims } else { a.dims.iter().enumerate().filter(|(d, _)| !axes.contains(d)).map(|(_, &n)| n).collect() };
    Arr::new(&dims, v)
}

/// Apply `f` to every line along `dim` (for softmax, cumsum, ...).
fn along(a: &Arr, dim: isize, f: impl Fn(&[f64]) -> Vec<f64>) -> Arr {
    let d = axes_of(&a.dims, &[dim])[0];
    let mut out = a.v.clone();
    let len = a.dims[d];
    if len == 0 {
        return a.clone();
    }
    let st = strides(&a.dims)[d];
    for i in 0..a.v.len() {
        if unravel(i, &a.dims)[d] != 0 {
            continue;
        }
        let line: Vec<f64> = (0..len).map(|j| a.v[i + j * st]).collect();
        for (j, v) in f(&line).into_iter().enumerate() {
            out[i + j * st] = v;
        }
    }
    Arr::new(&a.dims, out)
}

fn first_extreme(g: &[f64], max: bool) -> f64 {
    let mut best = 0;
    for (i, &v) in g.iter().enumerate() {
        if g[best].is_nan() {
            break;
        }
        if v.is_nan() || (max && v > g[best]) || (!max && v < g[best]) {
            best = i;
        }
    }
    best as f64
}

fn extreme(g: &[f64], max: bool) -> f64 {
    if g.iter().any(|v| v.is_nan()) {
        return f64::NAN;
    }
    g.iter().cloned().fold(if max { f64::NEG_INFINITY } else { f64::INFINITY }, |a, b| if max { a.max(b) } else { a.min(b) })
}

fn python_rem(a: f64, b: f64) -> f64 {
    let r = a % b;
    if r != 0.0 && (r < 0.0) != (b < 0.0) {
        r + b
    } else {
        r
    }
}

fn int_pow(a: f64, b: f64, dt: DType) -> f64 {
    if b < 0.0 {
        return if a == 1.0 { 1.0 } else if a == -1.0 { if b % 2.0 == 0.0 { 1.0 } else { -1.0 } } else { 0.0 };
    }
    // Modulo 2^32: multiply b times, by squaring.
    let m = 1i128 << 32;
    let (mut r, mut x, mut e) = (1i128, (a as i128).rem_euclid(m), b as u64);
    while e > 0 {
        if e & 1 == 1 {
            r = r * x % m;
        }
        x = x * x % m;
        e >>= 1;
    }
    wrap(r as f64, dt)
}

/// A cast as Rust's `as` does it: integers to integers wrap, floats saturate.
fn cast(x: f64, from: DType, to: DType) -> f64 {
    if matches!(from, I32 | U32 | Bool) && matches!(to, I32 | U32) {
        wrap(x, to)
    } else {
        round_to(x, to)
    }
}

/// The values a strided view (dims, strides, offset) of row-major `a` sees.
fn view(a: &Arr, dims: &[usize], st: &[usize], offset: usize) -> Arr {
    Arr::new(dims, strided(&a.v, dims, st, offset))
}

// ---- the table ----

macro_rules! unary {
    ($name:literal, $dt:expr, $method:ident, $f:expr) => {
        op($name, $dt, unary_samples, |t, _| Ok(vec![t[0].$method()?]), |a, _, _| map1(a, $f))
    };
}
macro_rules! binary {
    ($name:literal, $dt:expr, $method:ident, $f:expr) => {
        op($name, $dt, binary_samples, |t, _| Ok(vec![t[0].$method(&t[1])?]), |a, _, _| map2(a, $f))
    };
}
macro_rules! cmp {
    ($name:literal, $method:ident, $f:expr) => {
        op($name, ALL, binary_samples, |t, _| Ok(vec![t[0].$method(&t[1])?]), |a, _, _| map2(a, |x, y| $f(x, y) as u8 as f64))
    };
}

fn positive(r: &mut Rng) -> f64 {
    0.3 + r.uniform() * 2.0
}
fn away_from_ints(r: &mut Rng) -> f64 {
    r.ints(1, -3, 4)[0] + 0.2 + 0.6 * r.uniform()
}

fn table() -> Vec<OpInfo> {
    vec![
        // Elementwise primitives (the op table's entries).
        op("neg", NUMERIC, unary_samples, |t, _| Ok(vec![t[0].neg()?]), |a, _, dt| map1(a, |x| wrap(-x, dt))).grad(),
        op("abs", NUMERIC, unary_samples, |t, _| Ok(vec![t[0].abs()?]), |a, _, dt| map1(a, |x| wrap(x.abs(), dt))).grad(),
        unary!("exp", FLOATS, exp, f64::exp).grad(),
        unary!("log", FLOATS, log, f64::ln).grad_on(positive),
        unary!("log1p", FLOATS, log1p, f64::ln_1p).grad_on(positive),
        unary!("expm1", FLOATS, expm1, f64::exp_m1).grad(),
        unary!("sqrt", FLOATS, sqrt, f64::sqrt).grad_on(positive),
        unary!("rsqrt", FLOATS, rsqrt, |x: f64| 1.0 / x.sqrt()).grad_on(positive),
        unary!("recip", FLOATS, recip, |x: f64| 1.0 / x).grad_on(positive),
        unary!("sin", FLOATS, sin, f64::sin).grad(),
        unary!("cos", FLOATS, cos, f64::cos).grad(),
        unary!("tanh", FLOATS, tanh, f64::tanh).grad(),
        unary!("sigmoid", FLOATS, sigmoid, |x: f64| 1.0 / (1.0 + (-x).exp())).grad(),
        unary!("relu", NUMERIC, relu, |x: f64| if x < 0.0 { 0.0 } else { x }).grad(),
        unary!("erf", FLOATS, erf, erf_ref).grad(),
        unary!("floor", NUMERIC, floor, f64::floor).grad_on(away_from_ints),
        unary!("ceil", NUMERIC, ceil, f64::ceil).grad_on(away_from_ints),
        unary!("round", NUMERIC, round, f64::round_ties_even).grad_on(away_from_ints),
        unary!("sign", NUMERIC, sign, |x: f64| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { x }).grad(),
        unary!("logical_not", ALL, logical_not, |x: f64| (x == 0.0) as u8 as f64),
        unary!("nonfinite", FLOATS, nonfinite, |x: f64| (!x.is_finite()) as u8 as f64),
        unary!("isfinite", ALL, isfinite, |x: f64| x.is_finite() as u8 as f64),
        unary!("isinf", ALL, isinf, |x: f64| x.is_infinite() as u8 as f64),
        unary!("isnan", ALL, isnan, |x: f64| x.is_nan() as u8 as f64),
        op("add", ALL, binary_samples, |t, _| Ok(vec![t[0].add(&t[1])?]), |a, _, dt| {
            map2(a, |x, y| if dt == Bool { ((x + y) != 0.0) as u8 as f64 } else { wrap(x + y, dt) })
        })
        .grad(),
        op("sub", NUMERIC, binary_samples, |t, _| Ok(vec![t[0].sub(&t[1])?]), |a, _, dt| map2(a, |x, y| wrap(x - y, dt))).grad(),
        op("mul", ALL, binary_samples, |t, _| Ok(vec![t[0].mul(&t[1])?]), |a, _, dt| map2(a, |x, y| imul(x, y, dt))).grad(),
        binary!("div", FLOATS, div, |x, y| x / y).grad(),
        op("pow", NUMERIC, binary_samples, |t, _| Ok(vec![t[0].pow(&t[1])?]), |a, _, dt| {
            map2(a, |x, y| if matches!(dt, I32 | U32) { int_pow(x, y, dt) } else { x.powf(y) })
        })
        .grad_on(positive)
        .slack(4.0),
        op("rem", NUMERIC, binary_samples, |t, _| Ok(vec![t[0].rem(&t[1])?]), |a, _, dt| {
            // Integer division by zero gives 0 (PyTorch raises).
            map2(a, |x, y| if matches!(dt, I32 | U32) && y == 0.0 { 0.0 } else { python_rem(x, y) })
        })
        .grad_on(positive),
        op("maximum", ALL, binary_samples, |t, _| Ok(vec![t[0].maximum(&t[1])?]), |a, _, _| map2(a, |x, y| if x.is_nan() || y.is_nan() { f64::NAN } else { x.max(y) })).grad(),
        op("minimum", ALL, binary_samples, |t, _| Ok(vec![t[0].minimum(&t[1])?]), |a, _, _| map2(a, |x, y| if x.is_nan() || y.is_nan() { f64::NAN } else { x.min(y) })).grad(),
        op("logical_and", ALL, binary_samples, |t, _| Ok(vec![t[0].logical_and(&t[1])?]), |a, _, _| map2(a, |x, y| (x != 0.0 && y != 0.0) as u8 as f64)),
        op("logical_or", ALL, binary_samples, |t, _| Ok(vec![t[0].logical_or(&t[1])?]), |a, _, _| map2(a, |x, y| (x != 0.0 || y != 0.0) as u8 as f64)),
        cmp!("eq", eq, |x: f64, y: f64| x == y),
        cmp!("ne", ne, |x: f64, y: f64| x != y),
        cmp!("lt", lt, |x: f64, y: f64| x < y),
        cmp!("le", le, |x: f64, y: f64| x <= y),
        cmp!("gt", gt, |x: f64, y: f64| x > y),
        cmp!("ge", ge, |x: f64, y: f64| x >= y),
        // The generic entry points, through one primitive each.
        op("unary", FLOATS, unary_samples, |t, _| Ok(vec![t[0].unary(voltaic::primitive::UnaryOp::Tanh)?]), |a, _, _| map1(a, f64::tanh)),
        op("binary", FLOATS, binary_samples, |t, _| Ok(vec![t[0].binary(voltaic::primitive::BinaryOp::Sub, &t[1])?]), |a, _, _| map2(a, |x, y| x - y)),
        op("compare", FLOATS, binary_samples, |t, _| Ok(vec![t[0].compare(voltaic::primitive::CmpOp::Le, &t[1])?]), |a, _, _| map2(a, |x, y| (x <= y) as u8 as f64)),
        op("reduce", FLOATS, reduce_samples, |t, a| Ok(vec![t[0].reduce(voltaic::primitive::ReduceOp::Sum, &a.axes, a.keep)?]), |a, g, _| vec![reduce_ref(&a[0], g, |v| v.iter().sum())]),
        // Composites of elementwise ops.
        op("where_cond", NUMERIC, ternary_samples, |t, _| Ok(vec![t[0].where_cond(&t[1], &t[2])?]), |a, _, _| {
            let (dims, pos) = broadcast(a);
            vec![Arr::new(&dims, (0..numel(&dims)).map(|i| if a[0].v[pos[0][i]] != 0.0 { a[1].v[pos[1][i]] } else { a[2].v[pos[2][i]] }).collect())]
        })
        .grad(),
        op("masked_fill", FLOATS, binary_samples, |t, _| Ok(vec![t[0].broadcast_to(&bcast_shape(t[0].dims(), t[1].dims()).unwrap())?.masked_fill(&t[1].gt(0.0)?, -7.5)?]), |a, _, _| {
            map2(a, |x, m| if m > 0.0 { -7.5 } else { x })
        }),
        // Every dtype but f64, which the GPU refuses (tests/gpu.rs checks the error).
        // (Gradients of casts: tests/grad.rs; a finite difference through an f16 cast is noise.)
        op("to_dtype", ALL, unary_samples, |t, _| CASTS.iter().map(|&d| t[0].to_dtype(d)).collect::<Result<Vec<_>>>(), |a, _, dt| {
            CASTS.iter().map(|&d| map1(a, |x| cast(x, dt, d)).remove(0)).collect()
        }),
        op("clamp", NUMERIC, unary_samples, |t, _| Ok(vec![t[0].clamp(Some(-1.0), Some(2.0))?, t[0].clamp(Some(3.0), Some(1.0))?, t[0].clamp(None, Some(0.0))?]), |a, _, _| {
            let c = |lo: f64, hi: f64| map1(a, move |x| if x.is_nan() { x } else { x.max(lo).min(hi) }).remove(0);
            vec![c(-1.0, 2.0), c(3.0, 1.0), c(f64::NEG_INFINITY, 0.0)]
        })
        .grad(),
        op("sqr", NUMERIC, unary_samples, |t, _| Ok(vec![t[0].sqr()?]), |a, _, dt| map1(a, |x| imul(x, x, dt))).grad(),
        op("leaky_relu", FLOATS, unary_samples, |t, _| Ok(vec![t[0].leaky_relu(0.1)?]), |a, _, _| map1(a, |x| if x > 0.0 { x } else { 0.1 * x })).grad(),
        unary!("gelu", FLOATS, gelu, |x: f64| 0.5 * x * (1.0 + erf_ref(x / 2f64.sqrt()))).grad(),
        unary!("gelu_tanh", FLOATS, gelu_tanh, |x: f64| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())).grad(),
        unary!("silu", FLOATS, silu, |x: f64| x / (1.0 + (-x).exp())).grad(),
        unary!("softplus", FLOATS, softplus, |x: f64| if x > 20.0 { x } else { x.exp().ln_1p() }).grad(),
        // Reductions.
        op("sum", NUMERIC, reduce_samples, |t, a| Ok(vec![t[0].sum(&a.axes, a.keep)?]), |a, g, dt| vec![reduce_ref(&a[0], g, |v| wrap(v.iter().sum(), dt))]).grad(),
        op("prod", FLOATS, reduce_samples, |t, a| Ok(vec![t[0].prod(&a.axes, a.keep)?]), |a, g, _| vec![reduce_ref(&a[0], g, |v| v.iter().product())]).grad().slack(4.0),
        op("max", NUMERIC, nonempty_reduce_samples, |t, a| Ok(vec![t[0].max(&a.axes, a.keep)?]), |a, g, _| vec![reduce_ref(&a[0], g, |v| extreme(v, true))]).grad(),
        op("min", NUMERIC, nonempty_reduce_samples, |t, a| Ok(vec![t[0].min(&a.axes, a.keep)?]), |a, g, _| vec![reduce_ref(&a[0], g, |v| extreme(v, false))]).grad(),
        op("mean", FLOATS, reduce_samples, |t, a| Ok(vec![t[0].mean(&a.axes, a.keep)?]), |a, g, _| vec![reduce_ref(&a[0], g, |v| v.iter().sum::<f64>() / v.len() as f64)]).grad(),
        op("var", FLOATS, moderate_reduce_samples, |t, a| Ok(vec![t[0].var(&a.axes, 1, a.keep)?]), |a, g, _| {
            vec![reduce_ref(&a[0], g, |v| {
                let m = v.iter().sum::<f64>() / v.len() as f64;
                v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() as f64 - 1.0).max(0.0)
            })]
        })
        .grad()
        .slack(10.0),
        op("std", FLOATS, moderate_reduce_samples, |t, a| Ok(vec![t[0].std(&a.axes, 0, a.keep)?]), |a, g, _| {
            vec![reduce_ref(&a[0], g, |v| {
                let m = v.iter().sum::<f64>() / v.len() as f64;
                (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64).sqrt()
            })]
        })
        .grad()
        .slack(10.0),
        op("logsumexp", FLOATS, reduce_samples, |t, a| Ok(vec![t[0].logsumexp(&a.axes, a.keep)?]), |a, g, _| {
            vec![reduce_ref(&a[0], g, |v| {
                let m = extreme(v, true);
                if v.is_empty() || m.is_nan() {
                    return if v.is_empty() { f64::NEG_INFINITY } else { f64::NAN };
                }
                if m.is_infinite() {
                    return m;
                }
                m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
            })]
        })
        .grad(),
        op("sum_all", NUMERIC, unary_samples, |t, _| Ok(vec![t[0].sum_all()?]), |a, _, dt| vec![Arr::scalar(wrap(a[0].v.iter().sum(), dt))]).grad(),
        // The `_all` forms: the whole tensor to a 0-d result.
        op("mean_all", FLOATS, unary_samples, |t, _| Ok(vec![t[0].mean_all()?]), |a, _, _| vec![Arr::scalar(a[0].v.iter().sum::<f64>() / a[0].v.len() as f64)]).grad(),
        op("prod_all", FLOATS, unary_samples, |t, _| Ok(vec![t[0].prod_all()?]), |a, _, _| vec![Arr::scalar(a[0].v.iter().product())]).grad().slack(4.0),
        op("max_all", NUMERIC, unary_samples, |t, _| if t[0].numel() == 0 { Ok(vec![]) } else { Ok(vec![t[0].max_all()?]) }, |a, _, _| {
            if a[0].v.is_empty() { vec![] } else { vec![Arr::scalar(extreme(&a[0].v, true))] }
        })
        .grad(),
        op("min_all", NUMERIC, unary_samples, |t, _| if t[0].numel() == 0 { Ok(vec![]) } else { Ok(vec![t[0].min_all()?]) }, |a, _, _| {
            if a[0].v.is_empty() { vec![] } else { vec![Arr::scalar(extreme(&a[0].v, false))] }
        })
        .grad(),
        op("var_all", FLOATS, moderate_reduce_samples, |t, _| Ok(vec![t[0].var_all(1)?]), |a, _, _| {
            let v = &a[0].v;
            let m = v.iter().sum::<f64>() / v.len() as f64;
            vec![Arr::scalar(v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() as f64 - 1.0).max(0.0))]
        })
        .grad()
        .slack(10.0),
        op("std_all", FLOATS, moderate_reduce_samples, |t, _| Ok(vec![t[0].std_all(0)?]), |a, _, _| {
            let v = &a[0].v;
            let m = v.iter().sum::<f64>() / v.len() as f64;
            vec![Arr::scalar((v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64).sqrt())]
        })
        .grad()
        .slack(10.0),
        op("logsumexp_all", FLOATS, unary_samples, |t, _| Ok(vec![t[0].logsumexp_all()?]), |a, _, _| {
            let v = &a[0].v;
            let m = extreme(v, true);
            let r = if v.is_empty() {
                f64::NEG_INFINITY
            } else if m.is_nan() || m.is_infinite() {
                m
            } else {
                m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
            };
            vec![Arr::scalar(r)]
        })
        .grad(),
        op("argmax_all", ALL, unary_samples, |t, _| if t[0].numel() == 0 { Ok(vec![]) } else { Ok(vec![t[0].argmax_all()?]) }, |a, _, _| {
            if a[0].v.is_empty() { vec![] } else { vec![Arr::scalar(first_extreme(&a[0].v, true))] }
        }),
        op("argmin_all", ALL, unary_samples, |t, _| if t[0].numel() == 0 { Ok(vec![]) } else { Ok(vec![t[0].argmin_all()?]) }, |a, _, _| {
            if a[0].v.is_empty() { vec![] } else { vec![Arr::scalar(first_extreme(&a[0].v, false))] }
        }),
        op("argmax", ALL, finite_dim_samples, |t, a| {
            if t[0].numel() == 0 {
                return Ok(vec![]);
            }
            Ok(vec![t[0].argmax(Some(a.axes[0]), false)?, t[0].argmax(None, true)?])
        }, |a, g, _| {
            let mut one = g.clone();
            one.keep = false;
            let flat = Arr::new(&[a[0].v.len()], a[0].v.clone());
            if a[0].v.is_empty() {
                return vec![];
            }
            vec![reduce_ref(&a[0], &one, |v| first_extreme(v, true)), Arr::new(&vec![1; a[0].dims.len()], vec![first_extreme(&flat.v, true)])]
        }),
        op("argmin", ALL, finite_dim_samples, |t, a| {
            if t[0].numel() == 0 {
                return Ok(vec![]);
            }
            Ok(vec![t[0].argmin(Some(a.axes[0]), true)?])
        }, |a, g, _| {
            if a[0].v.is_empty() {
                return vec![];
            }
            let mut one = g.clone();
            one.keep = true;
            vec![reduce_ref(&a[0], &one, |v| first_extreme(v, false))]
        }),
        op("softmax", FLOATS, finite_dim_samples, |t, a| Ok(vec![t[0].softmax(a.axes[0])?]), |a, g, _| {
            vec![along(&a[0], g.axes[0], |l| {
                let m = extreme(l, true);
                let z: f64 = l.iter().map(|x| (x - m).exp()).sum();
                l.iter().map(|x| (x - m).exp() / z).collect()
            })]
        })
        .grad(),
        op("log_softmax", FLOATS, finite_dim_samples, |t, a| Ok(vec![t[0].log_softmax(a.axes[0])?]), |a, g, _| {
            vec![along(&a[0], g.axes[0], |l| {
                let m = extreme(l, true);
                let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                l.iter().map(|x| x - lse).collect()
            })]
        })
        .grad(),
        op("cumsum", NUMERIC, dim_samples, |t, a| Ok(vec![t[0].cumsum(a.axes[0])?]), |a, g, dt| {
            vec![along(&a[0], g.axes[0], |l| {
                let mut s = 0.0;
                l.iter().map(|x| {
                    s = wrap(s + x, dt);
                    s
                }).collect()
            })]
        })
        .grad()
        .slack(4.0),
        // Views and copies.
        op("contiguous", ALL, unary_samples, |t, _| Ok(vec![t[0].contiguous()?]), |a, _, _| vec![a[0].clone()]).grad(),
        op("reshape", ALL, finite_dim_samples, |t, _| Ok(vec![t[0].reshape(&[-1])?, t[0].reshape_dims(&[t[0].numel()])?]), |a, _, _| {
            let n = a[0].v.len();
            vec![Arr::new(&[n], a[0].v.clone()), Arr::new(&[n], a[0].v.clone())]
        })
        .grad(),
        op("reshape_dims", ALL, finite_dim_samples, |t, _| Ok(vec![t[0].reshape_dims(&[1, t[0].numel(), 1])?]), |a, _, _| vec![Arr::new(&[1, a[0].v.len(), 1], a[0].v.clone())]).grad(),
        op("flatten_all", ALL, unary_samples, |t, _| Ok(vec![t[0].flatten_all()?]), |a, _, _| vec![Arr::new(&[a[0].v.len()], a[0].v.clone())]).grad(),
        op("flatten", ALL, finite_dim_samples, |t, _| Ok(vec![t[0].flatten(0, -1)?]), |a, _, _| vec![Arr::new(&[a[0].v.len()], a[0].v.clone())]).grad(),
        op("view_as", ALL, finite_dim_samples, |t, _| Ok(vec![t[0].view_as(&t[0].flatten_all()?)?]), |a, _, _| vec![Arr::new(&[a[0].v.len()], a[0].v.clone())]),
        op("permute", ALL, finite_dim_samples, |t, _| {
            let r = t[0].rank() as isize;
            Ok(vec![t[0].permute(&(0..r).rev().collect::<Vec<_>>())?])
        }, |a, _, _| {
            let dims: Vec<usize> = a[0].dims.iter().rev().cloned().collect();
            let st: Vec<usize> = strides(&a[0].dims).into_iter().rev().collect();
            vec![view(&a[0], &dims, &st, 0)]
        })
        .grad(),
        op("transpose", ALL, finite_dim_samples, |t, a| Ok(vec![t[0].transpose(0, a.axes[0])?]), |a, g, _| {
            let d = axes_of(&a[0].dims, &g.axes)[0];
            let (mut dims, mut st) = (a[0].dims.clone(), strides(&a[0].dims));
            dims.swap(0, d);
            st.swap(0, d);
            vec![view(&a[0], &dims, &st, 0)]
        })
        .grad(),
        op("t", ALL, finite_dim_samples, |t, _| Ok(vec![if t[0].rank() == 2 { t[0].t()? } else { t[0].clone() }]), |a, _, _| {
            if a[0].dims.len() != 2 {
                return vec![a[0].clone()];
            }
            vec![view(&a[0], &[a[0].dims[1], a[0].dims[0]], &[1, a[0].dims[1]], 0)]
        })
        .grad(),
        op("broadcast_to", ALL, finite_dim_samples, |t, _| {
            let mut d = vec![2];
            d.extend(t[0].dims());
            Ok(vec![t[0].broadcast_to(&d)?])
        }, |a, _, _| {
            let mut d = vec![2];
            d.extend(&a[0].dims);
            let mut st = vec![0];
            st.extend(strides(&a[0].dims));
            vec![view(&a[0], &d, &st, 0)]
        })
        .grad(),
        op("expand", ALL, finite_dim_samples, |t, _| {
            let mut d: Vec<isize> = vec![3];
            d.extend(t[0].dims().iter().map(|_| -1));
            Ok(vec![t[0].expand(&d)?])
        }, |a, _, _| {
            let mut d = vec![3];
            d.extend(&a[0].dims);
            let mut st = vec![0];
            st.extend(strides(&a[0].dims));
            vec![view(&a[0], &d, &st, 0)]
        })
        .grad(),
        op("narrow", ALL, finite_dim_samples, |t, a| {
            let n = t[0].size(a.axes[0])?;
            Ok(vec![t[0].narrow(a.axes[0], n / 3, n - n / 3)?])
        }, |a, g, _| {
            let d = axes_of(&a[0].dims, &g.axes)[0];
            let n = a[0].dims[d];
            let mut dims = a[0].dims.clone();
            dims[d] = n - n / 3;
            let st = strides(&a[0].dims);
            vec![view(&a[0], &dims, &st, (n / 3) * st[d])]
        })
        .grad(),
        op("slice", ALL, finite_dim_samples, |t, a| Ok(vec![t[0].slice(a.axes[0], 1, -1, 2)?]), |a, g, _| {
            let d = axes_of(&a[0].dims, &g.axes)[0];
            let n = a[0].dims[d] as isize;
            let len = if n - 1 > 1 { ((n - 1 - 1) as usize).div_ceil(2) } else { 0 };
            let mut dims = a[0].dims.clone();
            dims[d] = len;
            let mut st = strides(&a[0].dims);
            let off = if len > 0 { st[d] } else { 0 };
            st[d] *= 2;
            vec![view(&a[0], &dims, &st, off)]
        })
        .grad(),
        op("unsqueeze", ALL, finite_dim_samples, |t, _| Ok(vec![t[0].unsqueeze(-1)?, t[0].unsqueeze(0)?]), |a, _, _| {
            let mut d1 = a[0].dims.clone();
            d1.push(1);
            let mut d0 = vec![1];
            d0.extend(&a[0].dims);
            vec![Arr::new(&d1, a[0].v.clone()), Arr::new(&d0, a[0].v.clone())]
        })
        .grad(),
        op("squeeze", ALL, finite_dim_samples, |t, _| Ok(vec![t[0].unsqueeze(1)?.squeeze(1)?]), |a, _, _| vec![a[0].clone()]).grad(),
        op("squeeze_all", ALL, finite_dim_samples, |t, _| Ok(vec![t[0].squeeze_all()?]), |a, _, _| {
            let d: Vec<usize> = a[0].dims.iter().cloned().filter(|&n| n != 1).collect();
            vec![Arr::new(&d, a[0].v.clone())]
        })
        .grad(),
        // Indexing.
        op("gather", ALL, finite_dim_samples, |t, a| {
            let d = a.axes[0];
            let n = t[0].size(d)?;
            let mut dims = t[0].dims().to_vec();
            let dd = if d < 0 { (d + dims.len() as isize) as usize } else { d as usize };
            dims[dd] = 3;
            let idx = Tensor::from_vec((0..numel(&dims)).map(|i| ((i * 7 + 1) % n.max(1)) as i32).collect::<Vec<_>>(), &dims, Device::Cpu)?.to_device(t[0].device())?;
            if n == 0 {
                return Ok(vec![]);
            }
            Ok(vec![t[0].gather(d, &idx)?])
        }, |a, g, _| {
            let dd = axes_of(&a[0].dims, &g.axes)[0];
            let n = a[0].dims[dd];
            if n == 0 {
                return vec![];
            }
            let mut dims = a[0].dims.clone();
            dims[dd] = 3;
            vec![Arr::new(&dims, (0..numel(&dims)).map(|i| {
                let mut p = unravel(i, &dims);
                p[dd] = (i * 7 + 1) % n;
                a[0].at(&p)
            }).collect())]
        })
        .grad(),
        op("index_select", ALL, finite_dim_samples, |t, a| {
            let n = t[0].size(a.axes[0])?;
            if n == 0 {
                return Ok(vec![]);
            }
            let idx = Tensor::from_vec(vec![(n - 1) as u32, 0, (n / 2) as u32, 0], &[4], Device::Cpu)?.to_device(t[0].device())?;
            Ok(vec![t[0].index_select(a.axes[0], &idx)?])
        }, |a, g, _| {
            let dd = axes_of(&a[0].dims, &g.axes)[0];
            let n = a[0].dims[dd];
            if n == 0 {
                return vec![];
            }
            let picks = [n - 1, 0, n / 2, 0];
            let mut dims = a[0].dims.clone();
            dims[dd] = 4;
            vec![Arr::new(&dims, (0..numel(&dims)).map(|i| {
                let mut p = unravel(i, &dims);
                p[dd] = picks[p[dd]];
                a[0].at(&p)
            }).collect())]
        })
        .grad(),
        op("scatter_add", NUMERIC, finite_dim_samples, |t, a| {
            let d = a.axes[0];
            let n = t[0].size(d)?;
            if n == 0 {
                return Ok(vec![]);
            }
            let dims = t[0].dims().to_vec();
            let idx = Tensor::from_vec((0..numel(&dims)).map(|i| ((i * 5) % n) as i32).collect::<Vec<_>>(), &dims, Device::Cpu)?.to_device(t[0].device())?;
            Ok(vec![t[0].scatter_add(d, &idx, &t[0].mul(2)?)?])
        }, |a, g, dt| {
            let dd = axes_of(&a[0].dims, &g.axes)[0];
            let n = a[0].dims[dd];
            if n == 0 {
                return vec![];
            }
            let mut out = a[0].v.clone();
            for i in 0..a[0].v.len() {
                let mut p = unravel(i, &a[0].dims);
                p[dd] = (i * 5) % n;
                let o = ravel(&p, &a[0].dims);
                out[o] = wrap(out[o] + round_to(wrap(2.0 * a[0].v[i], dt), dt), dt);
            }
            vec![Arr::new(&a[0].dims, out)]
        })
        .grad()
        .slack(4.0),
        op("embedding", FLOATS, |r, dt| vec![sample(vec![input(r, &[5, 3], dt, true, true)])], |t, _| {
            let ids = Tensor::from_vec(vec![4i32, 0, 4, 2, 1, 3], &[2, 3], Device::Cpu)?.to_device(t[0].device())?;
            Ok(vec![t[0].embedding(&ids)?])
        }, |a, _, _| {
            let ids = [4, 0, 4, 2, 1, 3];
            vec![Arr::new(&[2, 3, 3], ids.iter().flat_map(|&r| (0..3).map(move |c| a[0].at(&[r, c]))).collect())]
        })
        .grad(),
        op("one_hot", &[I32, U32], |r, _| vec![sample(vec![Input { arr: Arr::new(&[2, 3], vec![0.0, 4.0, 2.0, 2.0, 1.0, 3.0]), dtype: I32, strided: false }]), sample(vec![input(r, &[0], U32, false, false)])], |t, _| Ok(vec![t[0].one_hot(5)?]), |a, _, _| {
            let mut d = a[0].dims.clone();
            d.push(5);
            vec![Arr::new(&d, a[0].v.iter().flat_map(|&c| (0..5).map(move |k| (k as f64 == c) as u8 as f64)).collect())]
        }),
        // Joining and splitting.
        op("cat", ALL, finite_dim_samples, |t, a| Ok(vec![Tensor::cat(&[&t[0], &t[0].mul(3)?.to_dtype(t[0].dtype())?], a.axes[0])?]), |a, g, dt| {
            let dd = axes_of(&a[0].dims, &g.axes)[0];
            let n = a[0].dims[dd];
            let mut dims = a[0].dims.clone();
            dims[dd] = 2 * n;
            vec![Arr::new(&dims, (0..numel(&dims)).map(|i| {
                let mut p = unravel(i, &dims);
                let second = p[dd] >= n;
                p[dd] %= n.max(1);
                let v = a[0].at(&p);
                if second { round_to(if dt == Bool { v } else { wrap(3.0 * v, dt) }, dt) } else { v }
            }).collect())]
        })
        .grad(),
        op("stack", ALL, finite_dim_samples, |t, _| Ok(vec![Tensor::stack(&[&t[0], &t[0]], -1)?]), |a, _, _| {
            let mut d = a[0].dims.clone();
            d.push(2);
            vec![Arr::new(&d, a[0].v.iter().flat_map(|&x| [x, x]).collect())]
        })
        .grad(),
        op("split", ALL, finite_dim_samples, |t, a| t[0].split(2, a.axes[0]), |a, g, _| pieces(&a[0], g.axes[0], 2, None)),
        op("chunk", ALL, finite_dim_samples, |t, a| t[0].chunk(3, a.axes[0]), |a, g, _| {
            let n = a[0].dims[axes_of(&a[0].dims, &g.axes)[0]];
            pieces(&a[0], g.axes[0], n.div_ceil(3), Some(3))
        }),
        op("split_with_sizes", ALL, finite_dim_samples, |t, a| {
            let n = t[0].size(a.axes[0])?;
            t[0].split_with_sizes(&[n / 2, 0, n - n / 2], a.axes[0])
        }, |a, g, _| {
            let dd = axes_of(&a[0].dims, &g.axes)[0];
            let n = a[0].dims[dd];
            [(0, n / 2), (n / 2, 0), (n / 2, n - n / 2)].iter().map(|&(s, l)| {
                let mut dims = a[0].dims.clone();
                dims[dd] = l;
                let st = strides(&a[0].dims);
                view(&a[0], &dims, &st, if l > 0 { s * st[dd] } else { 0 })
            }).collect()
        }),
        // Linear algebra.
        op("matmul", NUMERIC, |r, dt| {
            let cases: &[(&[usize], &[usize], bool)] = &[(&[4, 5], &[5, 3], false), (&[7], &[7], false), (&[2, 3, 4], &[4, 2], true), (&[1, 3, 2], &[2, 2, 5], false), (&[3], &[3, 4], false), (&[0, 2], &[2, 3], false), (&[3, 0], &[0, 2], false)];
            cases.iter().map(|&(x, y, s)| sample(vec![input(r, x, dt, false, s), input(r, y, dt, !dt.is_float(), false)])).collect()
        }, |t, _| Ok(vec![t[0].matmul(&t[1])?]), |a, _, dt| vec![matmul_ref(&a[0], &a[1], dt)])
        .grad()
        .slack(4.0),
        // Neural-network ops.
        op("scaled_dot_product_attention", FLOATS, |r, dt| {
            vec![
                sample(vec![input(r, &[2, 3, 4], dt, false, false), input(r, &[2, 5, 4], dt, false, false), input(r, &[2, 5, 3], dt, false, false), input(r, &[3, 5], dt, false, false)]),
                // A strided query, keys past one chunk of 64, a mask broadcast over the heads.
                sample(vec![input(r, &[1, 2, 3, 8], dt, false, true), input(r, &[1, 2, 70, 8], dt, false, false), input(r, &[1, 2, 70, 5], dt, false, false), input(r, &[1, 1, 3, 70], dt, false, false)]),
            ]
        }, |t, _| Ok(vec![t[0].scaled_dot_product_attention(&t[1], &t[2], Some(&t[3]), None)?]), |a, _, _| vec![attention_ref(&a[0], &a[1], &a[2], &a[3])])
        .grad()
        .slack(4.0),
        op("conv2d", FLOATS, |r, dt| {
            vec![
                Sample { inputs: vec![input(r, &[2, 3, 6, 5], dt, false, false), input(r, &[4, 3, 3, 3], dt, false, false), input(r, &[4], dt, false, false)], args: Args { n: vec![1, 1, 1, 1], ..Default::default() } },
                Sample { inputs: vec![input(r, &[1, 4, 7, 7], dt, false, true), input(r, &[2, 2, 2, 3], dt, false, false), input(r, &[2], dt, false, false)], args: Args { n: vec![2, 0, 2, 2], ..Default::default() } },
            ]
        }, |t, a| {
            let o = Conv2dOpts { stride: [a.n[0], a.n[0]], padding: [a.n[1], a.n[1]], dilation: [a.n[2], a.n[2]], groups: a.n[3] };
            Ok(vec![t[0].conv2d(&t[1], Some(&t[2]), o)?])
        }, |a, g, _| vec![conv_ref(&a[0], &a[1], &a[2], g.n[0], g.n[1], g.n[2], g.n[3])])
        .grad()
        .slack(8.0),
        op("max_pool2d", FLOATS, pool_samples, |t, a| Ok(vec![t[0].max_pool2d([a.n[0], a.n[0]], Some([a.n[1], a.n[1]]), [a.n[2], a.n[2]])?]), |a, g, _| {
            vec![pool_ref(&a[0], g.n[0], g.n[1], g.n[2], true)]
        })
        .grad(),
        op("avg_pool2d", FLOATS, pool_samples, |t, a| Ok(vec![t[0].avg_pool2d([a.n[0], a.n[0]], Some([a.n[1], a.n[1]]), [a.n[2], a.n[2]])?]), |a, g, _| {
            vec![pool_ref(&a[0], g.n[0], g.n[1], g.n[2], false)]
        })
        .grad(),
        op("layer_norm", FLOATS, |r, dt| vec![sample(vec![input(r, &[3, 2, 5], dt, false, false), input(r, &[5], dt, false, false), input(r, &[5], dt, false, false)]), sample(vec![input(r, &[4, 6], dt, false, true), input(r, &[6], dt, false, false), input(r, &[6], dt, false, false)])], |t, _| {
            let n = *t[0].dims().last().unwrap();
            Ok(vec![t[0].layer_norm(&[n], Some(&t[1]), Some(&t[2]), 1e-5)?])
        }, |a, _, _| {
            let n = *a[0].dims.last().unwrap();
            let mut out = vec![];
            for row in a[0].v.chunks(n) {
                let m = row.iter().sum::<f64>() / n as f64;
                let var = row.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n as f64;
                out.extend(row.iter().enumerate().map(|(c, x)| (x - m) / (var + 1e-5).sqrt() * a[1].v[c] + a[2].v[c]));
            }
            vec![Arr::new(&a[0].dims, out)]
        })
        .grad()
        .slack(10.0),
        op("dropout", FLOATS, unary_samples, |t, _| Ok(vec![t[0].dropout(0.4, false)?, t[0].dropout(0.0, true)?]), |a, _, _| vec![a[0].clone(), a[0].clone()]).grad(),
        op("cross_entropy", FLOATS, |r, dt| {
            vec![
                Sample { inputs: vec![input(r, &[4, 5], dt, false, false)], args: Args { n: vec![1, 0, 4, 2], f: 0.0, ..Default::default() } },
                Sample { inputs: vec![input(r, &[4, 5], dt, false, true)], args: Args { n: vec![3, 100, 0, 2], f: 0.15, ..Default::default() } },
            ]
        }, |t, a| {
            let tgt: Vec<i32> = a.n.iter().map(|&c| if c == 100 { -100 } else { c as i32 }).collect();
            let tgt = Tensor::from_vec(tgt, &[4], Device::Cpu)?.to_device(t[0].device())?;
            Ok(vec![t[0].cross_entropy(&tgt, a.f, Reduction::None)?, t[0].cross_entropy(&tgt, a.f, Reduction::Mean)?])
        }, |a, g, _| {
            let per: Vec<f64> = (0..4).map(|r| {
                let row = &a[0].v[r * 5..r * 5 + 5];
                let m = extreme(row, true);
                let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                if g.n[r] == 100 { 0.0 } else { (1.0 - g.f) * (lse - row[g.n[r]]) + g.f * (lse - row.iter().sum::<f64>() / 5.0) }
            }).collect();
            let count = g.n.iter().filter(|&&c| c != 100).count() as f64;
            vec![Arr::new(&[4], per.clone()), Arr::scalar(per.iter().sum::<f64>() / count)]
        })
        .grad(),
        op("cross_entropy_with", FLOATS, |r, dt| vec![sample(vec![input(r, &[3, 4], dt, false, false)])], |t, _| {
            let tgt = Tensor::from_vec(vec![2i32, 1, 2], &[3], Device::Cpu)?.to_device(t[0].device())?;
            let o = voltaic::CrossEntropyOpts { ignore_index: 1, label_smoothing: 0.0, reduction: Reduction::Sum };
            Ok(vec![t[0].cross_entropy_with(&tgt, &o)?])
        }, |a, _, _| {
            let lse = |r: usize| {
                let row = &a[0].v[r * 4..r * 4 + 4];
                let m = extreme(row, true);
                m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
            };
            vec![Arr::scalar(lse(0) - a[0].v[2] + lse(2) - a[0].v[10])]
        })
        .grad(),
        op("mse_loss", FLOATS, binary_samples, |t, _| Ok(vec![t[0].mse_loss(&t[1], Reduction::Sum)?, t[0].mse_loss(&t[1], Reduction::None)?]), |a, _, _| {
            let d = map2(a, |x, y| (x - y) * (x - y)).remove(0);
            vec![Arr::scalar(d.v.iter().sum()), d]
        })
        .grad()
        .slack(4.0),
        // Creation: values from arguments, and random numbers through their properties.
        op("zeros", ALL, no_input, |t, _| Ok(vec![Tensor::zeros(&[2, 3], t_dtype(t), dev(t))?]), |_, _, _| vec![Arr::new(&[2, 3], vec![0.0; 6])]),
        op("ones", ALL, no_input, |t, _| Ok(vec![Tensor::ones(&[0, 3], t_dtype(t), dev(t))?, Tensor::ones(&[3], t_dtype(t), dev(t))?]), |_, _, _| vec![Arr::new(&[0, 3], vec![]), Arr::new(&[3], vec![1.0; 3])]),
        op("full", NUMERIC, no_input, |t, _| Ok(vec![Tensor::full(&[2, 2], 7.0, t_dtype(t), dev(t))?]), |_, _, _| vec![Arr::new(&[2, 2], vec![7.0; 4])]),
        op("zeros_like", ALL, unary_samples, |t, _| Ok(vec![t[0].zeros_like()?]), |a, _, _| map1(a, |_| 0.0)),
        op("ones_like", ALL, unary_samples, |t, _| Ok(vec![t[0].ones_like()?]), |a, _, _| map1(a, |_| 1.0)),
        op("full_like", NUMERIC, unary_samples, |t, _| Ok(vec![t[0].full_like(3.0)?]), |a, _, _| map1(a, |_| 3.0)),
        op("arange", NUMERIC, no_input, |t, _| Ok(vec![Tensor::arange(-2.0, 5.0, 1.5, t_dtype(t), dev(t))?]), |_, _, dt| vec![Arr::new(&[5], [-2.0, -0.5, 1.0, 2.5, 4.0].iter().map(|&v| round_to(v, dt)).collect())]),
        op("linspace", FLOATS, no_input, |t, _| Ok(vec![Tensor::linspace(-1.0, 2.0, 7, t_dtype(t), dev(t))?]), |_, _, _| vec![Arr::new(&[7], (0..7).map(|i| -1.0 + 0.5 * i as f64).collect())]),
        op("eye", ALL, no_input, |t, _| Ok(vec![Tensor::eye(3, t_dtype(t), dev(t))?]), |_, _, _| vec![Arr::new(&[3, 3], (0..9).map(|i| (i % 4 == 0) as u8 as f64).collect())]),
        op("scalar", &[F32], no_input, |t, _| Ok(vec![Tensor::scalar(2.5f32, dev(t))?]), |_, _, _| vec![Arr::scalar(2.5)]),
        op("from_vec", &[F32], no_input, |t, _| Ok(vec![Tensor::from_vec(vec![1f32, 2.0, 3.0, 4.0], &[2, 2], dev(t))?]), |_, _, _| vec![Arr::new(&[2, 2], vec![1.0, 2.0, 3.0, 4.0])]),
        op("from_slice", &[I32], no_input, |t, _| Ok(vec![Tensor::from_slice(&[5i32, -6], &[2], dev(t))?]), |_, _, _| vec![Arr::new(&[2], vec![5.0, -6.0])]),
        op("rand", FLOATS, no_input, |t, _| {
            let r = Tensor::rand(&[1000], t_dtype(t), dev(t))?;
            Ok(vec![r.ge(0.0)?.logical_and(&r.lt(1.0)?)?])
        }, |_, _, _| vec![Arr::new(&[1000], vec![1.0; 1000])]),
        op("randn", FLOATS, no_input, |t, _| {
            let r = Tensor::randn(&[1000], t_dtype(t), dev(t))?;
            Ok(vec![r.eq(&r)?.logical_and(&r.abs()?.lt(10.0)?)?])
        }, |_, _, _| vec![Arr::new(&[1000], vec![1.0; 1000])]),
        op("rand_with", &[F32], no_input, |t, _| {
            let mut g = voltaic::Generator::new(5);
            let r = Tensor::rand_with(&mut g, &[100], F32, dev(t))?;
            Ok(vec![r.lt(1.0)?])
        }, |_, _, _| vec![Arr::new(&[100], vec![1.0; 100])]),
        op("randn_with", &[F32], no_input, |t, _| {
            let mut g = voltaic::Generator::new(5);
            Ok(vec![Tensor::randn_with(&mut g, &[100], F32, dev(t))?.abs()?.lt(10.0)?])
        }, |_, _, _| vec![Arr::new(&[100], vec![1.0; 100])]),
        op("bernoulli", FLOATS, |r, dt| vec![sample(vec![input(r, &[200], dt, false, false)])], |t, _| {
            let b = t[0].sigmoid()?.bernoulli()?;
            Ok(vec![b.eq(0.0)?.logical_or(&b.eq(1.0)?)?])
        }, |_, _, _| vec![Arr::new(&[200], vec![1.0; 200])]),
        op("bernoulli_with", &[F32], |r, dt| vec![sample(vec![input(r, &[200], dt, false, false)])], |t, _| {
            let mut g = voltaic::Generator::new(9);
            let ones = t[0].ones_like()?.bernoulli_with(&mut g)?;
            let zeros = t[0].zeros_like()?.bernoulli_with(&mut g)?;
            Ok(vec![ones, zeros])
        }, |a, _, _| vec![map1(a, |_| 1.0).remove(0), map1(a, |_| 0.0).remove(0)]),
        op("to_device", ALL, unary_samples, |t, _| Ok(vec![t[0].to_device(Device::Cpu)?.to_device(t[0].device())?]), |a, _, _| vec![a[0].clone()]).grad(),
        op("detach", FLOATS, unary_samples, |t, _| Ok(vec![t[0].detach()]), |a, _, _| vec![a[0].clone()]),
    ]
}

/// No inputs: the op creates its tensor (the sample's dtype and device come through a carrier).
fn no_input(_: &mut Rng, dt: DType) -> Vec<Sample> {
    vec![sample(vec![Input { arr: Arr::new(&[1], vec![0.0]), dtype: dt, strided: false }])]
}
fn t_dtype(t: &[Tensor]) -> DType {
    t[0].dtype()
}
fn dev(t: &[Tensor]) -> Device {
    t[0].device()
}

/// Pieces of `size` along `dim` (`count` empty ones for an empty dim, as chunk gives).
fn pieces(a: &Arr, dim: isize, size: usize, count: Option<usize>) -> Vec<Arr> {
    let dd = axes_of(&a.dims, &[dim])[0];
    let n = a.dims[dd];
    if n == 0 {
        return vec![a.clone(); count.unwrap_or(1)];
    }
    let st = strides(&a.dims);
    (0..n)
        .step_by(size)
        .map(|s| {
            let mut dims = a.dims.clone();
            dims[dd] = size.min(n - s);
            view(a, &dims, &st, s * st[dd])
        })
        .collect()
}

/// `softmax(q k^T / sqrt(D) + mask) v` over the leading dims, the mask
/// broadcast from the right.
fn attention_ref(q: &Arr, k: &Arr, v: &Arr, mask: &Arr) -> Arr {
    let r = q.dims.len();
    let (m, d, n, e) = (q.dims[r - 2], q.dims[r - 1], k.dims[r - 2], v.dims[r - 1]);
    let lead = &q.dims[..r - 2];
    let batch = numel(lead);
    let mut out = Vec::with_capacity(batch * m * e);
    for b in 0..batch {
        let mut idx = vec![0; r - 2];
        let mut rest = b;
        for i in (0..r - 2).rev() {
            idx[i] = rest % lead[i];
            rest /= lead[i];
        }
        let at = |x: &Arr, tail: [usize; 2]| {
            let mut full: Vec<usize> = idx.clone();
            full.extend(tail);
            // Broadcast dims of size 1 (the mask may have fewer dims: right-aligned).
            let off = full.len() - x.dims.len();
            let pos: Vec<usize> = x.dims.iter().enumerate().map(|(i, &s)| if s == 1 { 0 } else { full[off + i] }).collect();
            x.at(&pos)
        };
        for i in 0..m {
            let s: Vec<f64> = (0..n).map(|j| (0..d).map(|c| at(q, [i, c]) * at(k, [j, c])).sum::<f64>() / (d as f64).sqrt() + at(mask, [i, j])).collect();
            let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let total: f64 = w.iter().sum();
            out.extend((0..e).map(|c| (0..n).map(|j| w[j] * at(v, [j, c])).sum::<f64>() / total));
        }
    }
    let mut dims = lead.to_vec();
    dims.extend([m, e]);
    Arr::new(&dims, out)
}

fn matmul_ref(a: &Arr, b: &Arr, dt: DType) -> Arr {
    let (ad, bd) = (a.dims.clone(), b.dims.clone());
    let a2 = if ad.len() == 1 { vec![1, ad[0]] } else { ad.clone() };
    let b2 = if bd.len() == 1 { vec![bd[0], 1] } else { bd.clone() };
    let (m, k, n) = (a2[a2.len() - 2], a2[a2.len() - 1], b2[b2.len() - 1]);
    let batch = bcast_shape(&a2[..a2.len() - 2], &b2[..b2.len() - 2]).unwrap();
    let mut dims = batch.clone();
    dims.extend([m, n]);
    let mut v = vec![];
    for z in 0..numel(&batch) {
        let zi = unravel(z, &batch);
        let pa = bcast_pos(&zi, &a2[..a2.len() - 2]);
        let pb = bcast_pos(&zi, &b2[..b2.len() - 2]);
        for i in 0..m {
            for j in 0..n {
                let s = if dt.is_float() {
                    (0..k).map(|p| a.v[(pa * m + i) * k + p] * b.v[(pb * k + p) * n + j]).sum()
                } else {
                    let s: i128 = (0..k).map(|p| a.v[(pa * m + i) * k + p] as i128 * b.v[(pb * k + p) * n + j] as i128).sum();
                    if dt == U32 { s as u32 as f64 } else { s as i32 as f64 }
                };
                v.push(s);
            }
        }
    }
    let mut out = batch;
    if ad.len() > 1 {
        out.push(m);
    }
    if bd.len() > 1 {
        out.push(n);
    }
    Arr::new(&out, v)
}

fn conv_ref(x: &Arr, w: &Arr, b: &Arr, stride: usize, pad: usize, dil: usize, groups: usize) -> Arr {
    let [nb, cin, h, wd] = [x.dims[0], x.dims[1], x.dims[2], x.dims[3]];
    let [cout, cpg, kh, kw] = [w.dims[0], w.dims[1], w.dims[2], w.dims[3]];
    let oh = (h + 2 * pad - dil * (kh - 1) - 1) / stride + 1;
    let ow = (wd + 2 * pad - dil * (kw - 1) - 1) / stride + 1;
    let opg = cout / groups;
    let _ = cin;
    let mut v = vec![];
    for n in 0..nb {
        for co in 0..cout {
            let gi = co / opg;
            for y in 0..oh {
                for xx in 0..ow {
                    let mut s = b.v[co];
                    for ci in 0..cpg {
                        for ki in 0..kh {
                            for kj in 0..kw {
                                let iy = (y * stride + ki * dil) as isize - pad as isize;
                                let ix = (xx * stride + kj * dil) as isize - pad as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < wd {
                                    s += x.at(&[n, gi * cpg + ci, iy as usize, ix as usize]) * w.at(&[co, ci, ki, kj]);
                                }
                            }
                        }
                    }
                    v.push(s);
                }
            }
        }
    }
    Arr::new(&[nb, cout, oh, ow], v)
}

fn pool_samples(rng: &mut Rng, dt: DType) -> Vec<Sample> {
    let cases: &[(&[usize], [usize; 3], bool)] = &[(&[2, 3, 6, 4], [2, 2, 0], false), (&[1, 2, 7, 7], [3, 2, 1], true), (&[2, 5, 5], [3, 1, 1], false)];
    cases.iter().map(|&(s, n, strided)| Sample { inputs: vec![input(rng, s, dt, false, strided)], args: Args { n: n.to_vec(), ..Default::default() } }).collect()
}

fn pool_ref(x: &Arr, k: usize, stride: usize, pad: usize, max: bool) -> Arr {
    let unbatched = x.dims.len() == 3;
    let dims = if unbatched { [1, x.dims[0], x.dims[1], x.dims[2]] } else { [x.dims[0], x.dims[1], x.dims[2], x.dims[3]] };
    let [nb, c, h, w] = dims;
    let oh = (h + 2 * pad - k) / stride + 1;
    let ow = (w + 2 * pad - k) / stride + 1;
    let mut v = vec![];
    for n in 0..nb {
        for ch in 0..c {
            for y in 0..oh {
                for xx in 0..ow {
                    let mut vals = vec![];
                    for ki in 0..k {
                        for kj in 0..k {
                            let iy = (y * stride + ki) as isize - pad as isize;
                            let ix = (xx * stride + kj) as isize - pad as isize;
                            let inside = iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w;
                            let at = |c: usize| ((n * c + ch) * h + iy as usize) * w + ix as usize;
                            vals.push(if inside { x.v[at(c)] } else if max { f64::NEG_INFINITY } else { 0.0 });
                        }
                    }
                    v.push(if max { extreme(&vals, true) } else { vals.iter().sum::<f64>() / (k * k) as f64 });
                }
            }
        }
    }
    let out = if unbatched { vec![c, oh, ow] } else { vec![nb, c, oh, ow] };
    Arr::new(&out, v)
}

// ---- running the table ----

/// The first element outside `atol + rtol * |want|` (NaN matches NaN, infinities exactly).
fn first_mismatch(got: &[f64], want: &[f64], rtol: f64, atol: f64) -> Option<usize> {
    got.iter().zip(want).position(|(&g, &w)| {
        let ok = if w.is_nan() { g.is_nan() } else if w.is_infinite() { g == w } else { (g - w).abs() <= atol + rtol * w.abs() };
        !ok
    })
}

/// A tensor holding an input's values, built as a transposed view when asked.
fn build(i: &Input, dev: Device) -> Tensor {
    let t = if i.strided {
        let r = i.arr.dims.len();
        let mut d = i.arr.dims.clone();
        d.swap(r - 2, r - 1);
        let mut st = strides(&i.arr.dims);
        st.swap(r - 2, r - 1);
        let swapped = strided(&i.arr.v, &d, &st, 0);
        tensor(&swapped, &d, i.dtype).0.transpose(-1, -2).unwrap()
    } else {
        tensor(&i.arr.v, &i.arr.dims, i.dtype).0
    };
    t.to_device(dev).unwrap()
}

fn gpu() -> Device {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)");
    Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0))
}

fn tolerance(dt: DType, slack: f64) -> (f64, f64) {
    let (r, a) = tol(dt);
    (r * slack, a * slack)
}

/// Run every sample of one entry on `dev`; compare with the reference.
fn check_values(info: &OpInfo, dev: Device, rng: &mut Rng, failures: &mut Vec<String>) {
    for &dt in info.dtypes {
        if dev.is_gpu() && dt == F64 {
            continue;
        }
        for (si, s) in (info.samples)(rng, dt).into_iter().enumerate() {
            let what = format!("{} {dt} sample {si} on {dev}", info.name);
            let ins: Vec<Tensor> = s.inputs.iter().map(|i| build(i, dev)).collect();
            let got = match (info.run)(&ins, &s.args) {
                Ok(g) => g,
                Err(e) => {
                    failures.push(format!("{what}: {e}"));
                    continue;
                }
            };
            let arrs: Vec<Arr> = s.inputs.iter().map(|i| i.arr.clone()).collect();
            let want = (info.reference)(&arrs, &s.args, dt);
            if got.len() != want.len() {
                failures.push(format!("{what}: {} results, the reference has {}", got.len(), want.len()));
                continue;
            }
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                if g.dims() != w.dims.as_slice() {
                    failures.push(format!("{what} result {k}: shape {:?}, expected {:?}", g.dims(), w.dims));
                    continue;
                }
                if g.device() != dev {
                    failures.push(format!("{what} result {k}: on {}", g.device()));
                }
                let gv = match g.to_f64_vec() {
                    Ok(v) => v,
                    Err(e) => {
                        failures.push(format!("{what} result {k}: {e}"));
                        continue;
                    }
                };
                let odt = g.dtype();
                let wv: Vec<f64> = w.v.iter().map(|&x| round_to(x, odt)).collect();
                let (rt, at) = tolerance(odt, info.slack * if dev.is_gpu() { 4.0 } else { 1.0 });
                if let Some(bad) = first_mismatch(&gv, &wv, rt, at) {
                    failures.push(format!("{what} result {k} ({odt}): element {bad} is {}, expected {}", gv[bad], wv[bad]));
                }
            }
        }
    }
}

#[test]
fn every_op_matches_the_reference_on_the_cpu() {
    let mut failures = vec![];
    let mut rng = Rng::new(2026);
    for info in table() {
        check_values(&info, Device::Cpu, &mut rng, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n  {}", failures.len(), failures.join("\n  "));
}

#[test]
fn every_op_matches_the_reference_on_the_gpu() {
    let dev = gpu();
    let mut failures = vec![];
    let mut rng = Rng::new(2026);
    for info in table() {
        check_values(&info, dev, &mut rng, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n  {}", failures.len(), failures.join("\n  "));
}

/// `sum(f(x) * w)` gradients against central differences in f64 on the
/// CPU, and the f32 gradients on the GPU against the CPU's.
fn check_grad(info: &OpInfo, failures: &mut Vec<String>) {
    let mut rng = Rng::new(info.name.len() as u64 * 31 + 7);
    let gen = info.grad_values.unwrap_or(|r: &mut Rng| r.normal());
    for (si, s) in (info.samples)(&mut rng, F64).into_iter().enumerate() {
        let what = format!("{} sample {si}", info.name);
        // Float inputs become leaves with fresh smooth values; others stay as they are.
        let inputs: Vec<Input> = s
            .inputs
            .iter()
            .map(|i| if i.dtype == F64 { Input { arr: Arr::new(&i.arr.dims, (0..i.arr.v.len()).map(|_| gen(&mut rng)).collect()), ..i.clone() } } else { i.clone() })
            .collect();
        let leaves = |dev: Device, dt: DType, vals: &[Vec<f64>]| -> Vec<Tensor> {
            inputs
                .iter()
                .zip(vals)
                .map(|(i, v)| {
                    let ii = Input { arr: Arr::new(&i.arr.dims, v.clone()), dtype: if i.dtype == F64 { dt } else { i.dtype }, strided: i.strided };
                    let t = build(&ii, dev);
                    if i.dtype == F64 { t.requires_grad().unwrap() } else { t }
                })
                .collect()
        };
        let vals: Vec<Vec<f64>> = inputs.iter().map(|i| i.arr.v.clone()).collect();
        let xs = leaves(Device::Cpu, F64, &vals);
        let Ok(ys) = (info.run)(&xs, &s.args) else { continue };
        let ws: Vec<Vec<f64>> = ys.iter().map(|y| (0..y.numel()).map(|_| rng.normal()).collect()).collect();
        // f64 on the CPU; the GPU has no f64, so f32 there.
        let loss = |ys: &[Tensor]| -> Result<Tensor> {
            let dev = ys.first().map_or(Device::Cpu, |y| y.device());
            let ldt = if dev.is_gpu() { F32 } else { F64 };
            let mut l = Tensor::zeros(&[], ldt, dev)?;
            for (y, w) in ys.iter().zip(&ws) {
                if !y.dtype().is_float() || y.numel() == 0 {
                    continue;
                }
                let w = Tensor::from_vec(w.clone(), y.dims(), Device::Cpu)?.to_dtype(ldt)?.to_device(dev)?;
                l = l.add(&y.to_dtype(ldt)?.mul(&w)?.sum_all()?)?;
            }
            Ok(l)
        };
        let l = loss(&ys).unwrap();
        if !l.is_tracked() {
            continue;
        }
        if let Err(e) = l.backward() {
            failures.push(format!("{what}: backward: {e}"));
            continue;
        }
        let eval = |v: &[Vec<f64>]| loss(&(info.run)(&leaves(Device::Cpu, F64, v), &s.args).unwrap()).unwrap().item::<f64>().unwrap();
        let eps = 1e-6;
        let mut cpu_grads = vec![];
        for (i, x) in xs.iter().enumerate() {
            if inputs[i].dtype != F64 {
                continue;
            }
            let Some(g) = x.grad() else {
                failures.push(format!("{what}: input {i} got no gradient"));
                continue;
            };
            let got = g.to_vec::<f64>().unwrap();
            for j in 0..vals[i].len() {
                let (mut hi, mut lo) = (vals.clone(), vals.clone());
                hi[i][j] += eps;
                lo[i][j] -= eps;
                let want = (eval(&hi) - eval(&lo)) / (2.0 * eps);
                if (got[j] - want).abs() > 1e-5 * (1.0 + want.abs()) * info.slack {
                    failures.push(format!("{what}: d/dx{i}[{j}] is {}, finite differences give {want}", got[j]));
                    break;
                }
            }
            cpu_grads.push((i, got));
        }
        // The same gradient on the GPU (f32) as on the CPU.
        let gx = leaves(gpu(), F32, &vals);
        let Ok(gys) = (info.run)(&gx, &s.args) else { continue };
        let gl = loss(&gys).unwrap();
        if let Err(e) = gl.backward() {
            failures.push(format!("{what}: backward on the gpu: {e}"));
            continue;
        }
        for (i, want) in &cpu_grads {
            let got = gx[*i].grad().map(|g| g.to_f64_vec().unwrap()).unwrap_or_default();
            if got.len() != want.len() {
                failures.push(format!("{what}: the gpu gradient of input {i} has {} elements, the cpu's {}", got.len(), want.len()));
            } else if let Some(bad) = first_mismatch(&got, want, 1e-3 * info.slack, 1e-3 * info.slack) {
                failures.push(format!("{what}: d/dx{i}[{bad}] is {} on the gpu, {} on the cpu", got[bad], want[bad]));
            }
        }
    }
}

#[test]
fn every_differentiable_op_passes_gradcheck() {
    let mut failures = vec![];
    for info in table().iter().filter(|i| i.grad) {
        check_grad(info, &mut failures);
    }
    assert!(failures.is_empty(), "{} failures:\n  {}", failures.len(), failures.join("\n  "));
}

/// Public `Tensor` methods that are not ops (accessors, autograd plumbing,
/// realization), with why each needs no entry.
const NOT_OPS: &[(&str, &str)] = &[
    ("backward", "autograd: tested through every gradient check"),
    ("backward_with", "autograd: tests/grad.rs"),
    ("device", "accessor"),
    ("dims", "accessor"),
    ("dtype", "accessor"),
    ("grad", "autograd accessor"),
    ("is_contiguous", "accessor"),
    ("is_leaf", "autograd accessor"),
    ("is_realized", "accessor"),
    ("is_tracked", "autograd accessor"),
    ("item", "read-back: every check reads values"),
    ("item_f64", "read-back"),
    ("layout", "accessor"),
    ("new", "NoGradGuard::new, not a Tensor method"),
    ("numel", "accessor"),
    ("rank", "accessor"),
    ("realize", "realization"),
    ("realize_all", "realization"),
    ("requires_grad", "autograd: makes leaves for every gradient check"),
    ("same_storage", "accessor"),
    ("set_grad", "autograd: tests/grad.rs"),
    ("shape", "accessor"),
    ("size", "accessor"),
    ("stride", "accessor"),
    ("to_f64_vec", "read-back: every check reads values through it"),
    ("to_vec", "read-back"),
    ("zero_grad", "autograd: tests/grad.rs"),
];

#[test]
fn every_public_op_is_in_the_table() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut names = BTreeSet::new();
    let mut files = vec![src.join("tensor.rs"), src.join("autograd.rs")];
    for e in std::fs::read_dir(src.join("ops")).unwrap() {
        files.push(e.unwrap().path());
    }
    for f in files {
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            if let Some(rest) = line.strip_prefix("    pub fn ") {
                names.insert(rest.split(['(', '<']).next().unwrap().to_string());
            }
        }
    }
    // Methods the op tables generate: `Tensor method name ...` in each entry.
    let table_src = std::fs::read_to_string(src.join("primitive/table.rs")).unwrap();
    for line in table_src.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() >= 3 && w[0].chars().next().is_some_and(char::is_uppercase) && w[2].starts_with('"') && w[1].chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
            names.insert(w[1].to_string());
        }
    }
    assert!(names.len() > 100, "found only {} public methods", names.len());
    let covered: BTreeSet<String> = table().iter().map(|i| i.name.to_string()).chain(NOT_OPS.iter().map(|(n, _)| n.to_string())).collect();
    let missing: Vec<&String> = names.iter().filter(|n| !covered.contains(*n)).collect();
    assert!(missing.is_empty(), "public ops without an OpInfo entry (add them to the table in tests/opinfo.rs): {missing:?}");
    let stale: Vec<&String> = covered.iter().filter(|n| !names.contains(*n)).collect();
    assert!(stale.is_empty(), "table entries that are not public methods: {stale:?}");
}
