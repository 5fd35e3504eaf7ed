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
    /// The best device available: a real GPU when one exists, otherwise the CPU.
    /// `VOLTAIC_DEVICE` (`cpu`, `gpu`, `gpu:N`) overrides the choice.
    pub fn best() -> Device {
        if let Ok(s) = std::env::var("VOLTAIC_DEVICE") {
            if let Ok(d) = Device::parse(&s) {
                return d;
            }
        }
        Device::Cpu
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
            Device::Gpu(i) => bail!(
                Device,
                op,
                "device gpu:{i} is not available: this build of Voltaic has no GPU executor yet; use Device::Cpu"
            ),
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
