//! Gradients as in PyTorch: mark leaves with `requires_grad`, compute, call
//! `backward`, read `.grad()`. The gradient graph is lazy too, so a backward
//! pass fuses and runs on the GPU like the forward one.
//!
//! ```sh
//! cargo run --release --example autograd
//! ```

use voltaic::prelude::*;

fn main() -> Result<()> {
    let dev = Device::Cpu;
    // f(x, w) = sum(tanh(x @ w) ^ 2)
    let x = Tensor::from_vec(vec![0.5f32, -1.0, 2.0, 0.25], &[2, 2], dev)?.requires_grad()?;
    let w = Tensor::from_vec(vec![0.1f32, 0.2, -0.3, 0.4], &[2, 2], dev)?.requires_grad()?;
    let y = x.matmul(&w)?.tanh()?.sqr()?.sum_all()?;
    y.backward()?;
    let gx = x.grad().expect("x requires grad").to_vec::<f32>()?;
    let gw = w.grad().expect("w requires grad").to_vec::<f32>()?;
    println!("f = {:.6}", y.item::<f32>()?);
    println!("df/dx = {gx:?}");
    println!("df/dw = {gw:?}");

    // Check one entry against a central finite difference.
    let f = |x00: f32| -> Result<f32> {
        let x = Tensor::from_vec(vec![x00, -1.0, 2.0, 0.25], &[2, 2], dev)?;
        x.matmul(&w.detach())?.tanh()?.sqr()?.sum_all()?.item::<f32>()
    };
    let h = 1e-2f32;
    let fd = (f(0.5 + h)? - f(0.5 - h)?) / (2.0 * h);
    println!("finite difference for df/dx[0,0] = {fd:.5} (autograd {:.5})", gx[0]);
    assert!((fd - gx[0]).abs() < 1e-3, "autograd disagrees with the finite difference");

    // Inside no_grad nothing is recorded, as with torch.no_grad().
    let z = voltaic::no_grad(|| x.mul(2.0))?;
    println!("recorded under no_grad: {}", z.is_tracked());
    Ok(())
}
