//! `voltaic demo`: a short computation that shows the lazy graph at work.

use std::time::Instant;
use voltaic::{inspect, DType, Tensor};

pub fn run(device: Option<&str>) -> anyhow::Result<()> {
    let device = crate::parse_device(device)?;
    crate::devices::run(false)?;
    println!("\nDemo on {device}: a 2-layer MLP forward pass and a cross-entropy loss over a random batch.");
    voltaic::manual_seed(42);
    let (batch, din, hidden, classes) = (256, 784, 256, 10);
    let x = Tensor::randn(&[batch, din], DType::F32, device)?;
    let w1 = Tensor::randn(&[din, hidden], DType::F32, device)?.mul((2.0 / din as f64).sqrt())?;
    let b1 = Tensor::zeros(&[hidden], DType::F32, device)?;
    let w2 = Tensor::randn(&[hidden, classes], DType::F32, device)?.mul((1.0 / hidden as f64).sqrt())?;
    let labels = Tensor::arange(0.0, batch as f64, 1.0, DType::I32, device)?.rem(classes as i32)?;

    let t0 = Instant::now();
    let h = x.matmul(&w1)?.add(&b1)?.relu()?;
    let logits = h.matmul(&w2)?;
    let loss = logits.cross_entropy(&labels, 0.0, voltaic::Reduction::Mean)?;
    let acc = logits.argmax(Some(-1), false)?.eq(&labels)?.to_dtype(DType::F32)?.mean(&[], false)?;
    let record = t0.elapsed();

    let plan = inspect(&[&loss, &acc]);
    println!("\nRecorded in {:.1} µs; the scheduler made {} kernels:", record.as_secs_f64() * 1e6, plan.len());
    for (i, k) in plan.iter().enumerate() {
        println!("  {:>2}. {:<12} {:>8} elements  fuses: {}", i + 1, k.kind, k.numel, k.ops.join(" "));
    }
    let t1 = Instant::now();
    Tensor::realize_all(&[&loss, &acc])?;
    let run = t1.elapsed();
    println!("\nRealized in {:.2} ms", run.as_secs_f64() * 1e3);
    println!("loss     = {}", loss);
    println!("accuracy = {}", acc);
    println!("logits[:2, :4] =\n{}", logits.narrow(0, 0, 2)?.narrow(1, 0, 4)?);
    Ok(())
}
