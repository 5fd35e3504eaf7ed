//! # Voltaic
//!
//! A PyTorch-shaped tensor library with a lazy graph: ops record nodes and
//! check shapes at once; realization fuses elementwise chains (and the
//! prologues of reductions) into single kernels, plans buffer lifetimes and
//! runs them on a device executor.
//!
//! ```
//! use voltaic::{Tensor, Device, DType};
//! voltaic::manual_seed(0);
//! let x = Tensor::randn(&[4, 8], DType::F32, Device::Cpu)?;
//! let p = x.softmax(-1)?;
//! let rows = p.sum(&[-1], false)?.to_vec::<f32>()?;
//! assert!(rows.iter().all(|s| (s - 1.0).abs() < 1e-5));
//! # Ok::<(), voltaic::Error>(())
//! ```
//!
//! ## A first program
//!
//! `examples/tensor_basics.rs` (`cargo run --release --example
//! tensor_basics`); the other examples show autograd, a custom module with
//! `#[derive(Module)]` trained with Adam and saved, Fashion-MNIST training and
//! MiniLM sentence embeddings, and `docs/PYTORCH.md` maps PyTorch calls to
//! Voltaic's.
//!
#![doc = concat!("```\n", include_str!("../examples/tensor_basics.rs"), "\n```")]

#![warn(missing_docs)]

// `#[derive(Module)]` names `::voltaic::nn::Module`; this lets the crate
// derive it for its own layers too.
extern crate self as voltaic;

// Layers, lowest first (ARCHITECTURE.md; `tests/layering.rs` checks that no
// module imports one above it).
mod device;
mod dtype;
mod error;
mod files;
mod profile;
pub mod quant;
mod qtensor;
mod layout;
mod rng;
mod shape;
mod storage;

pub mod primitive;

mod ir;

pub mod backend;

mod graph;

mod schedule;

mod realize;

mod autograd;
mod capture;
mod display;
pub mod ops;
mod tensor;

pub mod data;
pub mod distributed;
pub mod io;
pub mod models;
pub mod nn;
pub mod optim;

pub use autograd::{is_grad_enabled, no_grad, NoGradGuard};
pub use capture::{Capture, CaptureStats};
pub use ops::autocast::{autocast, autocast_dtype, AutocastGuard};
pub use backend::{DeviceStats, MemoryStats};
pub use device::Device;
pub use dtype::{DType, WithDType};
pub use error::{Error, Result};
pub use profile::{host_profile, HostProfile};
pub use realize::dry_run;
pub use schedule::cache::{clear_plan_cache, plan_cache_stats, set_plan_cache_limits, PlanCacheStats};
pub use schedule::KernelSummary;
pub use tensor::inspect;
pub use layout::Layout;
pub use ops::nn::{Conv2dOpts, CrossEntropyOpts, Reduction};
pub use ops::IntoOperand;
pub use rng::{manual_seed, rng_state, set_rng_state, Generator};
pub use shape::Shape;
pub use storage::{CpuStorage, StorageElem};
pub use tensor::Tensor;
pub use qtensor::{MatmulRhs, QTensor};

/// The names most programs need, for `use voltaic::prelude::*;`.
pub mod prelude {
    pub use crate::device::Device;
    pub use crate::dtype::DType;
    pub use crate::error::{Error, Result};
    pub use crate::nn::{self, Forward, Module, Parameter};
    pub use crate::ops::nn::Reduction;
    pub use crate::optim::{self, Optimizer};
    pub use crate::tensor::Tensor;
}
