//! Host time per phase of a transformer-encoder training step (MiniLM's
//! shape: 6 layers, AdamW, under autocast with a GradScaler for f16), and
//! the dispatches, bind groups and buffers each step creates.
//!
//! `cargo run --release -p voltaic --example host_profile -- f16 20`
//! (precision f32|f16|bf16, timed steps). Environment: `CPU=1` runs on the
//! CPU; `SMALL=1` narrows the model (width 64, vocabulary 1000: the same
//! graph, so the same host work, for a software GPU); `WARM=N` warm-up
//! steps before timing (default 3; the pool settles on its buffers, and
//! the bind groups with them, within about 30 steps).
use voltaic::models::bert::{BertConfig, BertModel};
use voltaic::nn::{Forward, Linear, Module};
use voltaic::optim::{Adam, GradScaler, Optimizer};
use voltaic::{DType, Device, Reduction, Tensor};

// The allocator the `voltaic` command uses, so that the host phases here
// are the ones it sees (glibc's malloc makes recording about a third slower).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let prec = std::env::args().nth(1).unwrap_or("f16".into());
    let steps: usize = std::env::args().nth(2).unwrap_or("20".into()).parse()?;
    let warm: usize = std::env::var("WARM").unwrap_or("3".into()).parse()?;
    let dev = if std::env::var("CPU").is_ok() { Device::Cpu } else { Device::Gpu(0) };
    let low = match prec.as_str() {
        "f16" => Some(DType::F16),
        "bf16" => Some(DType::BF16),
        "f32" => None,
        other => return Err(format!("precision must be f32, f16 or bf16, not {other}").into()),
    };
    voltaic::manual_seed(0);
    let small = std::env::var("SMALL").is_ok();
    let (v, h, nh, ff) = if small { (1000, 64, 4, 128) } else { (30522, 384, 12, 1536) };
    let config = BertConfig { vocab_size: v, hidden_size: h, num_hidden_layers: 6, num_attention_heads: nh, intermediate_size: ff, max_position_embeddings: 512, type_vocab_size: 2, layer_norm_eps: 1e-12, hidden_act: "gelu".into() };
    let model = BertModel::new(config, dev)?;
    let head = Linear::new(h, 10, true, dev)?;
    let mut params = model.parameters();
    params.extend(head.parameters());
    let mut opt = Adam::adamw(params, 1e-4);
    let mut scaler = (low == Some(DType::F16)).then(GradScaler::new);
    let (batch, seq) = (2usize, 16usize);
    let ids = Tensor::rand(&[batch, seq], DType::F32, dev)?.mul(v as f64)?.floor()?.to_dtype(DType::I32)?;
    let mask = Tensor::ones(&[batch, seq], DType::I32, dev)?;
    let y = Tensor::arange(0.0, batch as f64, 1.0, DType::I32, dev)?.rem(10)?;
    let mut step = || -> Result<(), Box<dyn std::error::Error>> {
        let loss = {
            let _a = voltaic::AutocastGuard::new(low);
            let h = model.forward(&ids, &mask)?;
            head.forward(&h.narrow(1, 0, 1)?.squeeze(1)?)?.cross_entropy(&y, 0.0, Reduction::Mean)?
        };
        opt.zero_grad();
        match &mut scaler {
            Some(s) => {
                s.scale(&loss)?.backward()?;
                s.step(&mut opt)?;
                s.update()?;
            }
            None => {
                loss.backward()?;
                opt.step()?;
            }
        }
        model.realize_state()?;
        Ok(())
    };
    for _ in 0..warm {
        step()?;
    }
    // Let the warm-up's work finish before the clock starts.
    Tensor::zeros(&[1], DType::F32, dev)?.add(1.0)?.item::<f32>()?;
    let s0 = dev.stats()?;
    let p0 = voltaic::host_profile();
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        step()?;
    }
    // The wall time includes the last step's device work (and the process
    // does not exit with work in flight, which lavapipe has crashed on).
    dev.synchronize()?;
    let p1 = voltaic::host_profile();
    let s1 = dev.stats()?;
    let per = |a: u64, b: u64| (b - a) as f64 / steps as f64;
    println!(
        "per step: {:.0} dispatches, {:.0} bind groups created, {:.0} buffers created, {:.0} submissions",
        per(s0.dispatches, s1.dispatches),
        per(s0.bind_groups, s1.bind_groups),
        per(s0.memory.allocations, s1.memory.allocations),
        per(s0.submissions, s1.submissions)
    );
    let el = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
    let d = p1.since(&p0);
    println!(
        "{prec} on {dev}: {el:.2} ms per step (wall), {:.1} realizations and {:.0} graph nodes per step; host us per step:",
        d.realizations as f64 / steps as f64,
        d.nodes as f64 / steps as f64
    );
    for (n, v) in d.phases() {
        println!("  {n:>8}: {:8.0}", v / steps as f64);
    }
    Ok(())
}
