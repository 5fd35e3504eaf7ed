//! The `voltaic` command end to end: devices, and a short training run on
//! real Fashion-MNIST data that writes everything it promises.

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
    assert!(dir.join("optimizer.safetensors").exists());
    std::fs::remove_dir_all(&dir).unwrap();
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
