//! The demo page's work: a Fashion-MNIST classifier from the bytes of a
//! checkpoint written by `voltaic train`, run over the first test images.

use serde::Serialize;
use voltaic::data::{Dataset, DeviceDataset, FASHION_MNIST_MEAN, FASHION_MNIST_STD};
use voltaic::models::classifier;
use voltaic::nn::{Forward, Module, Sequential};
use voltaic::{Device, Error, Result};

/// Fashion-MNIST's class names, by label.
pub const CLASSES: [&str; 10] = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"];

/// What the page shows.
#[derive(Serialize, Debug)]
pub struct Classified {
    /// `mlp` or `cnn`, as found in the checkpoint.
    pub model: String,
    /// The predicted class of each image.
    pub predictions: Vec<i32>,
    /// The true class of each image.
    pub labels: Vec<i32>,
    /// Fraction of predictions that equal the labels.
    pub accuracy: f64,
    /// The images' pixels (28x28 bytes each), for drawing.
    pub pixels: Vec<u8>,
}

/// Build the classifier a checkpoint's tensors describe (`model.safetensors`
/// names like `1.weight`, or `checkpoint.safetensors` with `model.` before them).
pub fn load_classifier(checkpoint: &[u8], device: Device) -> Result<(String, Sequential)> {
    let tensors = voltaic::io::safetensors::read_bytes(checkpoint, "the checkpoint", device)?;
    let weights: Vec<(String, voltaic::Tensor)> = tensors
        .into_iter()
        .filter_map(|(n, t)| match n.strip_prefix("model.") {
            Some(rest) => Some((rest.to_string(), t)),
            None if !n.contains("optim") && n.chars().next().is_some_and(|c| c.is_ascii_digit()) => Some((n, t)),
            None => None,
        })
        .collect();
    let is_cnn = weights.iter().any(|(n, t)| n == "0.weight" && t.dims().len() == 4);
    let (name, model) = if is_cnn { ("cnn", classifier::cnn(device)?) } else { ("mlp", classifier::mlp(device)?) };
    for (n, p) in model.named_tensors() {
        let Some((_, t)) = weights.iter().find(|(k, _)| *k == n) else {
            return Err(Error::Format(format!("the checkpoint has no tensor {n:?} of the {name} classifier")));
        };
        p.set(t.to_dtype(p.value().dtype())?)?;
    }
    model.eval();
    Ok((name.to_string(), model))
}

/// Classify the first `limit` images of IDX `images`/`labels` bytes with
/// the checkpoint's model on `device`, as `voltaic eval` does (same
/// normalization, batches of 1000).
pub async fn classify(checkpoint: &[u8], images: &[u8], labels: &[u8], limit: usize, device: Device) -> Result<Classified> {
    let (model_name, model) = load_classifier(checkpoint, device)?;
    let data = Dataset::from_idx_bytes(images, labels)?;
    let data = data.take(limit.min(data.len()));
    let _g = voltaic::NoGradGuard::new();
    let mut predictions = Vec::with_capacity(data.len());
    for start in (0..data.len()).step_by(1000) {
        let part = Dataset {
            pixels: data.pixels[start * data.item_numel()..(start + 1000).min(data.len()) * data.item_numel()].to_vec(),
            labels: data.labels[start..(start + 1000).min(data.len())].to_vec(),
            item_dims: data.item_dims.clone(),
        };
        let batch = DeviceDataset::new(&part, FASHION_MNIST_MEAN, FASHION_MNIST_STD, device)?;
        let logits = model.forward(&batch.x)?;
        predictions.extend(logits.argmax(Some(-1), false)?.to_vec_async::<i32>().await?);
    }
    let correct = predictions.iter().zip(&data.labels).filter(|(p, l)| p == l).count();
    let accuracy = if data.is_empty() { 0.0 } else { correct as f64 / data.len() as f64 };
    Ok(Classified { model: model_name, predictions, labels: data.labels.clone(), accuracy, pixels: data.pixels.clone() })
}

/// The sentences the MiniLM panel compares unless the page gives others.
pub const SENTENCES: [&str; 5] = [
    "A man is playing a guitar.",
    "Someone is playing music on an instrument.",
    "A woman is slicing vegetables in the kitchen.",
    "Somebody is cutting up carrots.",
    "The stock market fell sharply today.",
];

/// Cosine similarities `[n, n]` (row-major) of the sentences' MiniLM
/// embeddings, the model given as its files' contents.
pub async fn similarity(config: &str, model: Vec<u8>, tokenizer: &[u8], sentence_config: Option<&str>, sentences: &[&str], device: Device) -> Result<Vec<f64>> {
    let embedder = voltaic::models::bert::SentenceEmbedder::from_bytes(config, model, tokenizer, sentence_config, device)?;
    let e = embedder.embed(sentences)?;
    // Unit-length rows: their products are the cosines.
    e.matmul(&e.t()?)?.to_f64_vec_async().await
}
