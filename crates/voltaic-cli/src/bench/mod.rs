//! `voltaic bench`: Voltaic against a peer library, both measured in the same
//! run on the same machine. Times are medians of several runs after warm-up.

mod check;
mod cold;
mod cpu;
mod dist;
mod embed;
mod gpu;
mod llm;
mod scale;
mod train;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::time::Instant;

/// Arguments of `voltaic bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Which suite to run: cpu (against numpy), gpu (against PyTorch on the same GPU),
    /// train (training steps) or embed (MiniLM sentence embeddings), both against
    /// PyTorch on the same device, or llm (SmolLM2-135M prefill and decode, against
    /// llama.cpp on the CPU and PyTorch on a GPU), or dist (data-parallel
    /// training's pieces: staging copies, host all-reduce, encoder steps over
    /// two devices of one adapter and, under mpirun, over MPI ranks), or scale
    /// (data-parallel training on 1, 2, 4, 8 GPUs against PyTorch DDP).
    #[arg(long, default_value = "cpu")]
    pub(crate) suite: String,
    /// Device: for the gpu suite the best hardware GPU by default (`gpu:N` picks
    /// one, a software adapter included); for train the best device.
    #[arg(long)]
    pub(crate) device: Option<String>,
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Timed runs per row (the median is reported).
    #[arg(long, default_value_t = 7)]
    pub(crate) runs: usize,
    /// Only run rows whose name contains this. The cold-start rows
    /// (`cold_*`, each a fresh process with empty caches) run only when the
    /// filter names them: `--filter cold`.
    #[arg(long)]
    pub(crate) filter: Option<String>,
    /// Skip the peer (report Voltaic alone).
    #[arg(long)]
    pub(crate) no_peer: bool,
    /// Also draw the speedups as a PNG bar chart (red bars miss their target).
    #[arg(long)]
    pub(crate) plot: Option<std::path::PathBuf>,
}

/// One benchmark result.
pub struct Row {
    pub name: String,
    pub voltaic_ms: f64,
    pub peer: String,
    pub peer_ms: Option<f64>,
    pub note: String,
}

/// Median wall time in ms of `f` over `runs` runs after `warmup` untimed ones.
pub fn median_ms(warmup: usize, runs: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(t[t.len() / 2])
}

/// What a peer script (numpy or PyTorch) reported.
pub struct Peer {
    pub name: String,
    /// Median ms per case.
    pub times: std::collections::HashMap<String, f64>,
    /// Extra fields per case (torch.compile timings).
    pub extra: std::collections::HashMap<String, serde_json::Map<String, serde_json::Value>>,
    /// The peer's own line: library version, device, clocks.
    pub info: serde_json::Value,
}

impl Peer {
    /// Parse a peer script's output: one `{"peer": NAME, ...}` line and one
    /// `{"name": CASE, "ms": MEDIAN, ...}` line per case.
    pub fn parse(stdout: &[u8], default_name: &str) -> anyhow::Result<Peer> {
        let mut peer = Peer { name: default_name.into(), times: Default::default(), extra: Default::default(), info: serde_json::Value::Null };
        for line in String::from_utf8_lossy(stdout).lines() {
            let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("a peer line that is not JSON: {line:?}"))?;
            if let Some(p) = v.get("peer").and_then(|p| p.as_str()) {
                peer.name = p.to_string();
                peer.info = v.clone();
            } else if let (Some(n), Some(ms)) = (v["name"].as_str(), v["ms"].as_f64()) {
                peer.times.insert(n.to_string(), ms);
                let mut extra = v.as_object().cloned().unwrap_or_default();
                extra.remove("name");
                extra.remove("ms");
                peer.extra.insert(n.to_string(), extra);
            }
        }
        Ok(peer)
    }
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.suite == "dist" {
        return dist::run(&args);
    }
    if args.suite == "scale" {
        return scale::run(&args);
    }
    let embed_suite = args.suite == "embed";
    let llm_suite = args.suite == "llm";
    let (gpu_suite, train_suite) = match args.suite.as_str() {
        "cpu" => (false, false),
        "gpu" => (true, false),
        "train" | "embed" | "llm" => (false, true),
        s => bail!("unknown suite {s:?}: expected cpu, gpu, train, embed, llm, dist or scale"),
    };
    let all = if llm_suite {
        llm::CASES
    } else if embed_suite {
        embed::CASES
    } else if train_suite {
        train::CASES
    } else if gpu_suite {
        gpu::CASES
    } else {
        cpu::CASES
    };
    // Cold-start rows start fresh processes and take a minute: only when the filter names them.
    let wanted = |c: &str| match args.filter.as_deref() {
        Some(f) => c.contains(f) && (!c.starts_with("cold_") || f.contains("cold")),
        None => !c.starts_with("cold_"),
    };
    let cases: Vec<&str> = all.iter().copied().filter(|c| wanted(c)).collect();
    let device = match (&args.device, gpu_suite) {
        (Some(d), _) => voltaic::Device::parse(d)?,
        (None, false) if train_suite => voltaic::Device::best(),
        (None, false) => voltaic::Device::Cpu,
        (None, true) => match voltaic::Device::best() {
            d @ voltaic::Device::Gpu(_) => d,
            voltaic::Device::Cpu => bail!("no hardware GPU found for the gpu suite; pass --device gpu:N to use a software adapter"),
        },
    };
    let pb = ProgressBar::new(cases.len() as u64 * if args.no_peer { 1 } else { 2 });
    pb.set_style(ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {msg}").unwrap().progress_chars("=> "));
    let mut peer_ms = std::collections::HashMap::new();
    let mut peer_extra = std::collections::HashMap::new();
    let mut peer_name = String::from("none");
    let mut meta = serde_json::Map::new();
    meta.insert("device".into(), json!(device.to_string()));
    if let voltaic::Device::Gpu(i) = device {
        if let Some(a) = voltaic::backend::adapters().into_iter().find(|a| a.index == i) {
            meta.insert("adapter".into(), json!(a.name));
            meta.insert("backend".into(), json!(a.backend));
            meta.insert("driver".into(), json!(a.driver));
        }
    } else {
        meta.insert("threads".into(), json!(rayon::current_num_threads()));
    }
    if llm_suite {
        meta.insert("unit".into(), json!("ms per 128-token prefill (llm_prefill_128) or per 128 greedy decode steps (llm_decode_b1)"));
    } else if embed_suite {
        meta.insert("unit".into(), json!("ms per batch of sequence length 128"));
    } else if train_suite {
        meta.insert("unit".into(), json!("ms per Adam step (train_*) or per epoch (epoch_*)"));
    }
    if !args.no_peer {
        pb.set_message(match (llm_suite, device) {
            (true, voltaic::Device::Cpu) => "llama.cpp peer",
            _ if gpu_suite || train_suite => "PyTorch peer",
            _ => "numpy peer",
        });
        if llm_suite {
            let p = llm::peer(&cases, args.runs, device).context("running the llm peer")?;
            peer_name = p.name;
            peer_ms = p.times;
            peer_extra = p.extra;
        } else if embed_suite {
            let (name, times) = embed::torch_peer(&cases, args.runs, device).context("running the PyTorch peer")?;
            peer_name = name;
            peer_ms = times;
        } else if train_suite {
            let p = train::torch_peer(&cases, args.runs, device).context("running the PyTorch peer")?;
            peer_name = p.name;
            peer_ms = p.times;
            peer_extra = p.extra;
        } else if gpu_suite {
            let p = gpu::torch_peer(&cases, args.runs).context("running the PyTorch peer")?;
            peer_name = p.name;
            peer_ms = p.times;
            peer_extra = p.extra;
            if let Some(c) = p.info.get("clocks") {
                meta.insert("clocks".into(), c.clone());
            }
        } else {
            let (name, times) = cpu::numpy_peer(&cases, args.runs).context("running the numpy peer")?;
            peer_name = name;
            peer_ms = times;
        }
        pb.inc(cases.len() as u64);
    }
    let mut rows = vec![];
    for c in &cases {
        pb.set_message(format!("voltaic {c}"));
        let (ms, note) = if llm_suite {
            llm::run_case(c, device, args.runs)
        } else if embed_suite {
            embed::run_case(c, device, args.runs)
        } else if train_suite {
            train::run_case(c, device, args.runs)
        } else if gpu_suite {
            gpu::run_case(c, device, args.runs)
        } else {
            cpu::run_case(c, args.runs)
        }
        .with_context(|| format!("benchmark {c}"))?;
        let mut note = note;
        if llm_suite {
            let peer = llm::peer_note(c, peer_extra.get(*c));
            if !peer.is_empty() {
                note = format!("{note}; {peer}");
            }
        }
        // The epoch rows' second peer: PyTorch with the data on the device.
        if let Some(r) = peer_extra.get(*c).and_then(|e| e.get("resident_ms")).and_then(|v| v.as_f64()) {
            note = format!("{note}; vs the GPU-resident loop ({r:.1} ms): {:.2}x", r / ms);
        }
        rows.push(Row { name: c.to_string(), voltaic_ms: ms, peer: peer_name.clone(), peer_ms: peer_ms.get(*c).copied(), note });
        pb.inc(1);
    }
    pb.finish_and_clear();
    let target_suite = if llm_suite && device != voltaic::Device::Cpu { "llm-gpu".to_string() } else { args.suite.clone() };
    if let Some(path) = &args.plot {
        let bars: Vec<(String, f64, Option<f64>)> =
            rows.iter().filter_map(|r| Some((r.name.clone(), r.peer_ms? / r.voltaic_ms, target(&target_suite, &r.name)))).collect();
        let title = format!("Voltaic vs {peer_name} on {device} ({} suite)", args.suite);
        crate::plot::save_speedups(path, &title, &bars)?;
    }
    for r in &rows {
        let speedup = r.peer_ms.map(|p| p / r.voltaic_ms);
        if args.json {
            let mut o = json!({
                "name": r.name, "voltaic_ms": round3(r.voltaic_ms), "peer": r.peer,
                "peer_ms": r.peer_ms.map(round3), "speedup": speedup.map(round3), "note": r.note,
            });
            let m = o.as_object_mut().expect("object");
            m.extend(meta.clone());
            if let Some(extra) = peer_extra.get(&r.name) {
                m.extend(extra.clone());
            }
            println!("{o}");
        } else {
            println!(
                "{:<26} voltaic {:>9.3} ms   {} {:>9} ms   speedup {:>6}   {}",
                r.name,
                r.voltaic_ms,
                r.peer,
                r.peer_ms.map(|p| format!("{p:.3}")).unwrap_or("-".into()),
                speedup.map(|s| format!("{s:.2}x")).unwrap_or("-".into()),
                r.note
            );
        }
    }
    Ok(())
}

/// The speedup an issue asks of a row, if any.
fn target(suite: &str, name: &str) -> Option<f64> {
    Some(match name {
        "matmul_f32_1024" => 0.8,
        "chain10_f32_16m" if suite == "cpu" => 3.0,
        "chain10_f32_16m" => 2.5,
        "softmax_rows_4096" | "sum_f32_64m" => 1.0,
        "matmul_f32_4096" => 0.85,
        "matmul_f32_4096x4096x4100" | "bmm_f32_attention" | "linear_f32_b128" | "gemv_f32_4096" => 0.7,
        "matmul_f16_4096" => 0.3,
        "matmul_bf16_4096" => 0.25,
        // Issue 19: a mixed-precision encoder step at 0.6x torch.autocast.
        "encoder_f16" | "encoder_bf16" => 0.6,
        "add_f32_256m" => 0.9,
        "sum_f32_256m" | "softmax_rows_8192" | "layernorm_rows_8192" => 0.8,
        "launch_1000_small" => 2.0,
        "realize_small_graph" => 1.0,
        "train_mlp_b64" | "train_cnn_b64" => 1.5,
        "train_mlp_b256" | "train_cnn_b256" => 1.2,
        n if n.starts_with("epoch_") => 1.5,
        n if suite == "embed" && n.starts_with("embed") => 1.0,
        // On a GPU against PyTorch's CUDA-graph decode and its eager prefill;
        // on the CPU against llama.cpp (the caller knows which from the peer).
        "llm_decode_b1" if suite == "llm-gpu" => 2.5,
        "llm_prefill_128" if suite == "llm-gpu" => 2.0,
        "llm_decode_b1" | "llm_prefill_128" if suite == "llm" => 0.8,
        _ => return None,
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
