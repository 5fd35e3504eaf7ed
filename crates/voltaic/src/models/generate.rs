//! Text generation with a [`Llama`]: prefill the prompt in one forward pass,
//! then one token per step, sampled greedily (on the device: only the
//! token id comes back) or with temperature, top-k, top-p and a repetition
//! penalty (on the host, from the logits), seeded and reproducible.

use super::llama::{KvCache, Llama};
use crate::error::{bail, Result};
use crate::rng::Generator;
use web_time::Instant;

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token). Otherwise logits are divided by it.
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f64,
    /// Divide positive logits (multiply negative ones) of tokens seen in the
    /// last `repeat_last_n` tokens by this (1: off), as llama.cpp does.
    pub repeat_penalty: f64,
    /// How far back the repetition penalty looks.
    pub repeat_last_n: usize,
    /// Seed of the sampler's random numbers.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling { temperature: 0.0, top_k: 0, top_p: 1.0, repeat_penalty: 1.0, repeat_last_n: 64, seed: 0 }
    }
}

impl Sampling {
    /// Whether the choice needs the logits on the host (anything but plain greedy).
    fn on_host(&self) -> bool {
        self.temperature > 0.0 || self.repeat_penalty != 1.0
    }

    fn check(&self) -> Result<()> {
        let ok = self.temperature >= 0.0 && self.temperature.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0 && self.repeat_penalty > 0.0;
        if !ok {
            bail!(Value, "generate", "temperature {} must be >= 0, top_p {} in (0, 1], repeat_penalty {} > 0", self.temperature, self.top_p, self.repeat_penalty);
        }
        Ok(())
    }

    /// Choose a token from host logits, given the tokens so far.
    pub fn choose(&self, logits: &mut [f32], history: &[u32], rng: &mut Generator) -> u32 {
        if self.repeat_penalty != 1.0 {
            let from = history.len().saturating_sub(self.repeat_last_n);
            let mut seen: Vec<u32> = history[from..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / self.repeat_penalty as f32 } else { *l * self.repeat_penalty as f32 };
                }
            }
        }
        let argmax = || logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32;
        if self.temperature == 0.0 {
            return argmax();
        }
        let mut cand: Vec<(u32, f64)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l as f64 / self.temperature)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.top_k > 0 {
            cand.truncate(self.top_k);
        }
        let max = cand[0].1;
        let mut total = 0.0;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            total += c.1;
        }
        let mut keep = cand.len();
        if self.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= self.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        cand.truncate(keep);
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut u = rng.uniform53(1)[0] * total;
        for c in &cand {
            u -= c.1;
            if u <= 0.0 {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// What a generation produced and how fast.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// The generated token ids (the EOS token included when it ended the text).
    pub tokens: Vec<u32>,
    /// Seconds of the prompt's forward pass (to the first token's id on the host).
    pub prefill_seconds: f64,
    /// Seconds of the steps after the first token.
    pub decode_seconds: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
}

impl Generation {
    /// Prompt tokens per second.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_seconds.max(1e-9)
    }
    /// Generated tokens per second after the first.
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

/// Generate up to `max_tokens` after `prompt`, stopping at `stop` (the EOS
/// token) or when `on_token` returns false; `on_token` sees each id as soon
/// as it is known (to stream text).
pub fn generate(model: &Llama, prompt: &[u32], max_tokens: usize, sampling: &Sampling, stop: Option<u32>, mut on_token: impl FnMut(u32) -> bool) -> Result<Generation> {
    sampling.check()?;
    if prompt.is_empty() {
        bail!(Value, "generate", "the prompt has no tokens");
    }
    let mut cache: KvCache = model.new_cache()?;
    let mut rng = Generator::new(sampling.seed);
    let mut history = prompt.to_vec();
    let mut out = Generation { prompt_tokens: prompt.len(), ..Default::default() };
    let next = |logits: crate::Tensor, history: &[u32], rng: &mut Generator| -> Result<u32> {
        if sampling.on_host() {
            let mut l = logits.to_vec::<f32>()?;
            Ok(sampling.choose(&mut l, history, rng))
        } else {
            Ok(logits.argmax(Some(0), false)?.item_f64()? as u32)
        }
    };
    let start = Instant::now();
    let mut step = Instant::now();
    let mut input: Vec<u32> = prompt.to_vec();
    while out.tokens.len() < max_tokens {
        let logits = model.forward(&input, &mut cache)?;
        let t = next(logits, &history, &mut rng)?;
        if out.tokens.is_empty() {
            out.prefill_seconds = start.elapsed().as_secs_f64();
            step = Instant::now();
        }
        out.tokens.push(t);
        history.push(t);
        let go_on = on_token(t);
        if Some(t) == stop || !go_on || cache.len() >= model.config.context {
            break;
        }
        input = vec![t];
    }
    if out.tokens.len() > 1 {
        out.decode_seconds = step.elapsed().as_secs_f64();
    }
    Ok(out)
}
