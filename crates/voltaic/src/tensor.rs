//! The tensor handle, its creation functions and its accessors.
//!
//! The ops themselves live in `ops/`, grouped by kind.

use crate::backend::executor;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::graph::{Node, Op, OpKind, State, Value, MAX_PENDING_DEPTH};
use crate::layout::Layout;
use crate::rng::{self, Generator};
use crate::shape::checked_numel;
use crate::storage::{check_alloc, CpuStorage, StorageElem};
use std::sync::Arc;

/// An n-dimensional array: a cheap handle to a node of the lazy graph plus a
/// layout (shape, strides, offset) into that node's output.
///
/// Cloning is cheap. Ops record nodes and check shapes at once; nothing is
/// computed until values are needed (`to_vec`, `item`, `Display`, `realize`).
///
/// ```
/// use voltaic::{Tensor, Device};
/// let a = Tensor::from_vec(vec![1f32, 2., 3., 4.], &[2, 2], Device::Cpu)?;
/// let b = (a.t()? * 10.0)?.relu()?;
/// assert_eq!(b.to_vec::<f32>()?, vec![10., 30., 20., 40.]);
/// # Ok::<(), voltaic::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor {
    /// The graph node and the layout through which this tensor reads it.
    pub(crate) value: Value,
    /// Where this tensor sits in the graph of differentiation, if anywhere.
    pub(crate) grad: Option<Arc<crate::autograd::GradNode>>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:?}, {}, {}, node {}{})", self.dims(), self.dtype(), self.device(), self.value.node.id, if self.grad.is_some() { ", tracked" } else { "" })
    }
}

impl Tensor {
    // ---- construction of graph nodes ----

    /// A tensor over a new pending node computing `kind` from `inputs`.
    /// When the pending graph below it would grow past [`MAX_PENDING_DEPTH`],
    /// its inputs are realized first (together, in one realization). The
    /// inputs rather than the new node: a value used again later (a
    /// residual stream) would otherwise stay pending at that depth, and
    /// every later op over it would realize again.
    pub(crate) fn from_op(kind: OpKind, inputs: &[&Tensor], dtype: DType, device: Device, dims: Vec<usize>) -> Result<Tensor> {
        let pending_depth = |t: &&Tensor| if t.value.is_realized() { 0 } else { t.value.node.depth };
        if inputs.iter().map(pending_depth).max().unwrap_or(0) >= MAX_PENDING_DEPTH {
            Tensor::realize_all(inputs)?;
        }
        let op = Op { kind, inputs: inputs.iter().map(|t| t.value.clone()).collect() };
        let layout = Layout::contiguous(&dims);
        let node = Node::pending(op, dtype, device, dims);
        Ok(Tensor { value: Value { node, layout }, grad: None })
    }

    /// A tensor over realized host data.
    pub(crate) fn from_storage(storage: CpuStorage, dims: &[usize], device: Device) -> Result<Tensor> {
        let dtype = storage.dtype();
        Ok(Tensor::from_buffer(executor(device)?.upload(storage)?, dtype, dims, device))
    }

    /// A contiguous tensor over a realized buffer.
    fn from_buffer(buf: crate::backend::Buffer, dtype: DType, dims: &[usize], device: Device) -> Tensor {
        let node = Node::new(State::Realized(buf), dtype, device, dims.to_vec(), 0);
        Tensor { value: Value { node, layout: Layout::contiguous(dims) }, grad: None }
    }

    /// A view of the same node with another layout (not tracked: each view
    /// op records its own gradient).
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor { value: Value { node: self.value.node.clone(), layout }, grad: None }
    }

    // ---- creation ----

    /// A tensor from a Vec with the given shape.
    pub fn from_vec<T: StorageElem>(data: Vec<T>, shape: &[usize], device: Device) -> Result<Tensor> {
        let n = checked_numel("from_vec", shape)?;
        if data.len() != n {
            bail!(Shape, "from_vec", "{} elements cannot have shape {shape:?} ({n} elements)", data.len());
        }
        Tensor::from_storage(T::wrap(data), shape, device)
    }

    /// A tensor from a slice with the given shape (copies the data).
    pub fn from_slice<T: StorageElem>(data: &[T], shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-dimensional tensor holding one value.
    pub fn scalar<T: StorageElem>(value: T, device: Device) -> Result<Tensor> {
        Tensor::from_vec(vec![value], &[], device)
    }

    /// A tensor of `shape` filled with `value` (stored once and broadcast; no
    /// memory is used per element until the tensor is made contiguous).
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        checked_numel("full", shape)?;
        device.check_available("full")?;
        let c = Tensor::from_op(OpKind::Const(cast_scalar(value, dtype)), &[], dtype, device, vec![])?;
        c.broadcast_to(shape)
    }

    /// Zeros.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }

    /// Ones.
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// Zeros with this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.dims(), self.dtype(), self.device())
    }

    /// Ones with this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.dims(), self.dtype(), self.device())
    }

    /// A value with this tensor's dtype and device, broadcast to its shape.
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Tensor::full(self.dims(), value, self.dtype(), self.device())
    }

    /// `start, start + step, ...` up to but not including `end` (PyTorch `arange`).
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            bail!(Value, "arange", "expected finite start, end and a non-zero step, got start={start} end={end} step={step}");
        }
        let n = ((end - start) / step).ceil();
        if n < 0.0 {
            bail!(Value, "arange", "step {step} goes away from end: start={start} end={end}");
        }
        if n > (isize::MAX / 16) as f64 {
            bail!(Value, "arange", "too many elements: start={start} end={end} step={step}");
        }
        check_alloc(n as usize * 8)?;
        let v: Vec<f64> = (0..n as usize).map(|i| start + i as f64 * step).collect();
        Tensor::from_storage(CpuStorage::from_f64(dtype, &v), &[v.len()], device)
    }

    /// `steps` evenly spaced values from `start` to `end` inclusive.
    pub fn linspace(start: f64, end: f64, steps: usize, dtype: DType, device: Device) -> Result<Tensor> {
        checked_numel("linspace", &[steps])?;
        check_alloc(steps.saturating_mul(8))?;
        let v: Vec<f64> = (0..steps)
            .map(|i| {
                if steps == 1 {
                    start
                } else {
                    // Both halves computed from their own end, as PyTorch does, so the last value is exactly `end`.
                    let step = (end - start) / (steps - 1) as f64;
                    if i < steps / 2 {
                        start + step * i as f64
                    } else {
                        end - step * (steps - 1 - i) as f64
                    }
                }
            })
            .collect();
        Tensor::from_storage(CpuStorage::from_f64(dtype, &v), &[steps], device)
    }

    /// The `n` x `n` identity matrix.
    pub fn eye(n: usize, dtype: DType, device: Device) -> Result<Tensor> {
        let numel = checked_numel("eye", &[n, n])?;
        check_alloc(numel.saturating_mul(8))?;
        let mut v = vec![0.0; numel];
        for i in 0..n {
            v[i * n + i] = 1.0;
        }
        Tensor::from_storage(CpuStorage::from_f64(dtype, &v), &[n, n], device)
    }

    /// Uniform numbers in `[0, 1)` from the default generator (see [`crate::manual_seed`]).
    pub fn rand(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        rng::with_default(|g| Tensor::rand_with(g, shape, dtype, device))
    }

    /// Standard normal numbers from the default generator.
    pub fn randn(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        rng::with_default(|g| Tensor::randn_with(g, shape, dtype, device))
    }

    /// Uniform numbers in `[0, 1)` from a given generator.
    pub fn rand_with(g: &mut Generator, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        if !dtype.is_float() {
            bail!(DType, "rand", "expected a float dtype, got {dtype}");
        }
        let n = checked_numel("rand", shape)?;
        check_alloc(n.saturating_mul(8))?;
        let v = if dtype == DType::F64 { g.uniform53(n) } else { g.uniform(n) };
        // Rounding to f16/bf16 can reach 1.0; keep the half-open interval.
        let storage = CpuStorage::from_f64(dtype, &v);
        let t = Tensor::from_storage(storage, shape, device)?;
        if matches!(dtype, DType::F16 | DType::BF16) {
            let below = t.lt(1.0)?;
            return below.where_cond(&t, &t.full_like(0.0)?)?.contiguous();
        }
        Ok(t)
    }

    /// Standard normal numbers from a given generator.
    pub fn randn_with(g: &mut Generator, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        if !dtype.is_float() {
            bail!(DType, "randn", "expected a float dtype, got {dtype}");
        }
        let n = checked_numel("randn", shape)?;
        check_alloc(n.saturating_mul(8))?;
        Tensor::from_storage(CpuStorage::from_f64(dtype, &g.normal(n)), shape, device)
    }

    /// 1 with probability `self` (elementwise, values in `[0, 1]`), else 0, in `self`'s dtype.
    pub fn bernoulli(&self) -> Result<Tensor> {
        rng::with_default(|g| self.bernoulli_with(g))
    }

    /// [`Tensor::bernoulli`] with a given generator.
    pub fn bernoulli_with(&self, g: &mut Generator) -> Result<Tensor> {
        if !self.dtype().is_float() {
            bail!(DType, "bernoulli", "expected float probabilities, got {}", self.dtype());
        }
        let u = Tensor::rand_with(g, self.dims(), DType::F32, self.device())?;
        u.lt(&self.to_dtype(DType::F32)?)?.to_dtype(self.dtype())
    }

    // ---- accessors ----

    /// The shape.
    pub fn dims(&self) -> &[usize] {
        self.value.layout.dims()
    }
    /// The shape (PyTorch spelling).
    pub fn shape(&self) -> &[usize] {
        self.value.layout.dims()
    }
    /// Size of one dimension (negative counts from the end).
    pub fn size(&self, dim: isize) -> Result<usize> {
        let d = crate::shape::norm_axis("size", dim, self.rank())?;
        Ok(self.dims()[d])
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.value.layout.dims().len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.value.layout.numel()
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.value.node.dtype
    }
    /// Device.
    pub fn device(&self) -> Device {
        self.value.node.device
    }
    /// Strides in elements.
    pub fn stride(&self) -> &[usize] {
        self.value.layout.strides()
    }
    /// The layout into the node's buffer.
    pub fn layout(&self) -> &Layout {
        &self.value.layout
    }
    /// Row-major contiguous?
    pub fn is_contiguous(&self) -> bool {
        self.value.layout.is_contiguous()
    }
    /// Whether this tensor's node has been computed.
    pub fn is_realized(&self) -> bool {
        self.value.is_realized()
    }
    /// Do two tensors share the same underlying buffer (node)?
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.value.node, &other.value.node)
    }

    // ---- realization and reading ----

    /// Compute this tensor's node now (and everything pending below it).
    pub fn realize(&self) -> Result<&Tensor> {
        crate::realize::realize(&[&self.value])?;
        Ok(self)
    }

    /// Realize several tensors in one schedule, sharing their common work.
    pub fn realize_all(tensors: &[&Tensor]) -> Result<()> {
        let values: Vec<&Value> = tensors.iter().map(|t| &t.value).collect();
        crate::realize::realize(&values)
    }

    /// Realize this tensor and wait until the device has computed it,
    /// without blocking the thread (on a GPU, the future resolves when the
    /// submitted work has finished; the CPU computes it at once). The
    /// blocking [`Tensor::realize`] only hands the work to the device.
    pub async fn realize_async(&self) -> Result<&Tensor> {
        self.realize()?;
        crate::backend::completed(executor(self.device())?.completion()?).await?;
        Ok(self)
    }

    /// The elements in row-major order. `T` must be the tensor's dtype.
    /// Blocks until they are read back; see [`Tensor::to_vec_async`].
    pub fn to_vec<T: StorageElem>(&self) -> Result<Vec<T>> {
        Self::check_elem::<T>(self.dtype(), "to_vec")?;
        Ok(self.read_start()?.wait()?.into_vec().expect("dtype checked"))
    }

    /// The elements in row-major order, read back without blocking the
    /// thread: the form a browser needs (where [`Tensor::to_vec`] on a GPU
    /// tensor is an error), and a natively usable future too.
    ///
    /// ```
    /// # use voltaic::{Tensor, Device};
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], Device::Cpu)?;
    /// let v = pollster::block_on((&t * 2.0)?.to_vec_async::<f32>())?;
    /// assert_eq!(v, vec![2.0, 4.0, 6.0]);
    /// # Ok::<(), voltaic::Error>(())
    /// ```
    pub async fn to_vec_async<T: StorageElem>(&self) -> Result<Vec<T>> {
        Self::check_elem::<T>(self.dtype(), "to_vec_async")?;
        self.read_host_async(|s, l| l.gather(T::slice(s).expect("dtype checked"))).await
    }

    fn check_elem<T: StorageElem>(dtype: DType, op: &'static str) -> Result<()> {
        if T::DTYPE != dtype {
            bail!(DType, op, "the tensor holds {}, asked for {}; use to_dtype first", dtype, T::DTYPE);
        }
        Ok(())
    }

    /// The elements as f64, whatever the dtype, read back without blocking
    /// the thread.
    pub async fn to_f64_vec_async(&self) -> Result<Vec<f64>> {
        self.read_host_async(gather_f64).await
    }

    /// The only element of a one-element tensor, read back without blocking the thread.
    pub async fn item_async<T: StorageElem>(&self) -> Result<T> {
        if self.numel() != 1 {
            bail!(Shape, "item_async", "expected a tensor with one element, got shape {:?}", self.dims());
        }
        Ok(self.to_vec_async::<T>().await?[0])
    }

    /// The elements as f64, whatever the dtype (bools as 0/1).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        self.read_host(gather_f64)
    }

    /// Realize, then look at the values in host memory through a layout:
    /// the node's own buffer where the device is the host, else the viewed
    /// elements read back (made contiguous on the device first when the
    /// device cannot read strided views).
    pub(crate) fn read_host<R>(&self, f: impl FnOnce(&CpuStorage, &Layout) -> R) -> Result<R> {
        let host = self.read_start()?.wait()?;
        Ok(f(host.storage(), &host.layout))
    }

    /// [`Tensor::read_host`] without blocking the thread.
    pub(crate) async fn read_host_async<R>(&self, f: impl FnOnce(&CpuStorage, &Layout) -> R) -> Result<R> {
        let host = self.read_start()?.finish().await?;
        Ok(f(host.storage(), &host.layout))
    }

    /// Realize and start reading the values back: the part of a read that
    /// the blocking and the async forms share.
    pub(crate) fn read_start(&self) -> Result<crate::backend::PendingRead> {
        self.read_start_as(false)
    }

    /// [`Tensor::read_start`] for f32 values consumed in place: a GPU may
    /// leave them in its mapped staging memory (`HostView::as_f32`, which
    /// needs a contiguous view, so a strided one is made contiguous first).
    pub(crate) fn read_start_in_place(&self) -> Result<crate::backend::PendingRead> {
        self.read_start_as(true)
    }

    fn read_start_as(&self, in_place: bool) -> Result<crate::backend::PendingRead> {
        let exec = executor(self.device())?;
        let keep = self.is_contiguous() || (!in_place && exec.capabilities().strided_reads);
        let t = if keep { self.clone() } else { self.contiguous()? };
        crate::backend::read_follows(|| t.realize())?;
        if crate::realize::realized_dry(t.value.node.id) {
            bail!(Value, "read", "a {:?} {} tensor computed inside voltaic::dry_run was read there; a dry run compiles kernels without computing values", self.dims(), self.dtype());
        }
        let buf = t.value.node.buffer().expect("realized");
        if in_place {
            exec.read_start_in_place(&buf, &t.value.layout)
        } else {
            exec.read_start(&buf, &t.value.layout)
        }
    }

    /// A flat f32 tensor of `len` values written by `fill` on the host,
    /// straight into the memory the device uploads from where it has such
    /// (one host write instead of two).
    pub(crate) fn from_f32_fill(len: usize, device: Device, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<Tensor> {
        Ok(Tensor::from_buffer(executor(device)?.upload_f32_with(len, fill)?, DType::F32, &[len], device))
    }

    /// A flat f32 tensor of `len` values that the returned fill writes
    /// later, from any thread; work recorded on it meanwhile is held back
    /// from the device until then. `None` where the device cannot hold
    /// work back (see `Executor::upload_f32_later`).
    pub(crate) fn from_f32_later(len: usize, device: Device) -> Result<Option<(Tensor, Box<dyn crate::backend::LaterFill>)>> {
        Ok(executor(device)?.upload_f32_later(len)?.map(|(b, f)| (Tensor::from_buffer(b, DType::F32, &[len], device), f)))
    }

    /// The only element of a one-element tensor.
    pub fn item<T: StorageElem>(&self) -> Result<T> {
        if self.numel() != 1 {
            bail!(Shape, "item", "expected a tensor with one element, got shape {:?}", self.dims());
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// The only element, as f64.
    pub fn item_f64(&self) -> Result<f64> {
        if self.numel() != 1 {
            bail!(Shape, "item", "expected a tensor with one element, got shape {:?}", self.dims());
        }
        Ok(self.to_f64_vec()?[0])
    }

    /// Move to another device (a no-op when already there). The values are
    /// computed where they are, then copied.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        device.check_available("to_device")?;
        let host = self.read_host(|s, l| crate::storage::map_storage!(s, v => StorageElem::wrap(l.gather(v))))?;
        let from = self.device();
        Ok(Tensor::from_storage(host, self.dims(), device)?.track(&[self], move |g, _| Ok(vec![Some(g.to_device(from)?)])))
    }
}

/// The elements a layout sees, as f64 (bools as 0/1).
fn gather_f64(s: &CpuStorage, l: &Layout) -> Vec<f64> {
    let mut out = Vec::with_capacity(l.numel());
    l.for_each_offset(|o| out.push(s.get_f64(o)));
    out
}

/// Round a scalar to what the dtype can hold (for constants).
pub(crate) fn cast_scalar(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::Bool => (v != 0.0) as u8 as f64,
        DType::I32 => v as i32 as f64,
        DType::U32 => v as u32 as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        DType::F64 => v,
    }
}

/// The kernel summaries of the plan that would realize `tensors`, without
/// running it. Lets tests and tools see what fuses.
///
/// The plan is the one the tensors' device would run: on a GPU, row-wise
/// work such as softmax is one kernel.
pub fn inspect(tensors: &[&Tensor]) -> Vec<crate::schedule::KernelSummary> {
    let caps = match tensors.first().map(|t| executor(t.device())) {
        Some(Ok(e)) => e.capabilities(),
        _ => crate::backend::Capabilities { row_kernels: false, strided_reads: true, dense_wide_qmatmul: false, multi_output: false, max_inputs: usize::MAX, prologue_rows: 0, index_epilogues: true },
    };
    let values: Vec<&Value> = tensors.iter().map(|t| &t.value).collect();
    crate::schedule::summarize(&values, caps)
}
