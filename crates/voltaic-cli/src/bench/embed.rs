//! The embedding suite: all-MiniLM-L6-v2 forward passes (encoder, mean
//! pooling, normalisation) in sentences per second, against a plain PyTorch
//! forward of the same weights on the same device.

use super::gpu::gpu_median_ms_over;
use anyhow::Context;
use std::collections::HashMap;
use voltaic::models::bert::{mean_pool_normalize, SentenceEmbedder};
use voltaic::{Device, Tensor};

pub const CASES: &[&str] = &["embed_b1_s128", "embed_b64_s128"];

const TORCH_PEER: &str = include_str!("embed_peer.py");

fn shape(name: &str) -> anyhow::Result<(usize, usize)> {
    let b = name.split("_b").nth(1).and_then(|s| s.split('_').next()).and_then(|s| s.parse().ok());
    let s = name.split("_s").nth(1).and_then(|s| s.parse().ok());
    b.zip(s).context("case names look like embed_bB_sS")
}

/// Token ids `[B, S]` like the peer's: random ids between [CLS] and [SEP].
fn ids(batch: usize, seq: usize) -> Vec<Vec<u32>> {
    let mut g = voltaic::Generator::new(0);
    let u = g.uniform(batch * seq);
    (0..batch)
        .map(|b| {
            (0..seq)
                .map(|s| match s {
                    0 => 101,
                    _ if s == seq - 1 => 102,
                    _ => 1000 + (u[b * seq + s] * 29000.0) as u32,
                })
                .collect()
        })
        .collect()
}

pub fn torch_peer(cases: &[&str], runs: usize, device: Device) -> anyhow::Result<(String, HashMap<String, f64>)> {
    let dir = crate::embed::model_dir(None)?;
    let args = [cases.join(","), runs.to_string(), device.to_string(), dir.display().to_string(), rayon::current_num_threads().to_string()];
    super::train::run_torch_script(TORCH_PEER, &args)
}

/// Time one case; returns (median ms per batch, note).
pub fn run_case(name: &str, device: Device, runs: usize) -> anyhow::Result<(f64, String)> {
    let (batch, seq) = shape(name)?;
    let e = SentenceEmbedder::from_dir(crate::embed::model_dir(None)?, device)?;
    let tokens = ids(batch, seq);
    let (ids, mask) = e.batch(&tokens)?;
    let _g = voltaic::NoGradGuard::new();
    // What `embed_ids` runs per batch: the ids uploaded, then the encoder
    // (replayed from a capture after two calls of this shape).
    let run = || -> voltaic::Result<Tensor> {
        let (ids, mask) = e.batch(&tokens)?;
        e.embed_batch(&ids, &mask)
    };
    // Unit vectors, and the batch path agrees with one sentence alone and
    // with the encoder run through the graph.
    let all = run()?;
    let eager = mean_pool_normalize(&e.model.forward(&ids, &mask)?, &mask)?.to_vec::<f32>()?;
    let gap = all.to_vec::<f32>()?.iter().zip(&eager).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    anyhow::ensure!(gap < 1e-5, "{name}: embed_batch and the graph's forward differ by {gap}");
    let norms = all.sqr()?.sum(&[-1], false)?.to_vec::<f32>()?;
    anyhow::ensure!(norms.iter().all(|n| (n - 1.0).abs() < 1e-4), "{name}: embeddings are not unit vectors");
    let (one_ids, one_mask) = (ids.narrow(0, 0, 1)?, mask.narrow(0, 0, 1)?);
    let one = mean_pool_normalize(&e.model.forward(&one_ids, &one_mask)?, &one_mask)?.to_vec::<f32>()?;
    let first = all.narrow(0, 0, 1)?.to_vec::<f32>()?;
    let diff = one.iter().zip(&first).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    anyhow::ensure!(diff < 1e-4, "{name}: batched and single embeddings differ by {diff}");
    // Runs of about 0.3 s of batches back to back (at most 200), as the
    // peer times them: a 20 ms run held two batch-64 forwards, and its
    // start (the first batch recorded before any work is queued) and its
    // final wait weighed on each as they do not on the peer's 45.
    let ms = gpu_median_ms_over(device, runs, false, 0.3, 200, || {
        run()?.realize()?;
        Ok(())
    })?;
    Ok((ms, format!("{:.0} sentences/s", batch as f64 / (ms / 1e3))))
}
