//! Kernels, realizations and host time per data-parallel step against a
//! plain step of the same model: where the gradient exchange costs.
//!
//! `cargo run --release -p voltaic --example ddp_profile -- gpu:0 [replicas]`
use voltaic::distributed::{DataParallel, DeviceGroup};
use voltaic::models::bert::{BertConfig, BertModel};
use voltaic::nn::Module;
use voltaic::optim::{Adam, Optimizer};
use voltaic::{DType, Device, Tensor};

fn config() -> BertConfig {
    BertConfig {
        vocab_size: 1000,
        hidden_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 128,
        max_position_embeddings: 64,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_act: "gelu".into(),
    }
}

fn loss(m: &BertModel, rows: &[Tensor]) -> voltaic::Result<Tensor> {
    m.forward(&rows[0], &rows[1])?.sqr()?.mean(&[], false)
}

fn main() -> voltaic::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let device = Device::parse(args.get(1).map(String::as_str).unwrap_or("cpu"))?;
    let replicas: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2);
    let (b, t) = (4 * replicas, 16);
    let ids = Tensor::rand(&[b, t], DType::F32, Device::Cpu)?.mul(1000.0)?.floor()?.to_dtype(DType::I32)?;
    let mask = Tensor::ones(&[b, t], DType::I32, Device::Cpu)?;
    let measure = |what: &str, devices: &[Device], step: &mut dyn FnMut() -> voltaic::Result<()>| -> voltaic::Result<()> {
        for _ in 0..5 {
            step()?;
        }
        let stats = |d: &Device| d.stats().map(|s| s.dispatches).unwrap_or(0);
        let d0: u64 = devices.iter().map(stats).sum();
        let h0 = voltaic::host_profile();
        let t0 = std::time::Instant::now();
        let n = 5;
        for _ in 0..n {
            step()?;
        }
        for d in devices {
            d.synchronize()?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / n as f64;
        let h = voltaic::host_profile().since(&h0);
        let d1: u64 = devices.iter().map(stats).sum();
        println!("{what:<28} {ms:>8.1} ms/step  {:>6.1} dispatches/step  {:>5.1} realizations/step", (d1 - d0) as f64 / n as f64, h.realizations as f64 / n as f64);
        Ok(())
    };
    {
        voltaic::manual_seed(0);
        let m = BertModel::new(config(), device)?;
        let mut opt = Adam::adamw(m.parameters(), 1e-3);
        let rows = [ids.to_device(device)?, mask.to_device(device)?];
        measure("plain step, whole batch", &[device], &mut || {
            opt.zero_grad();
            loss(&m, &rows)?.backward()?;
            opt.step()?;
            m.realize_state()
        })?;
    }
    for (n, bucket) in [(1, 25 << 20), (replicas, 25 << 20), (replicas, 16 << 10)] {
        let group = DeviceGroup::replicas(device, n)?;
        let mut dp = DataParallel::new(&group, |d| BertModel::new(config(), d), |m| Box::new(Adam::adamw(m.parameters(), 1e-3)))?;
        dp.set_bucket_bytes(bucket.min(1 << 20), bucket);
        let devices: Vec<Device> = if device == Device::Cpu { vec![device] } else { group.devices().to_vec() };
        measure(&format!("DataParallel, {n} replica(s), buckets of {} KiB", bucket >> 10), &devices, &mut || dp.step(&[&ids, &mask], loss).map(|_| ()))?;
        println!("    last sync: {:?}", dp.last_sync()[0]);
    }
    Ok(())
}
