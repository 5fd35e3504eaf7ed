//! `voltaic bench`: Voltaic against a peer library, both measured in the same
//! run on the same machine. Times are medians of several runs after warm-up.

mod cpu;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::time::Instant;

/// Arguments of `voltaic bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Which suite to run: cpu (gpu, train and embed come with later issues).
    #[arg(long, default_value = "cpu")]
    suite: String,
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    json: bool,
    /// Timed runs per row (the median is reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Only run rows whose name contains this.
    #[arg(long)]
    filter: Option<String>,
    /// Skip the peer (report Voltaic alone).
    #[arg(long)]
    no_peer: bool,
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

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let cases: Vec<&str> = match args.suite.as_str() {
        "cpu" => cpu::CASES.to_vec(),
        s => bail!("unknown or not yet available suite {s:?}: expected cpu"),
    };
    let cases: Vec<&str> = cases.into_iter().filter(|c| args.filter.as_deref().is_none_or(|f| c.contains(f))).collect();
    let pb = ProgressBar::new(cases.len() as u64 * if args.no_peer { 1 } else { 2 });
    pb.set_style(ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {msg}").unwrap().progress_chars("=> "));
    let mut peer_ms = std::collections::HashMap::new();
    let mut peer_name = String::from("none");
    if !args.no_peer {
        pb.set_message("numpy peer");
        let (name, times) = cpu::numpy_peer(&cases, args.runs).context("running the numpy peer")?;
        peer_name = name;
        peer_ms = times;
        pb.inc(cases.len() as u64);
    }
    let mut rows = vec![];
    for c in &cases {
        pb.set_message(format!("voltaic {c}"));
        let (ms, note) = cpu::run_case(c, args.runs)?;
        rows.push(Row { name: c.to_string(), voltaic_ms: ms, peer: peer_name.clone(), peer_ms: peer_ms.get(*c).copied(), note });
        pb.inc(1);
    }
    pb.finish_and_clear();
    for r in &rows {
        let speedup = r.peer_ms.map(|p| p / r.voltaic_ms);
        if args.json {
            println!(
                "{}",
                json!({
                    "name": r.name, "voltaic_ms": round3(r.voltaic_ms), "peer": r.peer,
                    "peer_ms": r.peer_ms.map(round3), "speedup": speedup.map(round3),
                    "device": "cpu", "threads": rayon::current_num_threads(), "note": r.note,
                })
            );
        } else {
            println!(
                "{:<24} voltaic {:>9.3} ms   {} {:>9} ms   speedup {:>6}   {}",
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

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
