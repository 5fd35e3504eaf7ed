//! Text generation with a [`Llama`]: prefill the prompt in one forward pass,
//! then one token per step, sampled greedily (on the device: only the
//! token id comes back) or with temperature, top-k, top-p and a repetition
//! penalty (on the host, from the logits), seeded and reproducible.

use super::llama::{KvCache, Llama};
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::rng::Generator;
use crate::{Capture, Tensor};
use std::collections::VecDeque;
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
///
/// After the prompt's forward pass, each token is one decode step replayed
/// from a [`Capture`] (the step's graph is recorded and scheduled on its
/// first two calls per cache capacity only; the model keeps its captures
/// for later calls, as `torch.compile` keeps its graphs). Greedy decoding keeps the
/// sampled token on the device and feeds it straight to the next step; the
/// host reads each id back one step behind, so the device computes step
/// `n + 1` while the host waits for token `n` and encodes the next step.
pub fn generate(model: &Llama, prompt: &[u32], max_tokens: usize, sampling: &Sampling, stop: Option<u32>, mut on_token: impl FnMut(u32) -> bool) -> Result<Generation> {
    sampling.check()?;
    if prompt.is_empty() {
        bail!(Value, "generate", "the prompt has no tokens");
    }
    let mut out = Generation { prompt_tokens: prompt.len(), ..Default::default() };
    if max_tokens == 0 {
        return Ok(out);
    }
    let dev = model.device();
    let mut cache: KvCache = model.new_cache()?;
    let mut rng = Generator::new(sampling.seed);
    let mut history = prompt.to_vec();
    let greedy = !sampling.on_host();
    let start = Instant::now();
    let logits = model.forward(prompt, &mut cache)?;
    // The first token, on the device when greedy.
    let mut tok = if greedy { logits.argmax(Some(0), true)? } else { Tensor::zeros(&[1], DType::I32, dev)? };
    let first = if greedy { read_id(tok.read_start()?)? } else { sampling.choose(&mut logits.to_vec::<f32>()?, &history, &mut rng) };
    out.prefill_seconds = start.elapsed().as_secs_f64();
    let step_start = Instant::now();
    let mut last = first;
    let mut go_on = emit(&mut out, &mut history, first, stop, &mut on_token);
    let mut pos = Tensor::from_vec(vec![cache.len() as i32], &[1], dev)?;
    // Another thread's generation may hold the model's capture: then this one makes its own.
    let kept = model.decode.lock().unwrap_or_else(|e| e.into_inner()).take(greedy);
    let mut step = kept.unwrap_or_else(|| decode_step(model, greedy));
    // Greedy: reads of ids of steps already submitted, oldest first.
    let mut reads: VecDeque<crate::backend::PendingRead> = VecDeque::new();
    while go_on {
        let can_issue = out.tokens.len() + reads.len() < max_tokens && cache.len() < model.config.context;
        if can_issue {
            let need = cache.len() + 1;
            model.reserve(&mut cache, need)?;
            if !greedy {
                tok = Tensor::from_vec(vec![last as i32], &[1], dev)?;
            }
            // The step and the read of its result go to the device as one
            // submission (see `backend::one_submission`).
            let (head, read) = crate::backend::one_submission(|| -> Result<_> {
                let (head, next_pos) = run_step(&mut step, &tok, &pos, &mut cache)?;
                pos = next_pos;
                let read = head.read_start()?;
                Ok((head, read))
            })?;
            if greedy {
                tok = head;
                reads.push_back(read);
            } else {
                let mut logits: Vec<f32> = read.wait()?.into_vec().expect("f32 logits");
                last = sampling.choose(&mut logits, &history, &mut rng);
                go_on = emit(&mut out, &mut history, last, stop, &mut on_token);
                continue;
            }
        }
        // Keep `decode_ahead()` steps in flight ahead of the id being read.
        if reads.len() > decode_ahead() || !can_issue {
            let Some(r) = reads.pop_front() else { break };
            last = read_id(r)?;
            go_on = emit(&mut out, &mut history, last, stop, &mut on_token);
        }
    }
    if out.tokens.len() > 1 {
        out.decode_seconds = step_start.elapsed().as_secs_f64();
    }
    model.decode.lock().unwrap_or_else(|e| e.into_inner()).put(greedy, step);
    Ok(out)
}

/// A decode step's function: `(token, position, keys..., values...)` to
/// `(head, position + 1, keys..., values...)` (see [`decode_step`]).
type StepFn = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send>;

/// The decode steps a model keeps between generations: one for greedy
/// decoding (the next id on the device) and one for sampling (the logits).
#[derive(Default)]
pub(crate) struct DecodeCaptures {
    greedy: Option<Capture<StepFn>>,
    sampled: Option<Capture<StepFn>>,
}

impl DecodeCaptures {
    fn slot(&mut self, greedy: bool) -> &mut Option<Capture<StepFn>> {
        if greedy {
            &mut self.greedy
        } else {
            &mut self.sampled
        }
    }

    fn take(&mut self, greedy: bool) -> Option<Capture<StepFn>> {
        self.slot(greedy).take()
    }

    fn put(&mut self, greedy: bool, step: Capture<StepFn>) {
        *self.slot(greedy) = Some(step);
    }

    /// Both captures' counters, added.
    pub(crate) fn stats(&self) -> crate::CaptureStats {
        let mut sum = crate::CaptureStats::default();
        for c in [&self.greedy, &self.sampled].into_iter().flatten() {
            let s = c.stats();
            sum.eager_calls += s.eager_calls;
            sum.replays += s.replays;
            sum.captures += s.captures;
            sum.mismatches += s.mismatches;
        }
        sum
    }
}

impl std::fmt::Debug for DecodeCaptures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stats = |c: &Option<Capture<StepFn>>| c.as_ref().map(Capture::stats);
        f.debug_struct("DecodeCaptures").field("greedy", &stats(&self.greedy)).field("sampled", &stats(&self.sampled)).finish()
    }
}

/// Record token `t`; whether generation goes on.
fn emit(out: &mut Generation, history: &mut Vec<u32>, t: u32, stop: Option<u32>, on_token: &mut impl FnMut(u32) -> bool) -> bool {
    out.tokens.push(t);
    history.push(t);
    on_token(t) && Some(t) != stop
}

/// The id a read of a one-element i32 tensor gives.
fn read_id(r: crate::backend::PendingRead) -> Result<u32> {
    let v: Vec<i32> = r.wait()?.into_vec().expect("an i32 token id");
    Ok(v[0] as u32)
}

/// One decode step as a capture: `(token [1] i32, position [1] i32, keys...,
/// values...)` to `(the next token's id [1] i32 when greedy, else the logits
/// [vocab], position + 1, keys..., values...)`.
fn decode_step(model: &Llama, greedy: bool) -> Capture<StepFn> {
    let layers = model.config.layers;
    let model = model.detached();
    Capture::new(Box::new(move |x: &[Tensor]| {
        let (logits, k, v) = model.step(&x[0], &x[1], &x[2..2 + layers], &x[2 + layers..])?;
        let head = if greedy { logits.argmax(Some(0), true)? } else { logits };
        let mut out = vec![head, x[1].add(1i32)?];
        out.extend(k);
        out.extend(v);
        Ok(out)
    }))
}

/// Run the decode step for `tok` at `pos`, updating `cache`; the step's
/// head (next id or logits) and the next position.
fn run_step<F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>>(step: &mut Capture<F>, tok: &Tensor, pos: &Tensor, cache: &mut KvCache) -> Result<(Tensor, Tensor)> {
    let layers = cache.k.len();
    let mut args: Vec<&Tensor> = vec![tok, pos];
    args.extend(cache.k.iter().chain(&cache.v));
    let mut outs = step.call(&args)?;
    cache.v = outs.split_off(2 + layers);
    cache.k = outs.split_off(2);
    cache.len += 1;
    let next_pos = outs.pop().expect("the step returns the position");
    let head = outs.pop().expect("the step returns its head");
    Ok((head, next_pos))
}

/// Greedy decode steps submitted ahead of the one whose id is being read
/// (`VOLTAIC_DECODE_AHEAD`, at least 1; default 2). With one, the device
/// idled whenever the host's turn (recording and encoding the next step,
/// 0.2-0.4 ms, and waking from the wait) ran late: on the H200, SmolLM2
/// decoded at 891-968 tokens/s with one step ahead and 996-1,001 with two
/// in the same lease, its kernels unchanged. A stop token is seen up to
/// that many steps late; those steps' ids are dropped.
fn decode_ahead() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("VOLTAIC_DECODE_AHEAD").ok().and_then(|v| v.parse().ok()).unwrap_or(2).max(1))
}
