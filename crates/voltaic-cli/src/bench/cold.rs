//! Cold-start rows: Voltaic run in a child process whose caches are all
//! empty — Voltaic's (compiled pipelines, autotuned plans) and the driver's
//! shader caches (NVIDIA's `__GL_SHADER_DISK_CACHE`, Mesa's) — as on a
//! fresh machine. They have no peer: they compare Voltaic's first run with
//! its own warm one.

use anyhow::{bail, Context};
use std::path::Path;
use std::process::Command;
use voltaic::Device;

/// The `voltaic` command with every cache pointed at an empty directory under `dir`.
fn fresh(dir: &Path) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe().context("finding the voltaic executable")?);
    cmd.env("VOLTAIC_CACHE_DIR", dir.join("voltaic"))
        .env("XDG_CACHE_HOME", dir.join("xdg"))
        .env("__GL_SHADER_DISK_CACHE", "0")
        .env("__GL_SHADER_DISK_CACHE_PATH", dir.join("nvidia"))
        .env("MESA_SHADER_CACHE_DISABLE", "true")
        .env("MESA_SHADER_CACHE_DIR", dir.join("mesa"));
    Ok(cmd)
}

fn output(mut cmd: Command, what: &str) -> anyhow::Result<String> {
    // The child's messages (autotune and compile logs when asked for) go to ours.
    let out = cmd.stderr(std::process::Stdio::inherit()).output().with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!("{what} failed ({}); its messages are above", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `cold_start_demo`: the first realization of `voltaic demo` on `device`
/// with empty caches, in ms; the note gives a warm run's.
pub fn demo(device: Device) -> anyhow::Result<(f64, String)> {
    let realized = |stdout: &str| -> anyhow::Result<f64> {
        let line = stdout.lines().find(|l| l.starts_with("Realized in ")).context("voltaic demo printed no 'Realized in' line")?;
        Ok(line.trim_start_matches("Realized in ").trim_end_matches(" ms").trim().parse()?)
    };
    let dir = tempdir("demo")?;
    let run = || -> anyhow::Result<f64> {
        let mut cmd = fresh(&dir)?;
        cmd.args(["demo", "--device", &device.to_string()]);
        realized(&output(cmd, "voltaic demo")?)
    };
    let cold = run()?;
    // The same caches, now filled: the warm figure.
    let warm = run()?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((cold, format!("first realization in a fresh process with empty caches; {warm:.1} ms with the caches it left")))
}

/// `cold_epoch_cnn_bN`: the first epoch of `voltaic train --model cnn` with
/// empty caches, in ms; the note gives the second (warm) epoch of the same run.
pub fn epoch(name: &str, device: Device) -> anyhow::Result<(f64, String)> {
    let batch = name.rsplit("_b").next().context("case name ends in _bN")?;
    let dir = tempdir("epoch")?;
    let mut cmd = fresh(&dir)?;
    let out_dir = dir.join("run");
    cmd.args(["train", "--model", "cnn", "--epochs", "2", "--batch-size", batch, "--quiet", "--json", "--device", &device.to_string()]);
    cmd.arg("--out").arg(&out_dir);
    let stdout = output(cmd, "voltaic train")?;
    let _ = std::fs::remove_dir_all(&dir);
    let line = stdout.lines().last().context("voltaic train printed nothing")?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let secs: Vec<f64> = v["epoch_seconds"].as_array().context("no epoch_seconds")?.iter().filter_map(|s| s.as_f64()).collect();
    anyhow::ensure!(secs.len() == 2, "expected two epochs, got {secs:?}");
    let (pipelines, compile) = (v["pipelines"].as_u64().unwrap_or(0), v["compile_seconds"].as_f64().unwrap_or(0.0));
    Ok((
        secs[0] * 1e3,
        format!("second epoch {:.2} s: first/warm = {:.2}x; {pipelines} pipelines compiled in {compile:.2} s of host time (two epochs and their evaluations)", secs[1], secs[0] / secs[1]),
    ))
}

fn tempdir(what: &str) -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("voltaic-cold-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
