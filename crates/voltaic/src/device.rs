//! Devices a tensor can live on. What a device can do is the business of
//! `backend`, which also implements the methods that need an executor
//! (`Device::best`, `synchronize`, `memory_stats`, ...).

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
    /// Whether this is a GPU device.
    pub fn is_gpu(self) -> bool {
        matches!(self, Device::Gpu(_))
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
            if kind == "gl" {
                if let Ok(n) = idx.parse() {
                    return Device::gl(n);
                }
            }
        }
        bail!(Value, "device", "cannot parse device {s:?}: expected cpu, gpu, gpu:N or gl:N")
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
