//! LLaMA-family decoders read from GGUF files. So far: the hyperparameters,
//! read from the file's metadata and checked against its tensors.

use crate::error::{Error, Result};
use crate::io::gguf::GgufFile;

/// The hyperparameters of a LLaMA-family model, as its GGUF metadata gives
/// them (`{arch}.block_count`, `{arch}.attention.head_count`, ...).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// `general.architecture` (`llama`).
    pub architecture: String,
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Inner size of the SwiGLU feed-forward block.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Size of one head (`hidden / heads`).
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates.
    pub rope_dims: usize,
    /// RoPE's base frequency.
    pub rope_freq_base: f64,
    /// RMSNorm's epsilon.
    pub rms_eps: f64,
    /// Longest context the model was trained for.
    pub context: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Whether the output head reuses the token embedding (no `output.weight`).
    pub tied_output: bool,
}

impl LlamaConfig {
    /// Read and check the hyperparameters of `f`.
    pub fn from_gguf(f: &GgufFile) -> Result<LlamaConfig> {
        let arch = f.get_str("general.architecture")?.to_string();
        if arch != "llama" {
            return Err(Error::Format(format!("{}: general.architecture is {arch:?}; only llama-family models are supported", f.path().display())));
        }
        let n = |key: &str| -> Result<usize> { Ok(f.get_u64(&format!("{arch}.{key}"))? as usize) };
        let opt = |key: &str| f.metadata.contains_key(&format!("{arch}.{key}"));
        let (layers, hidden, ffn, heads) = (n("block_count")?, n("embedding_length")?, n("feed_forward_length")?, n("attention.head_count")?);
        let kv_heads = if opt("attention.head_count_kv") { n("attention.head_count_kv")? } else { heads };
        let bad = |msg: String| Error::Format(format!("{}: {msg}", f.path().display()));
        if layers == 0 || hidden == 0 || ffn == 0 || heads == 0 || kv_heads == 0 {
            return Err(bad(format!("block_count {layers}, embedding_length {hidden}, feed_forward_length {ffn}, head_count {heads}, head_count_kv {kv_heads}: all must be positive")));
        }
        if !hidden.is_multiple_of(heads) || !heads.is_multiple_of(kv_heads) {
            return Err(bad(format!("{heads} heads must divide embedding_length {hidden}, and {kv_heads} key/value heads must divide the heads")));
        }
        let head_dim = hidden / heads;
        let rope_dims = if opt("rope.dimension_count") { n("rope.dimension_count")? } else { head_dim };
        if rope_dims == 0 || rope_dims > head_dim || !rope_dims.is_multiple_of(2) {
            return Err(bad(format!("rope.dimension_count {rope_dims} must be even and at most the head size {head_dim}")));
        }
        let rope_freq_base = if opt("rope.freq_base") { f.get_f64(&format!("{arch}.rope.freq_base"))? } else { 10000.0 };
        let rms_eps = f.get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))?;
        let positive = |x: f64| x > 0.0 && x.is_finite();
        if !positive(rope_freq_base) || !positive(rms_eps) {
            return Err(bad(format!("rope.freq_base {rope_freq_base} and layer_norm_rms_epsilon {rms_eps} must be positive")));
        }
        let embd = f.tensor_info("token_embd.weight")?;
        let vocab = embd.dims()[0];
        if embd.dims() != [vocab, hidden] {
            return Err(bad(format!("token_embd.weight is {:?}, expected [vocab, {hidden}]", embd.dims())));
        }
        let tied_output = f.tensor_info("output.weight").is_err();
        let context = if opt("context_length") { n("context_length")? } else { 2048 };
        Ok(LlamaConfig {
            architecture: arch.clone(),
            layers,
            hidden,
            ffn,
            heads,
            kv_heads,
            head_dim,
            rope_dims,
            rope_freq_base,
            rms_eps,
            context,
            vocab,
            tied_output,
        })
    }
}
