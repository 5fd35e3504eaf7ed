//! Reference models built from the `nn` blocks.

pub mod classifier;
