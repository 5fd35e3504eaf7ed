//! The functions the pages call. Each returns a promise of a JSON string
//! (or rejects with the error's message).

use crate::{demo, suite};
use voltaic::Device;
use wasm_bindgen::prelude::*;

fn js_err(e: impl std::fmt::Display) -> JsValue {
    JsValue::from_str(&e.to_string())
}

#[wasm_bindgen(start)]
fn start() {
    console_error_panic_hook::set_once();
}

/// Open the device the page asked for: `gpu` (fails without WebGPU),
/// `cpu`, or `auto` (the browser's GPU, else the CPU executor). Returns
/// JSON: the device and the adapter's description.
async fn open(which: &str) -> Result<(Device, String), JsValue> {
    let device = match which {
        "cpu" => Device::Cpu,
        "gpu" => Device::gpu_async(0).await.map_err(js_err)?,
        _ => Device::best_async().await,
    };
    let adapter = match device {
        Device::Cpu => "CPU executor (WebAssembly, one thread)".to_string(),
        Device::Gpu(i) => voltaic::backend::adapters_async()
            .await
            .get(i)
            .map(|a| format!("{} ({}, {}, {})", a.name, a.backend, a.device_type, a.driver))
            .unwrap_or_else(|| format!("gpu:{i}")),
    };
    Ok((device, adapter))
}

/// Run every case of the suite on `which` and compare with `fixtures`
/// (JSON written by `web-fixtures`). Resolves to a JSON report.
#[wasm_bindgen]
pub async fn run_suite(which: String, fixtures: String) -> Result<String, JsValue> {
    let want: suite::Fixtures = serde_json::from_str(&fixtures).map_err(js_err)?;
    let (device, adapter) = open(&which).await?;
    let mut reports = Vec::new();
    for name in suite::CASES {
        let got = suite::run_case(name, device).await;
        let report = match want.cases.get(*name) {
            Some(w) => suite::compare(name, w, &got),
            None => suite::CaseReport { name: name.to_string(), ok: false, worst: f64::INFINITY, error: Some("no fixture".into()) },
        };
        reports.push(report);
    }
    // In a browser the blocking read of a GPU tensor must refuse, naming the async form.
    if device.is_gpu() {
        let r = voltaic::Tensor::ones(&[2], voltaic::DType::F32, device).and_then(|t| t.mul(3.0)?.to_vec::<f32>());
        let error = match r {
            Ok(v) => Some(format!("to_vec returned {v:?} instead of an error")),
            Err(e) if e.to_string().contains("to_vec_async") => None,
            Err(e) => Some(format!("the error does not name to_vec_async: {e}")),
        };
        reports.push(suite::CaseReport { name: "blocking_read_is_refused".into(), ok: error.is_none(), worst: 0.0, error });
    }
    let ok = reports.iter().all(|r| r.ok);
    Ok(serde_json::json!({ "ok": ok, "adapter": adapter, "device": format!("{device:?}"), "cases": reports }).to_string())
}

/// Classify the first `limit` test images with a checkpoint, on `which`.
/// Resolves to JSON: model, adapter, predictions, labels, accuracy, pixels.
#[wasm_bindgen]
pub async fn classify(which: String, checkpoint: Vec<u8>, images: Vec<u8>, labels: Vec<u8>, limit: usize) -> Result<String, JsValue> {
    let (device, adapter) = open(&which).await?;
    let c = demo::classify(&checkpoint, &images, &labels, limit, device).await.map_err(js_err)?;
    let mut v = serde_json::to_value(&c).map_err(js_err)?;
    v["adapter"] = adapter.into();
    v["classes"] = serde_json::json!(demo::CLASSES);
    Ok(v.to_string())
}

/// MiniLM sentence similarity on `which`: the model's files as fetched
/// (`config.json`, `model.safetensors`, `tokenizer.json`,
/// `sentence_bert_config.json`) and the sentences as a JSON array (empty:
/// the built-in ones). Resolves to JSON: adapter, sentences, similarity
/// (row-major `n x n`).
#[wasm_bindgen]
pub async fn minilm_similarity(which: String, config: String, model: Vec<u8>, tokenizer: Vec<u8>, sentence_config: String, sentences: String) -> Result<String, JsValue> {
    let (device, adapter) = open(&which).await?;
    let given: Vec<String> = if sentences.trim().is_empty() { vec![] } else { serde_json::from_str(&sentences).map_err(js_err)? };
    let list: Vec<&str> = if given.is_empty() { demo::SENTENCES.to_vec() } else { given.iter().map(String::as_str).collect() };
    let sim = demo::similarity(&config, model, &tokenizer, Some(&sentence_config), &list, device).await.map_err(js_err)?;
    Ok(serde_json::json!({ "adapter": adapter, "sentences": list, "similarity": sim }).to_string())
}
