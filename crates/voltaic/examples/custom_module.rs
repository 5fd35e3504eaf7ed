//! A model of your own: `#[derive(Module)]` finds its parameters (with
//! PyTorch `state_dict` names), Adam trains them, `nn::save` and `nn::load`
//! write and read them as safetensors.
//!
//! ```sh
//! cargo run --release --example custom_module
//! ```

use voltaic::optim::Adam;
use voltaic::prelude::*;

/// A two-layer perceptron with a learned output scale.
#[derive(Module)]
struct Mlp {
    hidden: nn::Linear,
    out: nn::Linear,
    scale: Parameter,
    dropout: nn::Dropout,
}

impl Mlp {
    fn new(inputs: usize, width: usize, dev: Device) -> Result<Mlp> {
        Ok(Mlp {
            hidden: nn::Linear::new(inputs, width, true, dev)?,
            out: nn::Linear::new(width, 1, true, dev)?,
            scale: Parameter::new(Tensor::ones(&[1], DType::F32, dev)?)?,
            dropout: nn::Dropout::new(0.1)?,
        })
    }
}

impl Forward for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.dropout.forward(&self.hidden.forward(x)?.relu()?)?;
        self.out.forward(&h)?.mul(self.scale.value())
    }
}

fn main() -> Result<()> {
    voltaic::manual_seed(0);
    let dev = Device::Cpu;
    // Learn y = sin(x0) + x1^2 / 2 from 256 random points.
    let x = Tensor::rand(&[256, 2], DType::F32, dev)?.mul(4.0)?.sub(2.0)?;
    let x0 = x.narrow(1, 0, 1)?;
    let x1 = x.narrow(1, 1, 1)?;
    let y = x0.sin()?.add(&x1.sqr()?.mul(0.5)?)?;

    let model = Mlp::new(2, 64, dev)?;
    for (name, p) in model.named_parameters() {
        println!("{name:14} {:?}", p.value().dims());
    }
    let mut opt = Adam::new(model.parameters(), 1e-2);
    model.train();
    for step in 0..=300 {
        let loss = model.forward(&x)?.mse_loss(&y, Reduction::Mean)?;
        opt.zero_grad();
        loss.backward()?;
        opt.step()?;
        if step % 100 == 0 {
            println!("step {step:3}: loss {:.5}", loss.item::<f32>()?);
        }
    }

    // Save, load into a fresh model, and check it predicts the same.
    model.eval();
    let path = std::env::temp_dir().join("voltaic-example-mlp.safetensors");
    nn::save(&model, &path)?;
    let restored = Mlp::new(2, 64, dev)?;
    nn::load(&restored, &path)?;
    restored.eval();
    let (a, b) = (model.forward(&x)?.to_vec::<f32>()?, restored.forward(&x)?.to_vec::<f32>()?);
    assert_eq!(a, b, "the reloaded model predicts the same");
    let final_loss = restored.forward(&x)?.mse_loss(&y, Reduction::Mean)?.item::<f32>()?;
    println!("reloaded from {}: loss {final_loss:.5}", path.display());
    assert!(final_loss < 0.05, "the model did not learn the function (loss {final_loss})");
    std::fs::remove_file(&path).ok();
    Ok(())
}
