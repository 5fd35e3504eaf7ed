//! Kernels, realizations and host time per data-parallel step against a
//! plain step of the same model: where the gradient exchange costs.
//!
//! `cargo run --release -p voltaic --example ddp_profile -- gpu:0,gpu:0 [small|minilm]`
//! (with `VOLTAIC_PROFILE=1`, a line per realization too).
use voltaic::distributed::{DataParallel, DeviceGroup};
use voltaic::models::bert::{BertConfig, BertModel};
use voltaic::nn::Module;
use voltaic::optim::{Adam, Optimizer};
use voltaic::{DType, Device, Tensor};

fn config(minilm: bool) -> BertConfig {
    let (vocab, d, layers, heads, ff) = if minilm { (30522, 384, 6, 12, 1536) } else { (1000, 64, 2, 4, 128) };
    BertConfig {
        vocab_size: vocab,
        hidden_size: d,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        intermediate_size: ff,
        max_position_embeddings: 512,
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
    let devices: Vec<Device> = args.get(1).map(String::as_str).unwrap_or("cpu,cpu").split(',').map(Device::parse).collect::<voltaic::Result<_>>()?;
    let minilm = args.get(2).is_some_and(|s| s == "minilm");
    let cfg = || config(minilm);
    let (per, t) = if minilm { (32, 128) } else { (4, 16) };
    let vocab = cfg().vocab_size as f64;
    let batch = |n: usize| -> voltaic::Result<[Tensor; 2]> {
        let ids = Tensor::rand(&[n, t], DType::F32, Device::Cpu)?.mul(vocab)?.floor()?.to_dtype(DType::I32)?;
        Ok([ids, Tensor::ones(&[n, t], DType::I32, Device::Cpu)?])
    };
    let measure = |what: &str, devices: &[Device], step: &mut dyn FnMut() -> voltaic::Result<()>| -> voltaic::Result<()> {
        for _ in 0..5 {
            step()?;
        }
        voltaic::backend::finish_tuning();
        let mut distinct = devices.to_vec();
        distinct.dedup();
        let stats = |d: &Device| d.stats().map(|s| s.dispatches).unwrap_or(0);
        let d0: u64 = distinct.iter().map(stats).sum();
        let h0 = voltaic::host_profile();
        let t0 = std::time::Instant::now();
        let n = 5;
        for _ in 0..n {
            step()?;
        }
        for d in &distinct {
            d.synchronize()?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / n as f64;
        let h = voltaic::host_profile().since(&h0);
        let d1: u64 = distinct.iter().map(stats).sum();
        let phases: Vec<String> = h.phases().iter().filter(|(_, us)| *us > 0.0).map(|(p, us)| format!("{p} {:.1}", us / 1e3 / n as f64)).collect();
        println!(
            "{what:<40} {ms:>8.1} ms/step  {:>6.0} dispatches/step  {:>4.1} realizations/step  host ms/step (all threads): {}",
            (d1 - d0) as f64 / n as f64,
            h.realizations as f64 / n as f64,
            phases.join(", ")
        );
        Ok(())
    };
    {
        voltaic::manual_seed(0);
        let device = devices[0];
        let m = BertModel::new(cfg(), device)?;
        let mut opt = Adam::adamw(m.parameters(), 1e-3);
        let host = batch(per)?;
        measure("plain step, one replica's batch", &[device], &mut || {
            let rows = [host[0].to_device(device)?, host[1].to_device(device)?];
            opt.zero_grad();
            loss(&m, &rows)?.backward()?;
            opt.step()?;
            m.realize_state()
        })?;
    }
    for group in [&devices[..1], &devices[..]] {
        let group = DeviceGroup::new(group)?;
        let mut dp = DataParallel::new(&group, |d| BertModel::new(cfg(), d), |m| Box::new(Adam::adamw(m.parameters(), 1e-3)))?;
        let host = batch(per * group.len())?;
        let names: Vec<String> = group.devices().iter().map(|d| d.to_string()).collect();
        measure(&format!("DataParallel over {}", names.join(",")), group.devices(), &mut || dp.step(&[&host[0], &host[1]], loss).map(|_| ()))?;
        let s = dp.last_sync()[0];
        println!(
            "    last sync of replica 0: {} buckets, {:.1} MB, {:.1} ms from backward to summed gradients: {:.1} recording backward, {:.1} realizing buckets, {:.1} waiting for reads, {:.1} all-reduce, {:.1} the rest",
            s.buckets,
            s.bytes as f64 / 1e6,
            s.total_seconds * 1e3,
            s.backward_seconds * 1e3,
            s.realize_seconds * 1e3,
            s.read_seconds * 1e3,
            s.reduce_seconds * 1e3,
            (s.total_seconds - s.backward_seconds - s.realize_seconds - s.read_seconds - s.reduce_seconds) * 1e3
        );
    }
    Ok(())
}
