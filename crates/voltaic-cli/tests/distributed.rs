//! `voltaic train --devices` and `voltaic train --distributed` under
//! `mpirun` end to end: the per-step losses of 50 steps of Fashion-MNIST
//! equal one device's to 1e-5 relative (CPU, and two devices on the test
//! GPU); a rank that dies ends the job with its name; ranks with different
//! models are refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
#[cfg(feature = "mpi")]
use std::time::{Duration, Instant};

fn voltaic() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_voltaic"));
    c.env("XDG_RUNTIME_DIR", std::env::var("XDG_RUNTIME_DIR").unwrap_or_else(|_| "/tmp".into()));
    c
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("voltaic-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 50 steps of batch 64 on the MLP, one epoch.
const RUN: [&str; 10] = ["train", "--model", "mlp", "--epochs", "1", "--limit", "3200", "--batch-size", "64", "--quiet"];

fn ok(out: &Output, what: &str) {
    assert!(out.status.success(), "{what} failed:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

fn losses(path: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().skip(1).map(|l| l.split(',').nth(1).unwrap().parse().unwrap()).collect()
}

fn assert_same(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), 50, "{what}: {} steps logged", got.len());
    assert_eq!(want.len(), 50);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(rel <= 1e-5, "{what}: step {} loss {g} against one device's {w} (relative {rel:.2e})", i + 1);
    }
    assert!(want[49] < 0.8 * want[0], "the run did not train: {} -> {}", want[0], want[49]);
}

/// One device's losses: the reference (batches made on the host, as the
/// data-parallel runs make them).
fn one_device(device: &str, dir: &Path) -> Vec<f64> {
    let log = dir.join("one.csv");
    let out = voltaic().args(RUN).args(["--device", device, "--data-on-device", "no", "--out"]).arg(dir.join("one")).arg("--loss-log").arg(&log).output().unwrap();
    ok(&out, "the one-device run");
    losses(&log)
}

fn gpu() -> String {
    let out = voltaic().args(["devices", "--json"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"device\":\"gpu:0\""), "no GPU adapter found: the GPU tests need one (apt-get install libvulkan1 mesa-vulkan-drivers)");
    format!("gpu:{}", std::env::var("VOLTAIC_TEST_GPU").unwrap_or_else(|_| "0".into()))
}

#[test]
fn devices_in_one_process_match_one_device() {
    for (one, list) in [("cpu", "cpu,cpu".to_string()), (&*gpu(), format!("{0},{0}", gpu()))] {
        let dir = tmp(&format!("local-{one}"));
        let want = one_device(one, &dir);
        let log = dir.join("group.csv");
        let out = voltaic().args(RUN).args(["--devices", &list, "--json", "--out"]).arg(dir.join("group")).arg("--loss-log").arg(&log).output().unwrap();
        ok(&out, "the data-parallel run");
        assert_same(&losses(&log), &want, &format!("--devices {list}"));
        let json: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
        assert!(json["test_accuracy"].as_f64().unwrap() > 0.6, "{json}");
        assert!(dir.join("group/checkpoint.safetensors").exists() && dir.join("group/curves.png").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn bad_parallel_arguments_are_clear_errors() {
    let out = voltaic().args(["train", "--devices", "cpu,gpu:77", "--quiet"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("gpu:77") && err.contains("not available"), "{err}");
    let out = voltaic().args(["train", "--devices", "cpu,cpu", "--precision", "f16", "--quiet"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("f16") && err.contains("bf16"), "{err}");
    let out = voltaic().args(["train", "--devices", "cpu,cpu", "--device", "cpu"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}

#[cfg(not(feature = "mpi"))]
#[test]
fn distributed_without_mpi_says_how_to_build_it() {
    let out = voltaic().args(["train", "--distributed", "--quiet"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--features mpi") && err.contains("mpirun"), "{err}");
}

/// `mpirun` on this machine, allowed to run as root and to start more ranks
/// than there are cores (CI machines have two).
#[cfg(feature = "mpi")]
fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1").env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    c.env("XDG_RUNTIME_DIR", std::env::var("XDG_RUNTIME_DIR").unwrap_or_else(|_| "/tmp".into()));
    c.args(["--oversubscribe", "-np", &np.to_string()]);
    c
}

#[cfg(feature = "mpi")]
#[test]
fn two_mpi_ranks_match_one_device() {
    assert!(Command::new("mpirun").arg("--version").output().is_ok(), "mpirun is missing: apt-get install openmpi-bin libopenmpi-dev");
    for device in ["cpu".to_string(), gpu()] {
        let dir = tmp(&format!("mpi-{device}"));
        let want = one_device(&device, &dir);
        let log = dir.join("mpi.csv");
        let out = mpirun(2)
            .arg(env!("CARGO_BIN_EXE_voltaic"))
            .args(RUN)
            .args(["--distributed", "--device", &device, "--json", "--out"])
            .arg(dir.join("mpi"))
            .arg("--loss-log")
            .arg(&log)
            .output()
            .unwrap();
        ok(&out, "mpirun -np 2");
        assert_same(&losses(&log), &want, &format!("2 MPI ranks on {device}"));
        // Only rank 0 reports.
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.lines().filter(|l| l.starts_with('{')).count(), 1, "{stdout}");
        assert!(stdout.contains("2 MPI ranks"), "{stdout}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The collective itself under `mpirun`: the `mpi_collective` example
/// (built with the tests) sums vectors of several sizes, empty and larger
/// than the shared window held so far, in place and out of place, and
/// checks them against the sum in rank order (to the bit in shared memory;
/// within 1e-5 through `MPI_Allreduce`).
#[cfg(feature = "mpi")]
#[test]
fn the_mpi_collective_sums_every_size_exactly() {
    let example = Path::new(env!("CARGO_BIN_EXE_voltaic")).parent().unwrap().join("examples/mpi_collective");
    assert!(example.exists(), "{} is missing: cargo test builds it with the mpi feature", example.display());
    for (np, shared) in [(3, "1"), (2, "0")] {
        let out = mpirun(np).env("VOLTAIC_MPI_SHARED", shared).args(["-x", "VOLTAIC_MPI_SHARED"]).arg(&example).output().unwrap();
        ok(&out, &format!("mpi_collective on {np} ranks, VOLTAIC_MPI_SHARED={shared}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.lines().filter(|l| l.contains("7 sizes summed")).count(), np, "{stdout}");
        assert!(stdout.contains(if shared == "1" { "to the bit" } else { "within 1e-5" }), "{stdout}");
    }
}

#[cfg(feature = "mpi")]
#[test]
fn ranks_with_different_models_are_refused() {
    let dir = tmp("mpi-mismatch");
    let bin = env!("CARGO_BIN_EXE_voltaic");
    let start = Instant::now();
    let out = mpirun(1)
        .args([bin, "train", "--distributed", "--device", "cpu", "--quiet", "--limit", "640", "--model", "mlp", "--out"])
        .arg(dir.join("a"))
        .args([":", "-np", "1", bin, "train", "--distributed", "--device", "cpu", "--quiet", "--limit", "640", "--model", "cnn", "--out"])
        .arg(dir.join("b"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a job of different models succeeded");
    assert!(err.contains("ranks disagree on the model") && err.contains("rank 1"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(60));
    assert!(!dir.join("a/checkpoint.safetensors").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pids of live processes whose environment holds `tag` and `rank`.
#[cfg(feature = "mpi")]
fn ranks_tagged(tag: &str, rank: Option<usize>) -> Vec<i32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let has = |v: &str| vars.contains(&v.as_bytes());
        let is_rank = rank.is_none_or(|r| has(&format!("OMPI_COMM_WORLD_RANK={r}")));
        let state = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = state.split_whitespace().nth(2) == Some("Z");
        if has(&format!("VOLTAIC_TEST_TAG={tag}")) && is_rank && !zombie && vars.iter().any(|x| x.starts_with(b"OMPI_COMM_WORLD_RANK=")) {
            out.push(pid);
        }
    }
    out
}

#[cfg(feature = "mpi")]
#[test]
fn a_rank_that_dies_ends_the_job_and_is_named() {
    let dir = tmp("mpi-kill");
    let tag = format!("kill-{}", std::process::id());
    let mut child = mpirun(2)
        .env("VOLTAIC_TEST_TAG", &tag)
        .args(["-x", "VOLTAIC_TEST_TAG", env!("CARGO_BIN_EXE_voltaic")])
        .args(["train", "--distributed", "--device", "cpu", "--quiet", "--model", "mlp", "--epochs", "20", "--out"])
        .arg(dir.join("run"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until rank 1 is training, then kill it without warning.
    let start = Instant::now();
    let victim = loop {
        if let Some(&pid) = ranks_tagged(&tag, Some(1)).first() {
            break pid;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "rank 1 never started");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_secs(3));
    assert!(child.try_wait().unwrap().is_none(), "the job ended before the kill");
    let killed = Instant::now();
    assert!(Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap().success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if killed.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the job was still running 30 s after rank 1 died");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let took = killed.elapsed();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success(), "the job succeeded without rank 1");
    assert!(err.contains("rank 1"), "the launcher's message names rank 1: {err}");
    assert!(took < Duration::from_secs(15), "the job took {took:?} to end");
    assert!(ranks_tagged(&tag, None).is_empty(), "a rank outlived the job");
    let _ = std::fs::remove_dir_all(&dir);
}
