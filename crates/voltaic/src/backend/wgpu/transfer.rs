//! Moving data between host and GPU, and the optional per-kernel profile.

use super::codegen::{check_dtype, elem_bytes};
use super::context::GpuContext;
use super::pool::{alloc, GpuBuf};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::storage::CpuStorage;
use half::{bf16, f16};

/// The bytes a host buffer takes on the GPU (see [`elem_bytes`]).
fn to_gpu_bytes(s: &CpuStorage) -> Vec<u8> {
    let mut v: Vec<u8> = match s {
        CpuStorage::F32(x) => bytemuck::cast_slice(x).to_vec(),
        CpuStorage::I32(x) => bytemuck::cast_slice(x).to_vec(),
        CpuStorage::U32(x) => bytemuck::cast_slice(x).to_vec(),
        CpuStorage::F16(x) => bytemuck::cast_slice(x).to_vec(),
        CpuStorage::BF16(x) => x.iter().flat_map(|b| ((b.to_bits() as u32) << 16).to_le_bytes()).collect(),
        CpuStorage::Bool(x) => x.iter().flat_map(|&b| (b as u32).to_le_bytes()).collect(),
        CpuStorage::F64(x) => bytemuck::cast_slice(x).to_vec(),
    };
    // Copies move whole 4-byte words.
    v.resize(v.len().next_multiple_of(4), 0);
    v
}

fn from_gpu_bytes(dt: DType, b: &[u8], n: usize) -> CpuStorage {
    let words = |b: &[u8]| -> Vec<u32> { b.chunks_exact(4).take(n).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() };
    match dt {
        DType::F32 => CpuStorage::F32(words(b).into_iter().map(f32::from_bits).collect()),
        DType::I32 => CpuStorage::I32(words(b).into_iter().map(|w| w as i32).collect()),
        DType::U32 => CpuStorage::U32(words(b)),
        DType::Bool => CpuStorage::Bool(words(b).into_iter().map(|w| w != 0).collect()),
        DType::BF16 => CpuStorage::BF16(words(b).into_iter().map(|w| bf16::from_bits((w >> 16) as u16)).collect()),
        DType::F16 => CpuStorage::F16(b.chunks_exact(2).take(n).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()),
        DType::F64 => CpuStorage::F64(b.chunks_exact(8).take(n).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()),
    }
}

/// Copy host data into a new GPU buffer (through the queue's write path).
pub(crate) fn upload(ctx: &GpuContext, s: &CpuStorage) -> Result<GpuBuf> {
    ctx.check_alive()?;
    check_dtype(&ctx.caps, s.dtype(), "to_device")?;
    let bytes = to_gpu_bytes(s);
    let buf = alloc(ctx, s.dtype(), s.len(), bytes.len() as u64)?;
    if !bytes.is_empty() {
        let ((), err) = ctx.scoped(|| ctx.queue.write_buffer(buf.raw(), 0, &bytes));
        if let Some(e) = err {
            return Err(e);
        }
    }
    Ok(buf)
}

/// Read elements `start..start + len` of a GPU buffer. Also reports an index
/// error that an index kernel flagged since the last read.
pub(crate) fn download(ctx: &GpuContext, buf: &GpuBuf, start: usize, len: usize) -> Result<CpuStorage> {
    ctx.check_alive()?;
    let eb = elem_bytes(buf.dtype);
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
    let idx = ctx.submit_recording(|enc| {
        if size > 0 {
            enc.copy_buffer_to_buffer(buf.raw(), lo, &staging, 0, size);
        }
        enc.copy_buffer_to_buffer(&ctx.index_error, 0, &staging, size, 16);
    })?;
    if let Some(e) = ctx.take_uncaptured() {
        return Err(e);
    }
    let bytes = map_read(ctx, &staging, idx, size as usize + 16)?;
    ctx.clear_in_flight();
    give_staging(ctx, staging);
    let flags: Vec<u32> = bytes[size as usize..].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
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
    let skip = (start as u64 * eb - lo) as usize;
    Ok(from_gpu_bytes(buf.dtype, &bytes[skip..size as usize], len))
}

/// Staging buffers up to this size are kept for the next read.
const KEPT_STAGING: u64 = 1 << 24;

/// A mappable buffer of at least `size` bytes: a kept one when it fits.
fn take_staging(ctx: &GpuContext, size: u64) -> wgpu::Buffer {
    let mut kept = ctx.staging.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = kept.iter().position(|b| b.size() >= size) {
        return kept.swap_remove(i);
    }
    drop(kept);
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

/// Map the first `len` bytes of a staging buffer after submission `idx` and copy them out.
fn map_read(ctx: &GpuContext, staging: &wgpu::Buffer, idx: wgpu::SubmissionIndex, len: usize) -> Result<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let mapped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = mapped.clone();
    staging.map_async(wgpu::MapMode::Read, ..len as u64, move |r| {
        let _ = tx.send(r);
        flag.store(true, std::sync::atomic::Ordering::Release);
    });
    // The mapping completes once the copy's submission has finished.
    if !ctx.spin_until(&|_| mapped.load(std::sync::atomic::Ordering::Acquire))? {
        ctx.wait(Some(idx))?;
    }
    match rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(Error::Backend(format!("gpu:{}: reading a buffer back failed: {e}", ctx.index))),
        Err(_) => return Err(Error::Backend(format!("gpu:{}: the readback never completed", ctx.index))),
    }
    let view = staging
        .get_mapped_range(..len as u64)
        .map_err(|e| Error::Backend(format!("gpu:{}: mapping a readback buffer failed: {e:?}", ctx.index)))?;
    let out = view.to_vec();
    drop(view);
    staging.unmap();
    Ok(out)
}

/// Timestamp queries around each kernel of one realization.
pub(crate) struct Timing {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    staging: wgpu::Buffer,
    n: usize,
}

impl Timing {
    pub(crate) fn new(ctx: &GpuContext, kernels: usize) -> Timing {
        let n = kernels.max(1);
        let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("voltaic profile"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * n as u32,
        });
        let bytes = 16 * n as u64;
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
        Timing { set, resolve, staging, n }
    }

    pub(crate) fn writes(&self, kernel: usize) -> wgpu::ComputePassTimestampWrites<'_> {
        wgpu::ComputePassTimestampWrites {
            query_set: &self.set,
            beginning_of_pass_write_index: Some(2 * kernel as u32),
            end_of_pass_write_index: Some(2 * kernel as u32 + 1),
        }
    }

    pub(crate) fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        enc.resolve_query_set(&self.set, 0..2 * self.n as u32, &self.resolve, 0);
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.staging, 0, 16 * self.n as u64);
    }

    /// Wait for submission `idx` and return each pass's time in seconds.
    pub(crate) fn seconds(&self, ctx: &GpuContext, idx: wgpu::SubmissionIndex) -> Result<Vec<f64>> {
        let bytes = map_read(ctx, &self.staging, idx, 16 * self.n)?;
        let ticks: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let period = ctx.queue.get_timestamp_period() as f64;
        Ok((0..self.n).map(|i| ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * period / 1e9).collect())
    }

    /// Wait for the realization and print one line per kernel to stderr.
    pub(crate) fn report(&self, ctx: &GpuContext, idx: wgpu::SubmissionIndex, rows: &[(String, usize)]) -> Result<()> {
        let secs = self.seconds(ctx, idx)?;
        let mut total = 0.0;
        eprintln!("voltaic profile (gpu:{}, {}):", ctx.index, ctx.info.name);
        for (i, (label, numel)) in rows.iter().enumerate() {
            let us = secs[i] * 1e6;
            total += us;
            eprintln!("  {:>10.1} us  {:>12} elements  {label}", us, numel);
        }
        eprintln!("  {total:>10.1} us  total over {} kernels", rows.len());
        Ok(())
    }
}
