//! Reference models built from the `nn` blocks.

pub mod bert;
pub mod classifier;
pub mod generate;
pub mod gguf_tokenizer;
pub mod llama;
