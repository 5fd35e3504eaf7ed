//! The one seam to the devices.
//!
//! Everything above this module (graph, scheduler, tensors) works with
//! [`Device`] values, buffers it cannot look into (`Buffer`), and the
//! `Executor` interface: run a plan, upload, read back, synchronize, memory
//! and device capabilities. This module is the only code that matches on the
//! device; each executor lives in its own folder (`cpu/`, `wgpu/`) and never
//! names another. Adding an executor means adding a folder, one arm in
//! `executor()` and, if it owns a new kind of memory, one arm of `Buffer`.
//!
//! Public here: the adapters wgpu finds ([`adapters`]), device counters
//! ([`DeviceStats`], [`MemoryStats`]) and [`save_caches`].

pub(crate) mod cpu;
pub(crate) mod wgpu;

pub use self::wgpu::{adapters, adapters_async, probe_gl, AdapterReport};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::ir::Plan;
use crate::layout::Layout;
use crate::storage::CpuStorage;
use std::sync::Arc;

/// A realized buffer, owned by the executor of its device.
#[derive(Clone, Debug)]
pub(crate) enum Buffer {
    /// Host memory (the CPU executor).
    Host(Arc<cpu::pool::HostBuf>),
    /// A pooled wgpu buffer.
    Wgpu(Arc<self::wgpu::pool::GpuBuf>),
}

impl Buffer {
    /// Whether two handles name the same buffer (not merely equal contents).
    pub fn same(&self, other: &Buffer) -> bool {
        match (self, other) {
            (Buffer::Host(a), Buffer::Host(b)) => Arc::ptr_eq(a, b),
            (Buffer::Wgpu(a), Buffer::Wgpu(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// What an executor offers the scheduler and the tensor layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Capabilities {
    /// Row-wise work (softmax, layer norm) is lowered to one-pass `Rows`
    /// kernels: worth it where a second read of a row costs memory
    /// bandwidth (a GPU); on a CPU the row stays in cache anyway.
    pub row_kernels: bool,
    /// Reads can walk any layout; otherwise a strided view is made
    /// contiguous on the device before it is read back.
    pub strided_reads: bool,
    /// A quantized matmul of many rows (a prompt) runs as its weight
    /// dequantized into a temporary and the dense matmul: worth it where
    /// the dense kernels are tuned for the hardware (a GPU's, 20x the
    /// dequantizing tiled kernel on an H100); the CPU dequantizes a tile at
    /// a time inside its product instead.
    pub dense_wide_qmatmul: bool,
    /// Runs [`crate::ir::KernelKind::Multi`] kernels: elementwise work of one
    /// shape with several outputs (a GPU, where each dispatch costs the host
    /// microseconds; the CPU runs such work as separate kernels).
    pub multi_output: bool,
    /// The most buffers one kernel may read (an executor's binding limit
    /// less what a kernel binds besides its inputs): fusion stops there.
    pub max_inputs: usize,
    /// Quantized products of at most this many rows (GEMVs) compute their
    /// left operand from the row-wise or elementwise work before them (an
    /// RMS norm, SwiGLU's `silu(gate) * up`; see [`crate::ir::Prologue`]):
    /// a GPU, where the dispatch it saves costs more than recomputing a
    /// row in each workgroup. 0: never.
    pub prologue_rows: usize,
    /// Elementwise work after an index kernel that makes its result in
    /// blocks (max pooling's gradient, fold) runs on each block as it is
    /// made, while it is in cache (a CPU: the ReLU's mask after pooling's
    /// gradient was a pass of its own over three image-sized tensors).
    pub index_epilogues: bool,
}

/// Bytes a device holds through Voltaic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in buffers that tensors (or running kernels) hold.
    pub in_use: u64,
    /// Bytes in freed buffers kept for reuse.
    pub cached: u64,
    /// Buffers created since the device was opened.
    pub allocations: u64,
    /// Buffer requests the pool served from its cache.
    pub hits: u64,
    /// Buffer requests that needed a fresh allocation.
    pub misses: u64,
    /// Cached buffers given back to the system to stay under the cap.
    pub evictions: u64,
    /// The most bytes the cache has held at once.
    pub peak_cached: u64,
}

impl MemoryStats {
    /// Share of buffer requests served from the cache (0 when none were made).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// Counters of one device, for tests and profiles.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceStats {
    /// Queue submissions so far (0 on the CPU).
    pub submissions: u64,
    /// Kernels (GPU: compute dispatches) run so far.
    pub dispatches: u64,
    /// Distinct kernels compiled so far (0 on the CPU).
    pub pipelines: u64,
    /// Bind groups created so far (0 on the CPU): a repeated step whose
    /// buffers are those of the step before creates none.
    pub bind_groups: u64,
    /// Memory held through the device's pool.
    pub memory: MemoryStats,
}

/// Values read back to the host, seen through a layout: the buffer itself
/// where the device is the host, else a copy.
pub(crate) struct HostView {
    data: HostData,
    pub layout: Layout,
}

pub(crate) enum HostData {
    Shared(Arc<cpu::pool::HostBuf>),
    Owned(CpuStorage),
    /// f32 values left in the memory the device copied them into (a GPU's
    /// mapped staging buffer), converted to a storage only if one is asked
    /// for: a gradient bucket is summed straight out of the mapping.
    Mapped(Box<dyn MappedF32>, std::sync::OnceLock<CpuStorage>),
}

/// f32 values in memory a device mapped for the host; the mapping is given
/// back when the value is dropped.
pub(crate) trait MappedF32: Send + Sync {
    /// The values.
    fn values(&self) -> &[f32];
}

impl HostView {
    /// The values (read through `layout`).
    pub fn storage(&self) -> &CpuStorage {
        match &self.data {
            HostData::Shared(b) => b,
            HostData::Owned(s) => s,
            HostData::Mapped(m, s) => s.get_or_init(|| CpuStorage::F32(m.values().to_vec())),
        }
    }

    /// The elements in row-major order as f32 values seen in place (no
    /// copy), where they are stored so (a contiguous f32 view, at any
    /// offset of its buffer); `None` otherwise.
    pub fn as_f32(&self) -> Option<&[f32]> {
        let values = match &self.data {
            HostData::Mapped(m, _) => m.values(),
            _ => match self.storage() {
                CpuStorage::F32(v) => v,
                _ => return None,
            },
        };
        if !self.layout.is_contiguous() {
            return None;
        }
        values.get(self.layout.offset()..self.layout.offset() + self.layout.numel())
    }

    /// Whether the values stayed in device-mapped memory.
    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.data, HostData::Mapped(..))
    }

    /// Elements in the memory behind the view.
    fn stored_len(&self) -> usize {
        match &self.data {
            HostData::Mapped(m, _) => m.values().len(),
            _ => self.storage().len(),
        }
    }

    /// The elements in row-major order as a `Vec<T>`: the copy read back
    /// itself where it is exactly that (no second copy), else gathered.
    pub fn into_vec<T: crate::storage::StorageElem>(self) -> Option<Vec<T>> {
        let whole = self.layout.is_contiguous() && self.layout.offset() == 0 && self.layout.numel() == self.stored_len();
        match self.data {
            HostData::Owned(s) if whole => T::unwrap(s),
            data => {
                let view = HostView { data, layout: self.layout };
                Some(view.layout.gather(T::slice(view.storage())?))
            }
        }
    }
}

/// Work handed to a device that finishes in the background. The blocking
/// and the async forms of a read (or of waiting for a realization) share
/// everything but this: `wait` blocks the thread (native only), `register`
/// asks to be woken instead (what a future does; the web's only way).
pub(crate) trait Completion: Send + Sync {
    /// Whether the work has finished (never blocks; may poll the device).
    fn is_done(&self) -> bool;
    /// Block until the work has finished.
    fn wait(&self) -> Result<()>;
    /// Wake `waker` once the work has finished.
    fn register(&self, waker: &std::task::Waker);
    /// The device's verdict once done: `Err` when the work failed.
    fn outcome(&self) -> Result<()>;
}

/// A future over a [`Completion`].
struct Completed<'a>(&'a dyn Completion);

impl std::future::Future for Completed<'_> {
    type Output = Result<()>;
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<()>> {
        if self.0.is_done() {
            return std::task::Poll::Ready(self.0.outcome());
        }
        self.0.register(cx.waker());
        // Done between the check and the registration: no wake would come.
        if self.0.is_done() {
            return std::task::Poll::Ready(self.0.outcome());
        }
        std::task::Poll::Pending
    }
}

/// Values on their way to the host: [`PendingRead::wait`] blocks for them,
/// [`PendingRead::finish`] awaits them.
pub(crate) struct PendingRead {
    completion: Option<Box<dyn Completion>>,
    collect: Box<dyn FnOnce() -> Result<HostView> + Send>,
}

impl PendingRead {
    /// Values already on the host.
    pub fn ready(view: HostView) -> PendingRead {
        PendingRead { completion: None, collect: Box::new(move || Ok(view)) }
    }

    /// Values that `collect` takes once `completion` is done.
    pub fn new(completion: Box<dyn Completion>, collect: Box<dyn FnOnce() -> Result<HostView> + Send>) -> PendingRead {
        PendingRead { completion: Some(completion), collect }
    }

    /// Block the thread until the values are here.
    pub fn wait(self) -> Result<HostView> {
        if let Some(c) = &self.completion {
            c.wait()?;
        }
        (self.collect)()
    }

    /// The values, without blocking the thread.
    pub async fn finish(self) -> Result<HostView> {
        if let Some(c) = &self.completion {
            Completed(&**c).await?;
        }
        (self.collect)()
    }
}

/// [`Executor::upload_f32_with`] through host memory: `fill` writes a
/// vector, which is uploaded.
pub(crate) fn upload_f32_through_host<E: Executor + ?Sized>(exec: &E, len: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<Buffer> {
    let mut v = vec![0f32; len];
    fill(&mut v)?;
    exec.upload(CpuStorage::F32(v))
}

/// Wait for a completion without blocking the thread (see [`Executor::completion`]).
pub(crate) async fn completed(c: Option<Box<dyn Completion>>) -> Result<()> {
    match c {
        Some(c) => Completed(&*c).await,
        None => Ok(()),
    }
}

/// The values of a buffer from [`Executor::upload_f32_later`], to come.
pub(crate) trait LaterFill: Send {
    /// Write the values with `fill` (write-only, as for
    /// [`Executor::upload_f32_with`]) and let the work waiting on them go.
    /// `fill` returns how many leading values it wrote: only those reach
    /// the device (the rest of the buffer is left undefined, for work that
    /// reads only what was written: a buffer sized for the most values
    /// costs the transfer of those given). Where `fill` fails the buffer
    /// holds NaN. Dropped unused, it holds NaN too: held-back work never
    /// waits forever.
    fn fill(self: Box<Self>, fill: &mut dyn FnMut(&mut [f32]) -> Result<usize>) -> Result<()>;
}

/// A device's executor.
/// The output buffers of a plan that is not run: an output that is one of
/// the plan's inputs is that buffer, any other a new one from `alloc`.
pub(crate) fn dry_outputs(plan: &Plan, inputs: &[Buffer], mut alloc: impl FnMut(crate::DType, usize) -> Result<Buffer>) -> Result<Vec<Buffer>> {
    plan.outputs
        .iter()
        .map(|&s| match plan.slots[s].source {
            crate::ir::SlotSource::Input(k) => Ok(inputs[k].clone()),
            crate::ir::SlotSource::Kernel => alloc(plan.slots[s].dtype, plan.slots[s].numel),
        })
        .collect()
}

pub(crate) trait Executor: Send + Sync {
    /// What the executor offers.
    fn capabilities(&self) -> Capabilities;
    /// Run `plan` with `inputs` (one per input slot, in order); returns the
    /// buffers of `plan.outputs`, in order.
    fn run(&self, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>>;
    /// What [`run`](Self::run) returns, without running anything: the
    /// plan's kernels made ready for a later run (compiled, where the
    /// executor compiles) and buffers of the outputs' sizes whose contents
    /// are undefined (see `voltaic::dry_run`). Here: zeroed host buffers.
    fn dry_run(&self, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
        dry_outputs(plan, inputs, |dtype, numel| self.upload(CpuStorage::zeros(dtype, numel)))
    }
    /// A new buffer holding `data`.
    fn upload(&self, data: CpuStorage) -> Result<Buffer>;
    /// Start reading the elements `layout` sees of `buf` back to the host.
    /// Without `strided_reads` the layout must be contiguous.
    fn read_start(&self, buf: &Buffer, layout: &Layout) -> Result<PendingRead>;
    /// As [`read_start`](Self::read_start) for a contiguous f32 view, but
    /// the values may stay in device-mapped memory (see
    /// [`HostView::as_f32`]) until the view is dropped: for a read consumed
    /// in place, that would otherwise be copied twice.
    fn read_start_in_place(&self, buf: &Buffer, layout: &Layout) -> Result<PendingRead> {
        self.read_start(buf, layout)
    }
    /// A new f32 buffer of `len` values that `fill` writes: into memory
    /// the device copies from (a GPU's mapped staging buffer) where it has
    /// such, so that the values are written once on the host. `fill` must
    /// only write: that memory may be write-combined (slow to read) or, on
    /// some backends (GL), undefined to read. It is not called at all when
    /// the upload fails first (out of memory, a lost device).
    fn upload_f32_with(&self, len: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<Buffer> {
        upload_f32_through_host(self, len, fill)
    }
    /// A new f32 buffer of `len` values that the returned [`LaterFill`]
    /// writes later, from any thread, while work that reads the buffer is
    /// recorded (and held back from the device until then). `None` where
    /// the executor cannot hold work back (it runs work as it is given, or
    /// its thread may not block): the caller uploads when the values exist.
    fn upload_f32_later(&self, _len: usize) -> Result<Option<(Buffer, Box<dyn LaterFill>)>> {
        Ok(None)
    }
    /// Everything given to the device so far, submitted; `None` when it has
    /// already finished (an executor that runs work as it is given).
    fn completion(&self) -> Result<Option<Box<dyn Completion>>>;
    /// Wait until all work submitted to the device has finished.
    fn synchronize(&self) -> Result<()> {
        match self.completion()? {
            Some(c) => c.wait(),
            None => Ok(()),
        }
    }
    /// Counters and memory.
    fn stats(&self) -> DeviceStats;
    /// Give cached memory back to the system.
    fn empty_cache(&self) -> Result<()>;
    /// Write on-disk caches (compiled kernels) now.
    fn save_caches(&self) {}
}

/// The executor of `device`, opening the device on first use.
pub(crate) fn executor(device: Device) -> Result<Arc<dyn Executor>> {
    match device {
        Device::Cpu => Ok(cpu::executor()),
        Device::Gpu(i) => Ok(self::wgpu::context(i)?),
    }
}

thread_local! {
    static READ_FOLLOWS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ONE_SUBMISSION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f`, a whole step of work that ends in a read of its result (a
/// decode step and the read of its token), telling executors to submit it
/// as one: a GPU keeps every realization of `f` in its pending batch,
/// however many dispatches it holds, and the read submits them with its
/// copy. Each submission costs the device a drain at its end; a loop that
/// runs one step ahead of its reads keeps the device busy meanwhile. Work
/// that would hold back too much freed memory is still submitted early.
pub(crate) fn one_submission<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&ONE_SUBMISSION, f)
}

/// Whether this thread's work is to be submitted as one (see [`one_submission`]).
pub(crate) fn is_one_submission() -> bool {
    ONE_SUBMISSION.with(|c| c.get())
}

/// Run `f` (a realization) telling executors that this thread reads a
/// result right after: a GPU then leaves the work for the read's submission
/// instead of submitting it alone (one submission instead of two).
pub(crate) fn read_follows<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&READ_FOLLOWS, f)
}

/// Run `f` with this thread's `flag` set, as it was again afterwards (also
/// when `f` unwinds).
fn with_flag<R>(flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>, f: impl FnOnce() -> R) -> R {
    struct Restore(&'static std::thread::LocalKey<std::cell::Cell<bool>>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(flag, flag.with(|c| c.replace(true)));
    f()
}

/// Whether the current realization is followed by a read (see [`read_follows`]).
pub(crate) fn is_read_following() -> bool {
    READ_FOLLOWS.with(|c| c.get())
}

/// Whether `VOLTAIC_PROFILE` asks for per-kernel times (read once).
pub(crate) fn profiling() -> bool {
    crate::profile::enabled()
}

/// Open another device like `device`: a second wgpu device on the same
/// adapter (its own queue and memory), numbered from `gpu:1000` up; the
/// CPU is shared and is returned as it is.
pub(crate) fn open_replica(device: Device) -> Result<Device> {
    match device {
        Device::Cpu => Ok(Device::Cpu),
        Device::Gpu(i) => Ok(Device::Gpu(self::wgpu::open_replica(i)?)),
    }
}

/// Write the on-disk caches of every open device now (they are also written
/// every few seconds while kernels compile). Call before a short program exits.
pub fn save_caches() {
    self::wgpu::save_caches();
}

/// Wait until the matmul autotuner has measured every shape it queued
/// (it runs in the background, beside the work it tunes). Benchmarks call
/// this before timing so that they time the tuned kernels.
pub fn finish_tuning() {
    self::wgpu::finish_tuning();
}

impl Device {
    /// The best device available: a real GPU when wgpu finds one, otherwise
    /// the native CPU executor. A software adapter (lavapipe, llvmpipe) is
    /// never chosen here: ask for it with `VOLTAIC_DEVICE=gpu` (`cpu`,
    /// `gpu`, `gpu:N`), which overrides the choice.
    pub fn best() -> Device {
        if let Ok(s) = std::env::var("VOLTAIC_DEVICE") {
            if let Ok(d) = Device::parse(&s) {
                return d;
            }
        }
        match adapters().iter().find(|a| !a.is_software()) {
            Some(a) => Device::Gpu(a.index),
            None => Device::Cpu,
        }
    }

    /// Bytes held on this device through Voltaic's buffer pool.
    pub fn memory_stats(self) -> Result<MemoryStats> {
        Ok(executor(self)?.stats().memory)
    }

    /// Counters of this device: submissions, kernels run, pipelines compiled, memory.
    pub fn stats(self) -> Result<DeviceStats> {
        Ok(executor(self)?.stats())
    }

    /// Give the buffers cached for reuse back to the system.
    pub fn empty_cache(self) -> Result<()> {
        executor(self)?.empty_cache()
    }

    /// Wait until all work submitted to this device has finished.
    pub fn synchronize(self) -> Result<()> {
        executor(self)?.synchronize()
    }

    /// Wait until all work submitted to this device has finished, without
    /// blocking the thread (the form the web needs).
    pub async fn synchronize_async(self) -> Result<()> {
        completed(executor(self)?.completion()?).await
    }

    /// The `n`-th GL adapter as a device (`gl:n`), looking for GL adapters
    /// first (they are not searched for otherwise while Vulkan, Metal or
    /// DX12 has adapters).
    pub fn gl(n: usize) -> Result<Device> {
        Ok(Device::Gpu(self::wgpu::gl_index(n)?))
    }

    /// Open `gpu:index` without blocking the thread: finds the adapters and
    /// creates the device through futures. On the web this must come before
    /// any GPU work (the blocking [`Device::Gpu`] path cannot open a device
    /// there); natively it is the async twin of the first use of `gpu:index`.
    ///
    /// ```no_run
    /// # async fn run() -> voltaic::Result<()> {
    /// let gpu = voltaic::Device::gpu_async(0).await?;
    /// let x = voltaic::Tensor::ones(&[4], voltaic::DType::F32, gpu)?;
    /// assert_eq!(x.sum_all()?.to_vec_async::<f32>().await?, vec![4.0]);
    /// # Ok(()) }
    /// ```
    pub async fn gpu_async(index: usize) -> Result<Device> {
        self::wgpu::context_async(index).await?;
        Ok(Device::Gpu(index))
    }

    /// The best device, without blocking the thread: as [`Device::best`]
    /// (`VOLTAIC_DEVICE` first, then the first hardware adapter, opened),
    /// except that on the web a software adapter counts too (the browser
    /// decides what it offers); the CPU when there is none.
    pub async fn best_async() -> Device {
        if let Some(d) = std::env::var("VOLTAIC_DEVICE").ok().and_then(|s| Device::parse(&s).ok()) {
            return match d {
                Device::Gpu(i) => Device::gpu_async(i).await.unwrap_or(Device::Cpu),
                d => d,
            };
        }
        let adapters = self::wgpu::adapters_async().await;
        let pick = adapters.iter().find(|a| !a.is_software() || cfg!(target_arch = "wasm32"));
        if let Some(a) = pick {
            if let Ok(d) = Device::gpu_async(a.index).await {
                return d;
            }
        }
        Device::Cpu
    }

    /// Fail unless tensors can be created and computed on this device.
    pub(crate) fn check_available(self, op: &'static str) -> Result<()> {
        executor(self).map(|_| ()).map_err(|e| match e {
            Error::Device { msg, .. } => Error::Device { op, msg },
            e => e,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::{Device, Tensor};

    /// A contiguous view at an offset of its buffer is seen in place on the
    /// CPU, where a read hands back the whole buffer and the view's layout.
    #[test]
    fn an_offset_view_is_seen_in_place() {
        let t = Tensor::from_vec((0..20).map(|i| i as f32).collect::<Vec<_>>(), &[4, 5], Device::Cpu).unwrap();
        let rows = t.narrow(0, 1, 2).unwrap();
        let view = rows.read_start_in_place().unwrap().wait().unwrap();
        assert_eq!(view.as_f32().unwrap(), &(5..15).map(|i| i as f32).collect::<Vec<_>>()[..]);
        // A strided view is made contiguous first.
        let cols = t.narrow(1, 1, 2).unwrap();
        let view = cols.read_start_in_place().unwrap().wait().unwrap();
        assert_eq!(view.as_f32().unwrap(), &[1.0, 2.0, 6.0, 7.0, 11.0, 12.0, 16.0, 17.0]);
    }
}
