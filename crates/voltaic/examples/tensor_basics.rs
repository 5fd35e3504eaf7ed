//! Tensors as in PyTorch: create, compute, view without copying, reduce,
//! and move between devices. Nothing runs until a value is needed; then the
//! pending ops are fused into a few kernels.
//!
//! ```sh
//! cargo run --release --example tensor_basics
//! ```

use voltaic::prelude::*;

fn main() -> Result<()> {
    voltaic::manual_seed(0);
    let dev = Device::best(); // the best GPU wgpu finds, else the CPU
    println!("device: {dev}");

    // Creation: from data, filled, ranges and random.
    let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], dev)?;
    let b = Tensor::ones(&[2, 3], DType::F32, dev)?;
    let r = Tensor::arange(0.0, 6.0, 1.0, DType::F32, dev)?.reshape_dims(&[2, 3])?;
    let noise = Tensor::randn(&[2, 3], DType::F32, dev)?;

    // Arithmetic broadcasts like PyTorch; each op returns a Result.
    let c = a.mul(&b)?.add(&r)?.add(2.0)?; // a * b + r + 2
    println!("c = {c}");

    // Views share storage: transpose, narrow, permute copy nothing.
    let ct = c.t()?;
    println!("c.T has shape {:?}, shares c's storage: {}", ct.dims(), ct.same_storage(&c));

    // Reductions take dims and keepdim, as torch.sum(x, dim, keepdim).
    let rows = c.sum(&[1], false)?;
    let mean = c.mean(&[0, 1], false)?;
    println!("row sums = {:?}, mean = {}", rows.to_vec::<f32>()?, mean.item::<f32>()?);

    // Matrix products and a softmax; the last line realizes them together.
    let p = c.matmul(&ct)?.softmax(-1)?;
    let total: f32 = p.sum(&[-1], false)?.to_vec::<f32>()?.iter().sum();
    println!("softmax rows sum to {total:.4} (2 rows)");

    // Move to the CPU (a no-op there) and read the values out.
    let host = noise.to_device(Device::Cpu)?;
    println!("noise on the CPU: {:?}", host.to_vec::<f32>()?);

    // Bad input is an error that says what was expected, never a panic.
    let err = a.matmul(&a).unwrap_err();
    println!("a @ a fails as it should: {err}");
    Ok(())
}
