//! The LLM suite: SmolLM2-135M-Instruct (Q4_1, the default GGUF of
//! `voltaic generate`) prefilling a 128-token prompt and decoding 128 tokens
//! greedily at batch 1. Peers, in the same run on the same machine: on the
//! CPU llama.cpp (the PyPI package `llama-cpp-python`, same file, same
//! threads); on a GPU a plain PyTorch forward of the same architecture over
//! the dequantized weights in f16, eager and under
//! `torch.compile(mode="reduce-overhead")` with a static KV cache.
//!
//! Both sides get the same token ids and read each generated token id back
//! to the host (a generation loop streams its tokens). Voltaic's decode row
//! runs `voltaic generate`'s loop, which reads each id one step behind the
//! device; the PyTorch peer is timed both ways (reading each id before the
//! next step, and one step behind with the id kept on the device) and the
//! faster counts.

use anyhow::{bail, ensure, Context};
use std::process::Command;
use std::time::Instant;
use voltaic::models::generate::{generate, Sampling};
use voltaic::models::llama::Llama;
use voltaic::{Device, Tensor};

pub const CASES: &[&str] = &["llm_prefill_128", "llm_decode_b1"];

/// Prompt tokens of `llm_prefill_128`.
const PREFILL: usize = 128;
/// Prompt tokens before `llm_decode_b1`'s timed steps.
const DECODE_PROMPT: usize = 16;
/// Tokens `llm_decode_b1` generates.
const DECODE: usize = 128;

const TORCH_PEER: &str = include_str!("llm_peer_torch.py");
const LLAMA_CPP_PEER: &str = include_str!("llm_peer_llamacpp.py");

/// Timed runs per row: a decode row takes seconds on a CPU.
pub fn runs(runs: usize) -> usize {
    runs.clamp(1, 5)
}

/// The prompt: fixed pseudo-random ids of ordinary tokens (the first 1000
/// ids of SmolLM2's vocabulary hold the special and byte tokens).
fn prompt_ids(vocab: usize) -> Vec<u32> {
    let mut g = voltaic::Generator::new(17);
    g.uniform(PREFILL).iter().map(|u| 1000 + (u * (vocab.min(40_000) - 1000) as f64) as u32).collect()
}

/// The model file: `$VOLTAIC_LLM_MODEL` or the installed SmolLM2.
fn model_path() -> anyhow::Result<std::path::PathBuf> {
    voltaic::models::llama::smollm2_path().context("the llm suite runs SmolLM2-135M-Instruct (see `voltaic generate --help`)")
}

/// Run the peer for `device`: llama.cpp on the CPU, PyTorch on a GPU.
pub fn peer(cases: &[&str], runs: usize, device: Device) -> anyhow::Result<super::Peer> {
    let path = model_path()?;
    let vocab = voltaic::io::gguf::GgufFile::open(&path)?.tensor_info("token_embd.weight")?.dims()[0];
    let ids: Vec<String> = prompt_ids(vocab).iter().map(u32::to_string).collect();
    let args = [cases.join(","), self::runs(runs).to_string(), path.display().to_string(), ids.join(","), DECODE_PROMPT.to_string(), DECODE.to_string(), rayon::current_num_threads().to_string()];
    let (script, python, missing) = match device {
        Device::Cpu => (LLAMA_CPP_PEER, Some("python3".to_string()), "llama-cpp-python is not installed: `python3 -m pip install llama-cpp-python` builds it from source (about 20 minutes), or pass --no-peer"),
        Device::Gpu(_) => (TORCH_PEER, super::train::python_with_torch(), "PyTorch and the `gguf` package are needed for the GPU peer (`pip install torch gguf`), or pass --no-peer"),
    };
    let Some(python) = python else { bail!("{missing}") };
    let out = Command::new(&python).arg("-c").arg(script).args(&args).output().with_context(|| format!("starting {python}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No module named") {
            bail!("{missing}\n{err}");
        }
        bail!("the llm peer failed: {err}");
    }
    super::Peer::parse(&out.stdout, if device == Device::Cpu { "llama.cpp" } else { "torch" })
}

/// Time one case; returns (median ms for the whole row's work, note).
pub fn run_case(name: &str, device: Device, runs: usize) -> anyhow::Result<(f64, String)> {
    let model = Llama::load(model_path()?, device)?;
    let ids = prompt_ids(model.config.vocab);
    let _g = voltaic::NoGradGuard::new();
    let argmax = |logits: Tensor| -> anyhow::Result<u32> { Ok(logits.argmax(Some(0), false)?.item_f64()? as u32) };
    let mut times = vec![];
    let mut first: Option<Vec<u32>> = None;
    let mut phases = None;
    // One untimed run first: it compiles kernels and fills the caches.
    for run in 0..=self::runs(runs) {
        let mut cache = model.new_cache()?;
        let (ms, tokens) = match name {
            "llm_prefill_128" => {
                let t = Instant::now();
                let tok = argmax(model.forward(&ids, &mut cache)?)?;
                (t.elapsed().as_secs_f64() * 1e3, vec![tok])
            }
            "llm_decode_b1" => {
                // `voltaic generate`'s loop: the prompt, then DECODE greedy
                // steps replayed from a capture, each id read back (one step
                // behind the device).
                let mut before = None;
                let g = generate(&model, &ids[..DECODE_PROMPT], DECODE + 1, &Sampling::default(), None, |_| {
                    before.get_or_insert_with(|| (voltaic::host_profile(), device.stats().ok()));
                    true
                })?;
                ensure!(g.tokens.len() == DECODE + 1, "{name}: generated {} tokens, expected {}", g.tokens.len(), DECODE + 1);
                if let Some((b, stats)) = &before {
                    let mut p = per_token(b, &voltaic::host_profile());
                    if let (Some(s0), Ok(s1)) = (stats, device.stats()) {
                        let n = DECODE as f64;
                        if s1.dispatches > s0.dispatches {
                            p.push_str(&format!(
                                "; per token {:.0} dispatches, {:.1} bind groups made, {:.2} submissions",
                                (s1.dispatches - s0.dispatches) as f64 / n,
                                (s1.bind_groups - s0.bind_groups) as f64 / n,
                                (s1.submissions - s0.submissions) as f64 / n
                            ));
                        }
                    }
                    phases = Some(p);
                }
                (g.decode_seconds * 1e3, g.tokens[1..].to_vec())
            }
            _ => bail!("unknown llm case {name}"),
        };
        // Every run generates the same tokens (greedy, same prompt).
        match &first {
            None => first = Some(tokens),
            Some(f) => ensure!(*f == tokens, "{name}: run {run} generated different tokens"),
        }
        if run > 0 {
            times.push(ms);
        }
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    let mut note = format!("{:.0} tokens/s", tokens_per_second(name, ms));
    if let Some(p) = phases {
        note = format!("{note}; host us per token: {p}");
    }
    Ok((ms, note))
}

/// The host's microseconds per decode step in each phase of realization.
fn per_token(a: &voltaic::HostProfile, b: &voltaic::HostProfile) -> String {
    let n = DECODE as f64;
    let phases = [
        ("record", b.record_us - a.record_us),
        ("collect", b.collect_us - a.collect_us),
        ("schedule", b.schedule_us - a.schedule_us),
        ("compile", b.compile_us - a.compile_us),
        ("encode", b.encode_us - a.encode_us),
        ("submit", b.submit_us - a.submit_us),
        ("wait", b.wait_us - a.wait_us),
        ("execute", b.execute_us - a.execute_us),
    ];
    let parts: Vec<String> = phases.iter().filter(|(_, us)| *us > 0.0).map(|(name, us)| format!("{name} {:.0}", us / n)).collect();
    format!("{} ({:.1} realizations)", parts.join(", "), (b.realizations - a.realizations) as f64 / n)
}

/// Tokens per second of a row's median time.
pub fn tokens_per_second(name: &str, ms: f64) -> f64 {
    let n = if name == "llm_prefill_128" { PREFILL } else { DECODE };
    n as f64 / (ms / 1e3)
}

/// The peer's timings in tokens per second (eager and compiled, where the
/// peer gives both), for the row's note.
pub fn peer_note(name: &str, extra: Option<&serde_json::Map<String, serde_json::Value>>) -> String {
    let mut parts = vec![];
    for (key, label) in [("eager_ms", "torch eager"), ("compiled_ms", "torch reduce-overhead")] {
        if let Some(ms) = extra.and_then(|e| e.get(key)).and_then(|v| v.as_f64()) {
            parts.push(format!("{label} {:.0} tokens/s", tokens_per_second(name, ms)));
        }
    }
    parts.join(", ")
}
