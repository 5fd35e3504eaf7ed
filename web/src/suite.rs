//! The op cases the browser test runs on WebGPU and compares with the same
//! cases computed natively (`web-fixtures` writes those). Every case builds
//! its inputs from a fixed seed with a generator of its own (not the
//! library's), runs through the async API only (the one a browser allows),
//! and returns named outputs.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use voltaic::nn::{Forward, Linear, Module, ReLU, Sequential};
use voltaic::optim::{Adam, Optimizer};
use voltaic::{Conv2dOpts, Device, Reduction, Result, Tensor};

/// The cases, in the order they run.
pub const CASES: &[&str] = &["elementwise_broadcast", "reductions", "softmax_layer_norm", "matmul", "conv2d_pool", "index_and_views", "half_types", "train_step_adam"];

/// Named outputs of one case.
pub type Outputs = BTreeMap<String, Vec<f64>>;

/// Every case's outputs, as written by `web-fixtures` and read by the page.
#[derive(Serialize, Deserialize, Debug, Default)]
pub struct Fixtures {
    /// Where they were computed (e.g. `cpu`).
    pub device: String,
    /// Outputs by case.
    pub cases: BTreeMap<String, Outputs>,
}

/// How one case compared.
#[derive(Serialize, Deserialize, Debug)]
pub struct CaseReport {
    /// The case.
    pub name: String,
    /// Whether every output matched within tolerance.
    pub ok: bool,
    /// The largest `|got - want| / (atol + rtol |want|)` over its outputs (<= 1 passes).
    pub worst: f64,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

/// SplitMix64 with a Box-Muller normal: inputs identical on every platform.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (1.0 - self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    fn tensor(&mut self, dims: &[usize], device: Device) -> Result<Tensor> {
        let v: Vec<f32> = (0..dims.iter().product::<usize>()).map(|_| self.normal()).collect();
        Tensor::from_vec(v, dims, device)
    }
}

async fn read(t: &Tensor) -> Result<Vec<f64>> {
    t.to_f64_vec_async().await
}

/// Run case `name` on `device`.
pub async fn run_case(name: &str, device: Device) -> Result<Outputs> {
    let mut rng = Rng::new(CASES.iter().position(|c| *c == name).unwrap_or(99) as u64 + 1);
    let mut out = Outputs::new();
    match name {
        "elementwise_broadcast" => {
            let a = rng.tensor(&[5, 1, 7], device)?;
            let b = rng.tensor(&[3, 7], device)?;
            let c = rng.tensor(&[7], device)?;
            let chain = a.mul(&b)?.add(&c.exp()?)?.tanh()?.sub(&a.abs()?.sqrt()?)?;
            out.insert("chain".into(), read(&chain).await?);
            let picked = a.gt(&b)?.where_cond(&a, &b.sigmoid()?)?.div(&c.abs()?.add(0.5)?)?;
            out.insert("where_div".into(), read(&picked).await?);
            let p = a.abs()?.add(0.1)?.pow(&b.mul(0.5)?)?.maximum(&c)?;
            out.insert("pow_maximum".into(), read(&p).await?);
        }
        "reductions" => {
            let x = rng.tensor(&[6, 9, 11], device)?;
            out.insert("sum_1".into(), read(&x.sum(&[1], false)?).await?);
            out.insert("max_last".into(), read(&x.max(&[-1], false)?).await?);
            out.insert("mean_0_2_keep".into(), read(&x.mean(&[0, 2], true)?).await?);
            out.insert("argmax_2".into(), read(&x.argmax(Some(2), false)?).await?);
            out.insert("var_0".into(), read(&x.var(&[0], 1, false)?).await?);
            out.insert("min_all".into(), read(&x.min(&[0, 1, 2], false)?).await?);
            // A reduction over a permuted (non-contiguous) view.
            out.insert("sum_of_permuted".into(), read(&x.permute(&[2, 0, 1])?.sum(&[2], false)?).await?);
        }
        "softmax_layer_norm" => {
            let x = rng.tensor(&[7, 33], device)?.mul(3.0)?;
            out.insert("softmax".into(), read(&x.softmax(-1)?).await?);
            out.insert("log_softmax_0".into(), read(&x.log_softmax(0)?).await?);
            let w = rng.tensor(&[33], device)?;
            let b = rng.tensor(&[33], device)?;
            out.insert("layer_norm".into(), read(&x.layer_norm(&[33], Some(&w), Some(&b), 1e-5)?).await?);
        }
        "matmul" => {
            let a = rng.tensor(&[37, 53], device)?;
            let b = rng.tensor(&[53, 29], device)?;
            out.insert("mm".into(), read(&a.matmul(&b)?).await?);
            let x = rng.tensor(&[3, 17, 19], device)?;
            let y = rng.tensor(&[3, 23, 19], device)?;
            out.insert("bmm_transposed".into(), read(&x.matmul(&y.transpose(1, 2)?)?).await?);
            let v = rng.tensor(&[53], device)?;
            out.insert("gemv".into(), read(&a.matmul(&v.reshape(&[53, 1])?)?).await?);
        }
        "conv2d_pool" => {
            let x = rng.tensor(&[2, 3, 13, 11], device)?;
            let w = rng.tensor(&[5, 3, 3, 3], device)?;
            let bias = rng.tensor(&[5], device)?;
            let opts = Conv2dOpts { stride: [2, 2], padding: [1, 1], ..Default::default() };
            let y = x.conv2d(&w, Some(&bias), opts)?;
            out.insert("conv2d".into(), read(&y).await?);
            out.insert("conv_relu_pool".into(), read(&y.relu()?.max_pool2d([2, 2], None, [0, 0])?).await?);
        }
        "index_and_views" => {
            let x = rng.tensor(&[8, 6], device)?;
            let idx = Tensor::from_vec(vec![7i32, 0, 3, 3, 5], &[5], device)?;
            out.insert("index_select".into(), read(&x.index_select(0, &idx)?).await?);
            out.insert("narrow_t".into(), read(&x.narrow(1, 2, 3)?.t()?.mul(2.0)?).await?);
            out.insert("empty".into(), read(&x.narrow(0, 3, 0)?.exp()?).await?);
        }
        "half_types" => {
            // f16 packed (SHADER_F16) or in 32-bit words, bf16 in words:
            // computed in f32 and rounded on every store, as the CPU does.
            let x = rng.tensor(&[9, 17], device)?;
            let y = rng.tensor(&[17, 5], device)?;
            for dt in [voltaic::DType::F16, voltaic::DType::BF16] {
                let (a, b) = (x.to_dtype(dt)?, y.to_dtype(dt)?);
                out.insert(format!("{dt} chain"), read(&a.mul(&a)?.add(0.1)?.relu()?.sub(&a)?).await?);
                out.insert(format!("{dt} softmax"), read(&a.softmax(-1)?).await?);
                out.insert(format!("{dt} matmul"), read(&a.matmul(&b)?).await?);
            }
        }
        "train_step_adam" => {
            // A small MLP, three Adam steps on a fixed batch: the losses and
            // the trained weights (forward, backward and optimizer on the device).
            let model = Sequential::new().add(Linear::new(12, 16, true, device)?).add(ReLU).add(Linear::new(16, 4, true, device)?);
            for (_, p) in model.named_tensors() {
                let dims = p.value().dims().to_vec();
                p.set(rng.tensor(&dims, device)?.mul(0.3)?)?;
            }
            let x = rng.tensor(&[10, 12], device)?;
            let y = Tensor::from_vec((0..10i32).map(|i| i * 7 % 4).collect::<Vec<i32>>(), &[10], device)?;
            let mut opt = Adam::new(model.parameters(), 1e-2);
            let mut losses = Vec::new();
            for _ in 0..3 {
                opt.zero_grad();
                let loss = model.forward(&x)?.cross_entropy(&y, 0.0, Reduction::Mean)?;
                loss.backward()?;
                opt.step()?;
                losses.push(loss.item_async::<f32>().await? as f64);
            }
            out.insert("losses".into(), losses);
            for (name, p) in model.named_tensors() {
                out.insert(format!("weight {name}"), read(&p.value()).await?);
            }
        }
        other => return Err(voltaic::Error::Value { op: "web suite", msg: format!("no case named {other:?}") }),
    }
    Ok(out)
}

/// Every case on `device`.
pub async fn run_all(device: Device) -> Result<Fixtures> {
    let mut f = Fixtures { device: format!("{device:?}"), cases: BTreeMap::new() };
    for name in CASES {
        f.cases.insert(name.to_string(), run_case(name, device).await?);
    }
    Ok(f)
}

/// Compare one case's outputs with the expected ones
/// (`|got - want| <= atol + rtol |want|`, f32 on different hardware).
pub fn compare(name: &str, want: &Outputs, got: &Result<Outputs>) -> CaseReport {
    // Half types: an f32 result one side of a rounding boundary and not the
    // other differs by one unit in the last place (bf16: 2^-7 relative).
    let (rtol, atol) = if name == "half_types" { (1e-2, 1e-3) } else { (2e-4, 2e-5) };
    let got = match got {
        Ok(g) => g,
        Err(e) => return CaseReport { name: name.into(), ok: false, worst: f64::INFINITY, error: Some(e.to_string()) },
    };
    let mut worst: f64 = 0.0;
    let mut error = None;
    for (k, w) in want {
        match got.get(k) {
            Some(g) if g.len() == w.len() => {
                for (a, b) in g.iter().zip(w) {
                    let r = if a == b { 0.0 } else { (a - b).abs() / (atol + rtol * b.abs()) };
                    worst = worst.max(if r.is_nan() { f64::INFINITY } else { r });
                }
            }
            Some(g) => error = Some(format!("{k}: {} values, expected {}", g.len(), w.len())),
            None => error = Some(format!("{k}: missing")),
        }
    }
    if want.is_empty() || got.len() != want.len() {
        error = error.or(Some(format!("{} outputs, expected {}", got.len(), want.len())));
    }
    CaseReport { name: name.into(), ok: error.is_none() && worst <= 1.0, worst, error }
}
