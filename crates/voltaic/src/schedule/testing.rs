//! Small graphs for the passes' unit tests, built without the tensor layer.

use crate::backend::{executor, Capabilities};
use crate::device::Device;
use crate::dtype::DType;
use crate::graph::{Node, Op, OpKind, State, Value};
use crate::layout::Layout;
use crate::primitive::{BinaryOp, MapOp, ReduceOp, UnaryOp};
use crate::storage::CpuStorage;

/// Capabilities of the CPU executor (no row kernels).
pub(crate) fn cpu_caps() -> Capabilities {
    executor(Device::Cpu).unwrap().capabilities()
}

/// A realized f32 input of zeros on the CPU.
pub(crate) fn input(dims: &[usize]) -> Value {
    let n = dims.iter().product();
    let buf = executor(Device::Cpu).unwrap().upload(CpuStorage::zeros(DType::F32, n)).unwrap();
    Value { node: Node::new(State::Realized(buf), DType::F32, Device::Cpu, dims.to_vec(), 0), layout: Layout::contiguous(dims) }
}

fn pending(kind: OpKind, inputs: &[&Value], dims: &[usize]) -> Value {
    let op = Op { kind, inputs: inputs.iter().map(|v| (*v).clone()).collect() };
    Value { node: Node::pending(op, DType::F32, Device::Cpu, dims.to_vec()), layout: Layout::contiguous(dims) }
}

/// A scalar constant.
pub(crate) fn constant(c: f64) -> Value {
    pending(OpKind::Const(c), &[], &[])
}

/// A constant broadcast to `like`'s shape.
pub(crate) fn constant_like(like: &Value, c: f64) -> Value {
    broadcast(&constant(c), like.layout.dims())
}

/// `v` broadcast (as a view) to `dims`.
pub(crate) fn broadcast(v: &Value, dims: &[usize]) -> Value {
    Value { node: v.node.clone(), layout: v.layout.broadcast_to("test", dims).unwrap() }
}

/// The transpose (a view) of a 2-D value.
pub(crate) fn transpose(v: &Value) -> Value {
    Value { node: v.node.clone(), layout: v.layout.permute(&[1, 0]) }
}

pub(crate) fn unary(x: &Value, op: UnaryOp) -> Value {
    pending(OpKind::Map(MapOp::Unary(op)), &[x], x.layout.dims())
}

pub(crate) fn binary(a: &Value, b: &Value, op: BinaryOp) -> Value {
    pending(OpKind::Map(MapOp::Binary(op)), &[a, b], a.layout.dims())
}

/// A reduction keeping the reduced axes with size 1.
pub(crate) fn reduce(x: &Value, op: ReduceOp, axes: &[usize]) -> Value {
    let mut dims = x.layout.dims().to_vec();
    for &a in axes {
        dims[a] = 1;
    }
    pending(OpKind::Reduce(op, axes.to_vec()), &[x], &dims)
}

/// A 2-D matmul.
pub(crate) fn matmul(a: &Value, b: &Value) -> Value {
    let (m, n) = (a.layout.dims()[0], b.layout.dims()[1]);
    pending(OpKind::Matmul, &[a, b], &[m, n])
}

/// A realized quantized `[n, k]` matrix of `q` (its blocks as u32 words, zeros).
pub(crate) fn qweight(q: crate::quant::GgmlType, n: usize, k: usize) -> Value {
    let words = k / q.block().0 * q.padded_block_bytes() / 4;
    let buf = executor(Device::Cpu).unwrap().upload(CpuStorage::zeros(DType::U32, n * words)).unwrap();
    Value { node: Node::new(State::Realized(buf), DType::U32, Device::Cpu, vec![n, words], 0), layout: Layout::contiguous(&[n, words]) }
}

/// `x [m, k] @ w.t()` for `w` a quantized matrix of `q` with `n` rows (see [`qweight`]).
pub(crate) fn qmatmul(x: &Value, w: &Value, q: crate::quant::GgmlType, n: usize) -> Value {
    let m = x.layout.dims()[0];
    pending(OpKind::QMatmul(q), &[x, w], &[m, n])
}

/// `softmax(q k^T * scale + mask) v` over `q` `[b, m, d]`, `k` and `v`
/// `[b, n, d]`, `mask` `[m, n]` broadcast over the batch.
pub(crate) fn attention(q: &Value, k: &Value, v: &Value, mask: &Value) -> Value {
    attention_scaled(q, k, v, mask, 0.5)
}

/// [`attention`] with the scores scaled by `scale`.
pub(crate) fn attention_scaled(q: &Value, k: &Value, v: &Value, mask: &Value, scale: f64) -> Value {
    let d = q.layout.dims();
    let mask = broadcast(mask, &[d[0], d[1], k.layout.dims()[1]]);
    pending(OpKind::Index(crate::primitive::IndexOp::Attention { scale }), &[q, k, v, &mask], d)
}

/// col2im of 3x3 patches `[n, c, 3, 3, h, w]` (stride 1, padding 1) into `[n, c, h, w]`.
pub(crate) fn fold(patches: &Value) -> Value {
    let d = patches.layout.dims();
    let params = crate::primitive::UnfoldParams { kernel: [3, 3], stride: [1, 1], padding: [1, 1], dilation: [1, 1] };
    pending(OpKind::Index(crate::primitive::IndexOp::Fold { params, hw: [d[4], d[5]] }), &[patches], &[d[0], d[1], d[4], d[5]])
}

/// Kind names of the kernels that would realize `targets`.
pub(crate) fn kinds(targets: &[&Value], row_kernels: bool) -> Vec<&'static str> {
    let caps = Capabilities { row_kernels, ..cpu_caps() };
    super::summarize(targets, caps).into_iter().map(|k| k.kind).collect()
}
