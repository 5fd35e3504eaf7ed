//! Devices a tensor can live on.

use crate::error::{bail, Result};

/// Where a tensor's data lives and where its kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The native CPU executor (rayon + gemm).
    Cpu,
    /// The wgpu adapter with this index (see `voltaic devices`).
    Gpu(usize),
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
        match crate::gpu::best_hardware() {
            Some(i) => Device::Gpu(i),
            None => Device::Cpu,
        }
    }

    /// Whether this is a GPU device.
    pub fn is_gpu(self) -> bool {
        matches!(self, Device::Gpu(_))
    }

    /// Bytes held on this device through Voltaic's GPU buffer pool (zeros on the CPU).
    pub fn memory_stats(self) -> Result<crate::gpu::MemoryStats> {
        match self {
            Device::Cpu => Ok(Default::default()),
            Device::Gpu(i) => Ok(crate::gpu::stats(i)?.memory),
        }
    }

    /// Give the GPU buffers cached for reuse back to the driver.
    pub fn empty_cache(self) -> Result<()> {
        if let Device::Gpu(i) = self {
            crate::gpu::context(i)?.pool.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
        Ok(())
    }

    /// Wait until all work submitted to this device has finished.
    pub fn synchronize(self) -> Result<()> {
        if let Device::Gpu(i) = self {
            let c = crate::gpu::context(i)?;
            c.wait(None)?;
            c.clear_in_flight();
        }
        Ok(())
    }

    /// Parse `cpu`, `gpu` or `gpu:N` (also `cuda`/`cuda:N`, as PyTorch users type).
    pub fn parse(s: &str) -> Result<Device> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "gpu" | "cuda" | "wgpu" => return Ok(Device::Gpu(0)),
            _ => {}
        }
        if let Some((kind, idx)) = s.split_once(':') {
            if matches!(kind, "gpu" | "cuda" | "wgpu") {
                if let Ok(i) = idx.parse() {
                    return Ok(Device::Gpu(i));
                }
            }
        }
        bail!(Value, "device", "cannot parse device {s:?}: expected cpu, gpu or gpu:N")
    }

    /// Fail unless tensors can be created and computed on this device.
    pub(crate) fn check_available(self, op: &'static str) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Gpu(i) => crate::gpu::context(i).map(|_| ()).map_err(|e| match e {
                crate::Error::Device { msg, .. } => crate::Error::Device { op, msg },
                e => e,
            }),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Gpu(i) => write!(f, "gpu:{i}"),
        }
    }
}
