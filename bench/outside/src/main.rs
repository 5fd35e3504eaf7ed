//! Times three rows of the CPU suite (chain10_f32_16m, softmax_rows_4096,
//! sum_f32_64m) with the same work and the same median-of-7 as `voltaic
//! bench`, from a crate that depends on Voltaic the ordinary way.

use std::time::Instant;
use voltaic::{DType, Device, Tensor};

fn median_ms(f: impl Fn() -> voltaic::Result<()>) -> voltaic::Result<f64> {
    f()?;
    f()?;
    let mut t: Vec<f64> = (0..7)
        .map(|_| {
            let t0 = Instant::now();
            f().map(|_| t0.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<voltaic::Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[3])
}

fn main() -> voltaic::Result<()> {
    let dev = Device::Cpu;
    voltaic::manual_seed(7);
    let n = 1 << 24;
    let (x, y) = (Tensor::randn(&[n], DType::F32, dev)?, Tensor::randn(&[n], DType::F32, dev)?);
    let chain = |x: &Tensor, y: &Tensor| x.mul(2.0)?.add(1.0)?.relu()?.sub(y)?.abs()?.sqrt()?.mul(y)?.add(3.0)?.mul(0.5)?.sub(y);
    let ms = median_ms(|| chain(&x, &y)?.realize().map(|_| ()))?;
    println!("chain10_f32_16m    {ms:8.2} ms");
    let s = Tensor::randn(&[4096, 4096], DType::F32, dev)?;
    let ms = median_ms(|| s.softmax(-1)?.realize().map(|_| ()))?;
    println!("softmax_rows_4096  {ms:8.2} ms");
    let big = Tensor::randn(&[1 << 26], DType::F32, dev)?;
    let ms = median_ms(|| big.sum_all()?.realize().map(|_| ()))?;
    println!("sum_f32_64m        {ms:8.2} ms");
    Ok(())
}
