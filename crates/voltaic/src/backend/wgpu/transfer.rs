//! Moving data between host and GPU, and the optional per-kernel profile.

use super::codegen::{check_dtype, elem_bytes};
use super::context::GpuContext;
use super::pool::{alloc, GpuBuf};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::storage::CpuStorage;
use crate::backend::{Completion, HostData, LaterFill, MappedF32};
use half::{bf16, f16};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;

/// The bytes a host buffer takes on the GPU (see [`elem_bytes`]): the
/// buffer's own memory where it already is that, so an upload copies once
/// (into the queue's staging); bools are widened and an odd count of
/// 16-bit values padded (copies move whole 4-byte words).
fn to_gpu_bytes(s: &CpuStorage) -> std::borrow::Cow<'_, [u8]> {
    let plain: &[u8] = match s {
        CpuStorage::F32(x) => bytemuck::cast_slice(x),
        CpuStorage::I32(x) => bytemuck::cast_slice(x),
        CpuStorage::U32(x) => bytemuck::cast_slice(x),
        CpuStorage::F16(x) => bytemuck::cast_slice(x),
        CpuStorage::BF16(x) => bytemuck::cast_slice(x),
        CpuStorage::F64(x) => bytemuck::cast_slice(x),
        CpuStorage::Bool(x) => return x.iter().flat_map(|&b| (b as u32).to_le_bytes()).collect::<Vec<u8>>().into(),
    };
    if plain.len().is_multiple_of(4) {
        return plain.into();
    }
    let mut v = plain.to_vec();
    v.resize(v.len().next_multiple_of(4), 0);
    v.into()
}

fn from_gpu_bytes(dt: DType, b: &[u8], n: usize) -> CpuStorage {
    // 4-byte types in one copy, whatever the alignment.
    let four = &b[..(n * 4).min(b.len())];
    let halves = |b: &[u8]| b.chunks_exact(2).take(n).map(|c| u16::from_le_bytes([c[0], c[1]])).collect::<Vec<_>>().into_iter();
    match dt {
        DType::F32 => CpuStorage::F32(bytemuck::pod_collect_to_vec(four)),
        DType::I32 => CpuStorage::I32(bytemuck::pod_collect_to_vec(four)),
        DType::U32 => CpuStorage::U32(bytemuck::pod_collect_to_vec(four)),
        DType::Bool => CpuStorage::Bool(four.chunks_exact(4).map(|c| c != [0, 0, 0, 0]).collect()),
        DType::BF16 => CpuStorage::BF16(halves(b).map(bf16::from_bits).collect()),
        DType::F16 => CpuStorage::F16(halves(b).map(f16::from_bits).collect()),
        DType::F64 => CpuStorage::F64(b.chunks_exact(8).take(n).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()),
    }
}

/// Copy host data into a new GPU buffer (through the queue's write path).
pub(crate) fn upload(ctx: &GpuContext, s: &CpuStorage) -> Result<GpuBuf> {
    ctx.check_alive()?;
    check_dtype(&ctx.caps, s.dtype(), "to_device")?;
    let bytes = to_gpu_bytes(s);
    let buf = alloc(ctx, s.dtype(), s.len(), bytes.len() as u64)?;
    let size = bytes.len() as u64;
    // Large uploads go through staging buffers kept mapped between uploads
    // (see `GpuContext::record_upload`); the browser maps asynchronously
    // and keeps the queue's path.
    if cfg!(not(target_arch = "wasm32")) && (STAGED_UPLOAD_MIN..=KEPT_STAGING).contains(&size) {
        let (staging, err) = ctx.scoped(|| take_upload_staging(ctx, size));
        if let Some(e) = err {
            return Err(e);
        }
        staging
            .slice(..size)
            .get_mapped_range_mut()
            .map_err(|e| Error::Backend(format!("gpu:{}: mapping an upload buffer failed: {e:?}", ctx.index)))?
            .copy_from_slice(&bytes);
        staging.unmap();
        let ((), err) = ctx.scoped(|| ctx.record_upload(staging, buf.raw(), size));
        if let Some(e) = err {
            return Err(e);
        }
        return Ok(buf);
    }
    if !bytes.is_empty() {
        let ((), err) = ctx.scoped(|| ctx.queue.write_buffer(buf.raw(), 0, &bytes));
        if let Some(e) = err {
            return Err(e);
        }
    }
    Ok(buf)
}

/// Start reading elements `start..start + len` of a GPU buffer: the copy is
/// submitted and the staging buffer asked to map; the returned completion
/// says when the bytes have arrived, and the function turns them into
/// values. Also reports an index error that an index kernel flagged since
/// the last read.
pub(crate) fn download_start(
    ctx: &Arc<GpuContext>,
    buf: &GpuBuf,
    start: usize,
    len: usize,
    in_place: bool,
) -> Result<(Box<GpuCompletion>, impl FnOnce() -> Result<HostData> + Send + 'static)> {
    ctx.check_alive()?;
    let eb = elem_bytes(&ctx.caps, buf.dtype);
    let lo = (start as u64 * eb) & !3;
    let hi = ((start + len) as u64 * eb).next_multiple_of(4);
    let size = hi - lo;
    let staging_size = size + 16;
    let (staging, err) = ctx.scoped(|| take_staging(ctx, staging_size));
    if let Some(e) = err {
        return Err(e);
    }
    // The copies go at the end of the pending work (the realization this
    // read waits for, usually): one command buffer, one submission.
    let copy = |enc: &mut wgpu::CommandEncoder| {
        if size > 0 {
            enc.copy_buffer_to_buffer(buf.raw(), lo, &staging, 0, size);
        }
        enc.copy_buffer_to_buffer(&ctx.index_error, 0, &staging, size, 16);
    };
    let signal = Arc::new(Signal::default());
    // A step submitted as one (`backend::one_submission`) is handed with its
    // copy to the submitting thread, which finishes and submits it while
    // this one goes on; the mapping is asked for once that submission is
    // made (asked before, it could complete before the copy runs).
    let completion = if crate::backend::is_one_submission() && ctx.has_submitter() {
        let ticket = ctx.hand_off_recording(copy)?;
        Box::new(GpuCompletion::mapped_later(ctx.clone(), signal, Later { ticket, staging: staging.clone(), bytes: size + 16 }))
    } else {
        let idx = ctx.submit_recording(copy)?;
        if let Some(e) = ctx.take_uncaptured() {
            return Err(e);
        }
        // The mapping completes once the copy's submission has finished.
        map_into(&staging, size + 16, &signal);
        Box::new(GpuCompletion::new(ctx.clone(), Some(idx), signal))
    };
    let (ctx, dtype) = (ctx.clone(), buf.dtype);
    let collect = move || {
        // On the web, errors of the work read here arrive this way.
        if let Some(e) = ctx.take_uncaptured() {
            return Err(e);
        }
        let skip = (start as u64 * eb - lo) as usize;
        let (flags, values) = {
            let view = staging
                .get_mapped_range(..size + 16)
                .map_err(|e| Error::Backend(format!("gpu:{}: mapping a readback buffer failed: {e:?}", ctx.index)))?;
            let flags: Vec<u32> = view[size as usize..].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            // f32 values read in place stay in the mapping (aligned to at
            // least 8 bytes: wgpu's MAP_ALIGNMENT); others are converted
            // straight out of it (one copy).
            if flags[0] == 0 && in_place && dtype == DType::F32 && skip == 0 && bytemuck::try_cast_slice::<u8, f32>(&view[..len * 4]).is_ok() {
                return Ok(HostData::Mapped(Box::new(MappedRead { view: Some(view), staging: Some(staging), ctx, len }), Default::default()));
            }
            let values = (flags[0] == 0).then(|| from_gpu_bytes(dtype, &view[skip..size as usize], len));
            (flags, values)
        };
        staging.unmap();
        give_staging(&ctx, staging);
        if flags[0] != 0 {
            ctx.queue.write_buffer(&ctx.index_error, 0, &[0u8; 16]);
            return Err(Error::Index {
                op: crate::primitive::IndexOp::name_of_error_code(flags[3] & !super::kernels::UNSIGNED_INDEX),
                msg: format!(
                    "index {} is out of range for a dimension of size {} (found on gpu:{} when the values were read)",
                    if flags[3] & super::kernels::UNSIGNED_INDEX != 0 { flags[1] as i64 } else { flags[1] as i32 as i64 },
                    flags[2],
                    ctx.index
                ),
            });
        }
        Ok(HostData::Owned(values.expect("read when no index error was flagged")))
    };
    Ok((completion, collect))
}

/// f32 values read back and left in their staging buffer's mapping, which
/// is unmapped and kept for the next read when this is dropped.
struct MappedRead {
    view: Option<wgpu::BufferView>,
    staging: Option<wgpu::Buffer>,
    ctx: Arc<GpuContext>,
    len: usize,
}

impl MappedF32 for MappedRead {
    fn values(&self) -> &[f32] {
        let view = self.view.as_ref().expect("mapped until dropped");
        bytemuck::cast_slice(&view[..self.len * 4])
    }
}

impl Drop for MappedRead {
    fn drop(&mut self) {
        drop(self.view.take());
        if let Some(staging) = self.staging.take() {
            staging.unmap();
            give_staging(&self.ctx, staging);
        }
    }
}

/// A new f32 buffer of `len` values written by `fill` straight into a
/// kept, mapped upload staging buffer (one host write; see [`upload`]).
/// `None` where that path does not apply (small or huge, or the web):
/// the caller uploads from host memory instead.
pub(crate) fn upload_f32_with(ctx: &GpuContext, len: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<Option<GpuBuf>> {
    let size = len as u64 * 4;
    if cfg!(target_arch = "wasm32") || !(STAGED_UPLOAD_MIN..=KEPT_STAGING).contains(&size) {
        return Ok(None);
    }
    ctx.check_alive()?;
    let buf = alloc(ctx, DType::F32, len, size)?;
    let (staging, err) = ctx.scoped(|| take_upload_staging(ctx, size));
    if let Some(e) = err {
        return Err(e);
    }
    let filled = write_mapped(ctx.index, &staging, len, fill);
    staging.unmap();
    if let Err(e) = filled {
        // Mapped again for a later upload; nothing was recorded.
        ctx.recycle_uploads(vec![staging]);
        return Err(e);
    }
    let ((), err) = ctx.scoped(|| ctx.record_upload(staging, buf.raw(), size));
    if let Some(e) = err {
        return Err(e);
    }
    Ok(Some(buf))
}

/// Run `fill` on the first `len` f32 values of the mapped upload staging
/// buffer `staging`.
fn write_mapped(index: usize, staging: &wgpu::Buffer, len: usize, fill: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
    let size = len as u64 * 4;
    let mut view = staging
        .slice(..size)
        .get_mapped_range_mut()
        .map_err(|e| Error::Backend(format!("gpu:{index}: mapping an upload buffer failed: {e:?}")))?;
    let ptr = view.slice(..).as_raw_ptr().cast::<f32>();
    if !ptr.as_ptr().is_aligned() {
        return Err(Error::Backend(format!("gpu:{index}: an upload mapping is not aligned for f32")));
    }
    // SAFETY: the mapping holds `size` = 4 `len` writable bytes, aligned
    // for f32 (checked), and lives until `view` is dropped, after `fill`
    // returns. wgpu hands out only write access because the memory may be
    // write-combined, or (GL) undefined to read: `fill` only writes, as
    // `Executor::upload_f32_with` requires of it (the slice is a vehicle
    // for stores, never read through).
    let values = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
    fill(values)
}

/// A new f32 buffer of `len` values whose copy from mapped staging is
/// recorded now and whose values the returned [`LaterFill`] writes later,
/// from any thread (see `GpuContext::record_upload_later`). `None` in a
/// browser, whose thread may not block on the gate, and above the kept
/// staging size.
pub(crate) fn upload_f32_later(ctx: &GpuContext, len: usize) -> Result<Option<(GpuBuf, Box<dyn LaterFill>)>> {
    let size = len as u64 * 4;
    if cfg!(target_arch = "wasm32") || len == 0 || size > KEPT_STAGING {
        return Ok(None);
    }
    // Everything that can fail comes before the gate exists: a gate nobody
    // opens would hold every later submission.
    let shared = super::context(ctx.index)?;
    let buf = alloc(ctx, DType::F32, len, size)?;
    let (staging, err) = ctx.scoped(|| take_upload_staging(ctx, size));
    if let Some(e) = err {
        return Err(e);
    }
    let gate = ctx.record_upload_later(staging.clone());
    let dst = buf.raw().clone();
    Ok(Some((buf, Box::new(LaterUpload { ctx: shared, staging, dst, len, gate: Some(gate) }))))
}

/// The writing side of [`upload_f32_later`].
struct LaterUpload {
    ctx: Arc<GpuContext>,
    staging: wgpu::Buffer,
    /// The buffer the values are copied into. Were its tensor dropped
    /// first, the pool would not hand it out again before the held-back
    /// batch is submitted, after this copy (`Pool::defer`).
    dst: wgpu::Buffer,
    len: usize,
    /// Taken when opened.
    gate: Option<Arc<super::context::Gate>>,
}

impl LaterUpload {
    /// Write the values (NaN where `fill` fails), unmap, copy the values
    /// written to the device, open the gate and submit what waited for it.
    fn finish(&mut self, fill: &mut dyn FnMut(&mut [f32]) -> Result<usize>) -> Result<()> {
        if self.gate.is_none() {
            return Ok(());
        }
        // The gate is taken only after `fill` returns: if it panics, `Drop`
        // still finds it, writes NaN and opens it.
        let mut written = self.len;
        let mut filled = write_mapped(self.ctx.index, &self.staging, self.len, &mut |v| {
            written = fill(v)?;
            if written > v.len() {
                return Err(Error::Backend(format!("internal: {written} values written into an upload of {}", v.len())));
            }
            Ok(())
        });
        let Some(gate) = self.gate.take() else { return filled };
        if filled.is_err() {
            // Work that reads these values is already recorded: it must see
            // them as missing, not as whatever the staging memory held.
            written = self.len;
            let _ = write_mapped(self.ctx.index, &self.staging, self.len, &mut |v| {
                v.fill(f32::NAN);
                Ok(())
            });
        }
        self.staging.unmap();
        // The copy goes to the queue before the gate opens, ahead of the
        // held-back work that reads its values.
        if let Err(e) = self.ctx.submit_copy(&self.staging, &self.dst, written as u64 * 4) {
            filled = filled.and(Err(e));
        }
        gate.open();
        if let Err(e) = self.ctx.flush_opened() {
            filled = filled.and(Err(e));
        }
        filled
    }
}

impl LaterFill for LaterUpload {
    fn fill(mut self: Box<Self>, fill: &mut dyn FnMut(&mut [f32]) -> Result<usize>) -> Result<()> {
        self.finish(fill)
    }
}

impl Drop for LaterUpload {
    fn drop(&mut self) {
        // Dropped unwritten (its writer failed first): NaN, and the device
        // goes on.
        let _ = self.finish(&mut |_| Err(Error::Backend("never written".into())));
    }
}

/// Set once by a wgpu callback (a mapping, finished work), waking whoever
/// awaits it.
#[derive(Default)]
pub(crate) struct Signal {
    done: AtomicBool,
    error: Mutex<Option<String>>,
    waker: Mutex<Option<Waker>>,
}

impl Signal {
    pub(crate) fn set(&self, error: Option<String>) {
        let mut first = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = error;
        }
        drop(first);
        self.done.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.wake();
        }
    }

    fn is_set(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

/// Wait for `signal` after its work is known to be done: another thread's
/// poll may have collected the callback and not run it yet.
fn settle(ctx: &GpuContext, signal: &Signal) -> Result<()> {
    let start = web_time::Instant::now();
    while !signal.is_set() {
        if start.elapsed().as_secs() >= 30 {
            return Err(Error::Backend(format!("gpu:{}: the device finished the work but never reported it", ctx.index)));
        }
        let _ = ctx.device.poll(wgpu::PollType::Poll);
        std::thread::yield_now();
    }
    Ok(())
}

/// Work submitted to a GPU, done when its signal is set. Natively the
/// device must be polled for callbacks to run: `wait` spins and then sleeps
/// in the driver, and an awaiting future gets a thread that sleeps there
/// for it. The browser runs callbacks itself, so on the web nothing polls
/// (and nothing may block).
pub(crate) struct GpuCompletion {
    ctx: Arc<GpuContext>,
    /// The submission to wait for (`None`: everything submitted).
    idx: Mutex<Option<wgpu::SubmissionIndex>>,
    signal: Arc<Signal>,
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    waiter: AtomicBool,
    /// A read whose mapping is yet to be asked for.
    later: Mutex<Option<Later>>,
}

/// A staging buffer to map once the batch that copies into it is submitted.
pub(crate) struct Later {
    ticket: super::context::Ticket,
    staging: wgpu::Buffer,
    bytes: u64,
}

/// Ask for `staging`'s first `bytes` to be mapped, reporting to `signal`.
fn map_into(staging: &wgpu::Buffer, bytes: u64, signal: &Arc<Signal>) {
    let s2 = signal.clone();
    staging.map_async(wgpu::MapMode::Read, ..bytes, move |r| s2.set(r.err().map(|e| format!("reading a buffer back failed: {e}"))));
}

impl GpuCompletion {
    pub(crate) fn new(ctx: Arc<GpuContext>, idx: Option<wgpu::SubmissionIndex>, signal: Arc<Signal>) -> GpuCompletion {
        GpuCompletion { ctx, idx: Mutex::new(idx), signal, waiter: AtomicBool::new(false), later: Mutex::new(None) }
    }

    fn mapped_later(ctx: Arc<GpuContext>, signal: Arc<Signal>, later: Later) -> GpuCompletion {
        GpuCompletion { later: Mutex::new(Some(later)), ..GpuCompletion::new(ctx, None, signal) }
    }

    /// Ask for a later read's mapping once its batch is submitted (waiting
    /// for that when `block`); whether it is asked for (or was not needed).
    /// A failed submission is reported through the signal.
    fn ask_mapping(&self, block: bool) -> bool {
        let mut later = self.later.lock().unwrap_or_else(|e| e.into_inner());
        let Some(l) = later.as_ref() else { return true };
        match self.ctx.submission_of(&l.ticket, block) {
            Ok(None) => return false,
            Ok(Some(idx)) => {
                *self.idx.lock().unwrap_or_else(|e| e.into_inner()) = Some(idx);
                map_into(&l.staging, l.bytes, &self.signal);
            }
            Err(e) => self.signal.set(Some(e.to_string())),
        }
        *later = None;
        true
    }
}

impl Completion for GpuCompletion {
    fn is_done(&self) -> bool {
        if !self.ask_mapping(false) {
            return false;
        }
        #[cfg(not(target_arch = "wasm32"))]
        if !self.signal.is_set() {
            let _ = self.ctx.device.poll(wgpu::PollType::Poll);
        }
        self.signal.is_set()
    }

    fn wait(&self) -> Result<()> {
        if cfg!(target_arch = "wasm32") && !self.signal.is_set() {
            return Err(Error::Device {
                op: "to_vec",
                msg: "a browser cannot block for the GPU: use the async forms (to_vec_async, item_async, realize_async, \
                      Device::synchronize_async)"
                    .into(),
            });
        }
        self.ask_mapping(true);
        if !self.ctx.spin_until(&|_| self.signal.is_set())? {
            let idx = self.idx.lock().unwrap_or_else(|e| e.into_inner()).clone();
            self.ctx.wait(idx)?;
        }
        self.ctx.clear_in_flight();
        settle(&self.ctx, &self.signal)?;
        self.outcome()
    }

    fn register(&self, waker: &Waker) {
        self.ask_mapping(true);
        *self.signal.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(waker.clone());
        #[cfg(not(target_arch = "wasm32"))]
        if !self.waiter.swap(true, Ordering::AcqRel) {
            // Polls with short sleeps rather than one blocking wait: GL's
            // wait holds the adapter's context lock, and the task's thread
            // may submit more work meanwhile.
            let (device, signal) = (self.ctx.device.clone(), self.signal.clone());
            let started = std::thread::Builder::new().name("voltaic-wait".into()).spawn(move || {
                let mut pause = std::time::Duration::from_micros(20);
                while !signal.is_set() {
                    if let Err(e) = device.poll(wgpu::PollType::Poll) {
                        signal.set(Some(format!("polling the device failed: {e}")));
                        break;
                    }
                    if !signal.is_set() {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(std::time::Duration::from_millis(1));
                    }
                }
            });
            if started.is_err() {
                // No thread: poll again soon instead.
                waker.wake_by_ref();
            }
        }
    }

    fn outcome(&self) -> Result<()> {
        if let Some(e) = self.signal.error.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(Error::Backend(format!("gpu:{}: {e}", self.ctx.index)));
        }
        self.ctx.check_alive()
    }
}

/// Staging buffers up to this size are kept for the next read (64 MiB:
/// data-parallel training reads its 25 MiB gradient buckets every step, and
/// a fresh mapping costs page faults on both sides).
const KEPT_STAGING: u64 = 1 << 26;

/// Uploads from this size on go through kept staging buffers.
const STAGED_UPLOAD_MIN: u64 = 1 << 20;

/// The smallest of `kept` holding at least `size` bytes, taken out: a
/// small transfer taking the largest kept buffer would make the next large
/// one allocate (and map) a new one.
fn take_best_fit(kept: &Mutex<Vec<wgpu::Buffer>>, size: u64) -> Option<wgpu::Buffer> {
    let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
    let i = kept.iter().enumerate().filter(|(_, b)| b.size() >= size).min_by_key(|(_, b)| b.size())?.0;
    Some(kept.swap_remove(i))
}

/// A mapped upload staging buffer of at least `size` bytes: a kept one
/// (see `GpuContext::record_upload`) when one fits, else a new one.
fn take_upload_staging(ctx: &GpuContext, size: u64) -> wgpu::Buffer {
    take_best_fit(&ctx.upload_staging, size).unwrap_or_else(|| {
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("voltaic upload"),
            size: super::pool::bucket(size),
            usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        })
    })
}

/// A mappable buffer of at least `size` bytes: a kept one when it fits.
fn take_staging(ctx: &GpuContext, size: u64) -> wgpu::Buffer {
    if let Some(b) = take_best_fit(&ctx.staging, size) {
        return b;
    }
    let size = if size <= KEPT_STAGING { super::pool::bucket(size) } else { size };
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("voltaic readback"),
        size,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

fn give_staging(ctx: &GpuContext, b: wgpu::Buffer) {
    if b.size() <= KEPT_STAGING {
        let mut kept = ctx.staging.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < 4 {
            kept.push(b);
        }
    }
}

/// Map the first `len` bytes of a staging buffer after submission `idx`
/// and copy them out, blocking (timing and tuning: native tools).
fn map_read(ctx: &GpuContext, staging: &wgpu::Buffer, idx: wgpu::SubmissionIndex, len: usize) -> Result<Vec<u8>> {
    let signal = Arc::new(Signal::default());
    let s2 = signal.clone();
    staging.map_async(wgpu::MapMode::Read, ..len as u64, move |r| s2.set(r.err().map(|e| format!("reading a buffer back failed: {e}"))));
    GpuCompletion::new(super::context(ctx.index)?, Some(idx), signal).wait()?;
    let out = staging
        .get_mapped_range(..len as u64)
        .map_err(|e| Error::Backend(format!("gpu:{}: mapping a readback buffer failed: {e:?}", ctx.index)))?
        .to_vec();
    staging.unmap();
    Ok(out)
}

/// Timestamp queries around each kernel of one realization.
pub(crate) struct Timing {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    staging: wgpu::Buffer,
    /// Timestamp queries in the set.
    stamps: usize,
}

impl Timing {
    /// A pair of stamps (start, end) for each of `kernels` passes.
    pub(crate) fn new(ctx: &GpuContext, kernels: usize) -> Timing {
        Timing::with_stamps(ctx, 2 * kernels.max(1))
    }

    /// `stamps` timestamps, written where the caller chooses (inside a pass).
    pub(crate) fn with_stamps(ctx: &GpuContext, stamps: usize) -> Timing {
        let stamps = stamps.max(1);
        let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("voltaic profile"),
            ty: wgpu::QueryType::Timestamp,
            count: stamps as u32,
        });
        let bytes = 8 * stamps as u64;
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let staging = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Timing { set, resolve, staging, stamps }
    }

    pub(crate) fn writes(&self, kernel: usize) -> wgpu::ComputePassTimestampWrites<'_> {
        wgpu::ComputePassTimestampWrites {
            query_set: &self.set,
            beginning_of_pass_write_index: Some(2 * kernel as u32),
            end_of_pass_write_index: Some(2 * kernel as u32 + 1),
        }
    }

    pub(crate) fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        enc.resolve_query_set(&self.set, 0..self.stamps as u32, &self.resolve, 0);
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.staging, 0, 8 * self.stamps as u64);
    }

    /// Wait for submission `idx` and return the seconds from stamp `a` to
    /// stamp `b` for each pair of `spans`.
    fn spans(&self, ctx: &GpuContext, idx: wgpu::SubmissionIndex, spans: impl Iterator<Item = (usize, usize)>) -> Result<Vec<f64>> {
        let bytes = map_read(ctx, &self.staging, idx, 8 * self.stamps)?;
        let ticks: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let period = ctx.queue.get_timestamp_period() as f64;
        Ok(spans.map(|(a, b)| ticks[b].saturating_sub(ticks[a]) as f64 * period / 1e9).collect())
    }

    /// Wait for submission `idx` and return each pass's time in seconds.
    pub(crate) fn seconds(&self, ctx: &GpuContext, idx: wgpu::SubmissionIndex) -> Result<Vec<f64>> {
        self.spans(ctx, idx, (0..self.stamps / 2).map(|i| (2 * i, 2 * i + 1)))
    }

    /// The query set, for timestamps written inside a pass.
    pub(crate) fn set(&self) -> &wgpu::QuerySet {
        &self.set
    }

    /// [`Timing::report`] for stamps written in one pass: stamp 0 at its
    /// start and stamp k + 1 after kernel k.
    pub(crate) fn report_stamps(&self, ctx: &GpuContext, idx: wgpu::SubmissionIndex, rows: &[(String, usize)]) -> Result<()> {
        let secs = self.spans(ctx, idx, (0..rows.len()).map(|k| (k, k + 1)))?;
        self.print(ctx, rows, &secs);
        Ok(())
    }

    /// Wait for the realization and print one line per kernel to stderr.
    pub(crate) fn report(&self, ctx: &GpuContext, idx: wgpu::SubmissionIndex, rows: &[(String, usize)]) -> Result<()> {
        let secs = self.seconds(ctx, idx)?;
        self.print(ctx, rows, &secs);
        Ok(())
    }

    fn print(&self, ctx: &GpuContext, rows: &[(String, usize)], secs: &[f64]) {
        let mut total = 0.0;
        eprintln!("voltaic profile (gpu:{}, {}):", ctx.index, ctx.info.name);
        for (i, (label, numel)) in rows.iter().enumerate() {
            let us = secs[i] * 1e6;
            total += us;
            eprintln!("  {:>10.1} us  {:>12} elements  {label}", us, numel);
        }
        if rows.len() > 1 {
            eprintln!("  {total:>10.1} us  total over {} kernels", rows.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Device, Error, Tensor};

    fn gpu() -> Device {
        assert!(!crate::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)");
        Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0))
    }

    /// Values written by a fill, and values read in place, small (the host
    /// path) and large (the mapped staging path), also a strided view.
    #[test]
    fn in_place_reads_and_filled_uploads_carry_the_values() {
        let g = gpu();
        for n in [0usize, 5, (1 << 18) - 1, (1 << 19) + 5] {
            let value = |i: usize| ((i * 37) % 1009) as f32 * 0.25 - 100.0;
            let t = Tensor::from_f32_fill(n, g, &mut |dst: &mut [f32]| {
                assert_eq!(dst.len(), n);
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = value(i);
                }
                Ok(())
            })
            .unwrap();
            let want: Vec<f32> = (0..n).map(value).collect();
            assert_eq!(t.to_vec::<f32>().unwrap(), want, "{n} values uploaded by a fill");
            // Computed on the device, then read where the copy landed.
            let doubled = t.mul(2.0).unwrap();
            let view = doubled.read_start_in_place().unwrap().wait().unwrap();
            // Left in the staging buffer's mapping (a non-empty read).
            assert!(view.is_mapped(), "{n} values");
            let got = view.as_f32().expect("a contiguous f32 read is seen in place");
            assert_eq!(got.len(), n);
            assert!(got.iter().zip(&want).all(|(g, w)| *g == w * 2.0), "{n} values read in place");
            drop(view);
            // Unmapped when dropped: reads of it work again.
            assert_eq!(doubled.to_vec::<f32>().unwrap(), want.iter().map(|w| w * 2.0).collect::<Vec<_>>());
            assert_eq!(doubled.read_start_in_place().unwrap().wait().unwrap().as_f32().unwrap().len(), n);
        }
        // A strided view is made contiguous first.
        let m = Tensor::from_vec((0..600 * 700).map(|i| i as f32).collect::<Vec<_>>(), &[600, 700], g).unwrap();
        let tr = m.t().unwrap();
        let view = tr.read_start_in_place().unwrap().wait().unwrap();
        assert!(view.is_mapped());
        let got = view.as_f32().unwrap();
        assert_eq!(got.len(), 600 * 700);
        assert_eq!((got[0], got[1], got[600], got[601]), (0.0, 700.0, 1.0, 701.0));
        // Other dtypes are read as before.
        let ints = Tensor::from_vec(vec![3i32, -4], &[2], g).unwrap();
        let view = ints.read_start_in_place().unwrap().wait().unwrap();
        assert!(view.as_f32().is_none());
        assert_eq!(ints.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![3.0, -4.0]);
    }

    /// A fill that fails is the upload's error, and the next upload works.
    #[test]
    fn a_failing_fill_is_an_error_and_leaves_the_device_usable() {
        let g = gpu();
        let n = (1 << 19) + 1;
        let err = Tensor::from_f32_fill(n, g, &mut |_| Err(Error::Distributed { op: "all_reduce", msg: "a peer failed".into() })).unwrap_err();
        assert!(err.to_string().contains("a peer failed"), "{err}");
        let t = Tensor::from_f32_fill(n, g, &mut |d: &mut [f32]| {
            d.fill(1.5);
            Ok(())
        })
        .unwrap();
        assert_eq!(t.sum_all().unwrap().item::<f32>().unwrap(), 1.5 * n as f32);
    }

    /// Work recorded on a buffer whose values come later from another
    /// thread is held back until they arrive, and then sees them; other
    /// work recorded meanwhile is not lost; an unwritten or failed fill
    /// leaves NaN, never a hang.
    #[test]
    fn work_on_an_upload_to_come_waits_for_its_values() {
        let g = gpu();
        for n in [1usize, 1000, (1 << 19) + 3] {
            let (t, fill) = Tensor::from_f32_later(n, g).unwrap().expect("a native GPU holds work back");
            let doubled = t.mul(2.0).unwrap().add(1.0).unwrap();
            doubled.realize().unwrap();
            // Unrelated work recorded behind the gate.
            let other = Tensor::arange(0.0, 64.0, 1.0, DType::F32, g).unwrap().sqr().unwrap().sum_all().unwrap();
            other.realize().unwrap();
            let value = |i: usize| (i % 97) as f32 - 40.0;
            let writer = std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                fill.fill(&mut |dst: &mut [f32]| {
                    for (i, d) in dst.iter_mut().enumerate() {
                        *d = value(i);
                    }
                    Ok(dst.len())
                })
            });
            // Blocks until the writer is done.
            let got = doubled.to_vec::<f32>().unwrap();
            writer.join().unwrap().unwrap();
            assert!(got.iter().enumerate().all(|(i, v)| *v == value(i) * 2.0 + 1.0), "{n} values");
            assert_eq!(other.item::<f32>().unwrap(), (0..64).map(|i| (i * i) as f32).sum::<f32>());
        }
        // Many realizations behind the gate (finished into command buffers
        // in parts while it is closed) run in order once it opens.
        let (t, fill) = Tensor::from_f32_later(257, g).unwrap().unwrap();
        let mut x = t.clone();
        for _ in 0..150 {
            x = x.add(1.0).unwrap();
            x.realize().unwrap();
        }
        let y = x.narrow(0, 0, 1).unwrap().add(0.0).unwrap();
        y.realize().unwrap();
        fill.fill(&mut |d: &mut [f32]| {
            for (i, v) in d.iter_mut().enumerate() {
                *v = i as f32 * 1000.0;
            }
            Ok(d.len())
        })
        .unwrap();
        // Each step reads the one before: a part run early, late or twice
        // would read a buffer not yet (or no longer) holding its input.
        assert_eq!(x.to_vec::<f32>().unwrap(), (0..257).map(|i| i as f32 * 1000.0 + 150.0).collect::<Vec<_>>());
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![150.0]);
        // Only the values a fill says it wrote travel; the work that reads
        // them sees them.
        let (t, fill) = Tensor::from_f32_later(10_000, g).unwrap().unwrap();
        let head = t.narrow(0, 0, 4_001).unwrap().mul(2.0).unwrap();
        fill.fill(&mut |d: &mut [f32]| {
            for (i, x) in d[..4_001].iter_mut().enumerate() {
                *x = i as f32;
            }
            Ok(4_001)
        })
        .unwrap();
        assert!(head.to_vec::<f32>().unwrap().iter().enumerate().all(|(i, v)| *v == 2.0 * i as f32));
        // A fill claiming more values than the buffer holds is an error.
        let (t, fill) = Tensor::from_f32_later(30, g).unwrap().unwrap();
        assert!(fill.fill(&mut |d: &mut [f32]| Ok(d.len() + 1)).unwrap_err().to_string().contains("31 values written into an upload of 30"));
        assert!(t.to_vec::<f32>().unwrap().iter().all(|v| v.is_nan()));
        // Dropped unwritten, or written by a failing fill: NaN, and the device goes on.
        let (t, fill) = Tensor::from_f32_later(300, g).unwrap().unwrap();
        let y = t.add(1.0).unwrap();
        drop(fill);
        assert!(y.to_vec::<f32>().unwrap().iter().all(|v| v.is_nan()));
        let (t, fill) = Tensor::from_f32_later(300, g).unwrap().unwrap();
        let err = fill.fill(&mut |d: &mut [f32]| {
            d.fill(7.0);
            Err(Error::Distributed { op: "all_reduce", msg: "a peer failed".into() })
        });
        assert!(err.unwrap_err().to_string().contains("a peer failed"));
        assert!(t.to_vec::<f32>().unwrap().iter().all(|v| v.is_nan()));
        assert_eq!(Tensor::ones(&[5], DType::F32, g).unwrap().sum_all().unwrap().item::<f32>().unwrap(), 5.0);
    }
}
