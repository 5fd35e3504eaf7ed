//! Train an MLP on Fashion-MNIST (the `voltaic train` job, in a page).
//! Needs the data: `apt-get install dataset-fashion-mnist`, or set
//! `FASHION_MNIST_DIR` to a folder with the four `*-ubyte.gz` files.
//!
//! ```sh
//! cargo run --release --example fashion_mnist
//! ```

use std::sync::Arc;
use voltaic::data::{fashion_mnist, DataLoader, LoaderOpts};
use voltaic::optim::Adam;
use voltaic::prelude::*;

fn main() -> Result<()> {
    voltaic::manual_seed(0);
    let dev = Device::best();
    let dir = std::env::var("FASHION_MNIST_DIR").unwrap_or_else(|_| "/usr/share/datasets/fashion-mnist".into());
    let (train, test) = fashion_mnist(&dir)?;
    let (train, test) = (Arc::new(train), Arc::new(test));
    let model = voltaic::models::classifier::mlp(dev)?; // 784-256-128-10, PyTorch's names
    let mut opt = Adam::new(model.parameters(), 1e-3);
    let opts = |shuffle| LoaderOpts { batch_size: 128, shuffle, seed: 0, mean: 0.2860, std: 0.3530, drop_last: false, device: dev };

    for epoch in 0..2 {
        model.train();
        for batch in DataLoader::new(train.clone(), &opts(true), epoch)? {
            let batch = batch?;
            let loss = model.forward(&batch.x)?.cross_entropy(&batch.y, 0.0, Reduction::Mean)?;
            opt.zero_grad();
            loss.backward()?;
            opt.step()?;
        }
        model.eval();
        let _no_grad = voltaic::NoGradGuard::new(); // torch.no_grad() for the rest of this block
        let (mut correct, mut seen) = (0usize, 0usize);
        for batch in DataLoader::new(test.clone(), &opts(false), 0)? {
            let batch = batch?;
            let hits = model.forward(&batch.x)?.argmax(Some(-1), false)?.eq(&batch.y)?;
            correct += hits.to_dtype(DType::I32)?.sum_all()?.item::<i32>()? as usize;
            seen += batch.y.numel();
        }
        println!("epoch {}: test accuracy {:.2}% on {dev}", epoch + 1, 100.0 * correct as f64 / seen as f64);
    }
    Ok(())
}
