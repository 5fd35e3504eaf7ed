//! Files: safetensors (weights, checkpoints), GGUF (quantized language
//! models) and IDX (MNIST-style datasets).
//! Readers check every size and offset and never panic on malformed input;
//! writers never leave a half-written file behind.

pub mod gguf;
pub mod idx;
pub mod safetensors;

pub use crate::files::{cache_dir, remove_stale_temp_files, write_atomic};
