//! nn modules, initialisers, losses, optimizers, schedules, checkpoints and
//! the data loader, each against an independent reference; and the same
//! short training run on the CPU and the GPU.

use std::sync::Arc;
use voltaic::data::{epoch_order, DataLoader, Dataset, LoaderOpts};
use voltaic::nn::{self, BatchNorm, Dropout, Forward, Linear, Module, Parameter};
use voltaic::optim::{clip_grad_norm, Adam, CosineLr, LrSchedule, Optimizer, Sgd, StepLr, WarmupLr};
use voltaic::{DType, Device, Reduction, Tensor};

fn t(v: &[f64], d: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), d, Device::Cpu).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn state_dict_names_match_pytorch() {
    let names = |m: &dyn Module| m.named_tensors().into_iter().map(|(n, p)| (n, p.value().dims().to_vec())).collect::<Vec<_>>();
    // nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    let mlp = voltaic::models::classifier::mlp(Device::Cpu).unwrap();
    assert_eq!(
        names(&mlp),
        vec![
            ("1.weight".into(), vec![256, 784]),
            ("1.bias".into(), vec![256]),
            ("3.weight".into(), vec![128, 256]),
            ("3.bias".into(), vec![128]),
            ("5.weight".into(), vec![10, 128]),
            ("5.bias".into(), vec![10]),
        ]
    );
    let cnn = voltaic::models::classifier::cnn(Device::Cpu).unwrap();
    let n: Vec<String> = names(&cnn).into_iter().map(|(n, _)| n).collect();
    assert_eq!(n, ["0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias"]);
    let bn = BatchNorm::new(4, Device::Cpu).unwrap();
    let n: Vec<String> = names(&bn).into_iter().map(|(n, _)| n).collect();
    assert_eq!(n, ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]);
    assert_eq!(bn.named_parameters().len(), 2, "buffers are not trained");
}

#[test]
fn default_initialisation_follows_pytorch() {
    voltaic::manual_seed(5);
    let l = Linear::new(400, 300, true, Device::Cpu).unwrap();
    let w = l.weight.value().to_vec::<f32>().unwrap();
    let bound = 1.0 / 400f32.sqrt();
    assert!(w.iter().all(|x| x.abs() <= bound));
    // Uniform on [-b, b] has standard deviation b / sqrt(3).
    let mean = w.iter().sum::<f32>() / w.len() as f32;
    let sd = (w.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / w.len() as f32).sqrt();
    assert!((sd - bound / 3f32.sqrt()).abs() < 0.02 * bound, "{sd}");
    let k = nn::init::kaiming_normal(&[256, 100, 3, 3], 0.0, Device::Cpu).unwrap().to_vec::<f32>().unwrap();
    let sd = (k.iter().map(|x| x * x).sum::<f32>() / k.len() as f32).sqrt();
    assert!((sd - (2.0f32 / 900.0).sqrt()).abs() < 0.01 * sd, "{sd}");
    let x = nn::init::xavier_uniform(&[50, 70], 1.0, Device::Cpu).unwrap().to_vec::<f32>().unwrap();
    assert!(x.iter().all(|v| v.abs() <= (6.0f32 / 120.0).sqrt()));
}

#[test]
fn batch_norm_trains_on_batch_statistics_and_evaluates_on_running_ones() {
    let bn = BatchNorm::new(2, Device::Cpu).unwrap();
    let x: Vec<f64> = (0..12).map(|i| (i * i % 7) as f64).collect();
    let xt = t(&x, &[3, 2, 2]).to_dtype(DType::F32).unwrap();
    let y = bn.forward(&xt).unwrap().to_vec::<f32>().unwrap();
    // Channel c holds x[n, c, :] for every n.
    let chan = |c: usize| -> Vec<f64> {
        let mut v = vec![];
        for n in 0..3 {
            for k in 0..2 {
                v.push(x[n * 4 + c * 2 + k]);
            }
        }
        v
    };
    let mut want = vec![0.0; 12];
    let mut rm = vec![];
    let mut rv = vec![];
    for c in 0..2 {
        let v = chan(c);
        let m = v.iter().sum::<f64>() / 6.0;
        let var = v.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 6.0;
        for n in 0..3 {
            for k in 0..2 {
                want[n * 4 + c * 2 + k] = (x[n * 4 + c * 2 + k] - m) / (var + 1e-5).sqrt();
            }
        }
        rm.push(0.1 * m);
        rv.push(0.9 + 0.1 * var * 6.0 / 5.0);
    }
    close(&y.iter().map(|&v| v as f64).collect::<Vec<_>>(), &want, 1e-5, "train-mode output");
    let state = bn.named_tensors();
    close(&state[2].1.value().to_f64_vec().unwrap(), &rm, 1e-6, "running_mean");
    close(&state[3].1.value().to_f64_vec().unwrap(), &rv, 1e-6, "running_var");
    assert_eq!(state[4].1.value().item::<i32>().unwrap(), 1);
    bn.eval();
    let e = bn.forward(&xt).unwrap().to_f64_vec().unwrap();
    let want_eval: Vec<f64> = (0..12).map(|i| { let c = (i / 2) % 2; (x[i] - rm[c]) / (rv[c] + 1e-5).sqrt() }).collect();
    close(&e, &want_eval, 1e-5, "eval-mode output");
    let d = Dropout::new(0.5).unwrap();
    d.eval();
    assert_eq!(d.forward(&xt).unwrap().to_vec::<f32>().unwrap(), xt.to_vec::<f32>().unwrap());
}

#[test]
fn losses_match_their_formulas() {
    let logits = t(&[0.5, -1.0, 2.0, 0.0, 3.0, -2.0], &[2, 3]);
    let target = Tensor::from_vec(vec![2i32, 0], &[2], Device::Cpu).unwrap();
    let logp = logits.log_softmax(1).unwrap();
    let nll = nn::nll_loss(&logp, &target, Reduction::Mean).unwrap().item::<f64>().unwrap();
    let lp = logp.to_vec::<f64>().unwrap();
    assert!((nll - -(lp[2] + lp[3]) / 2.0).abs() < 1e-12);
    let y = t(&[1.0, 0.0, 1.0, 0.0, 0.5, 1.0], &[2, 3]);
    let bce = nn::binary_cross_entropy_with_logits(&logits, &y, Reduction::Sum).unwrap().item::<f64>().unwrap();
    let (lv, yv) = (logits.to_vec::<f64>().unwrap(), y.to_vec::<f64>().unwrap());
    let want: f64 = lv.iter().zip(&yv).map(|(&x, &y)| { let s = 1.0 / (1.0 + (-x).exp()); -(y * s.ln() + (1.0 - y) * (1.0 - s).ln()) }).sum();
    assert!((bce - want).abs() < 1e-12, "{bce} vs {want}");
}

/// A reference optimizer step: (weights, gradient, step number, state).
type RefStep<'a> = dyn Fn(&mut Vec<f64>, &[f64], usize, &mut Vec<Vec<f64>>) + 'a;

/// Minimise `sum((w - c)^2)` and compare every step with a plain f64 reference.
fn run_opt(make: &dyn Fn(Vec<Parameter>) -> Box<dyn Optimizer>, reference: &RefStep<'_>) {
    let c = [0.5, -1.0, 2.0];
    let p = Parameter::new(t(&[1.0, 1.0, 1.0], &[3])).unwrap();
    let mut opt = make(vec![p.clone()]);
    let mut w = vec![1.0; 3];
    let mut state = vec![];
    for step in 1..=4 {
        opt.zero_grad();
        let loss = p.value().sub(t(&c, &[3])).unwrap().sqr().unwrap().sum_all().unwrap();
        loss.backward().unwrap();
        // Every other step realizes the loss with the update (`step_with`):
        // the update is the same, and the loss is the one before it.
        if step % 2 == 0 {
            let seen = loss.detach();
            opt.step_with(&[&seen]).unwrap();
            assert!(seen.is_realized(), "step {step}: step_with realizes what it is given");
            let want: f64 = w.iter().zip(&c).map(|(w, c)| (w - c) * (w - c)).sum();
            close(&[seen.item::<f64>().unwrap()], &[want], 1e-12, &format!("step {step}: the loss"));
        } else {
            opt.step().unwrap();
        }
        let g: Vec<f64> = w.iter().zip(&c).map(|(w, c)| 2.0 * (w - c)).collect();
        reference(&mut w, &g, step, &mut state);
        close(&p.value().to_vec::<f64>().unwrap(), &w, 1e-12, &format!("step {step}"));
    }
}

#[test]
fn optimizers_follow_pytorch_formulas() {
    // SGD with momentum 0.9, dampening 0.1, Nesterov off, weight decay 0.01.
    run_opt(
        &|p| {
            let mut o = Sgd::new(p, 0.1).with_momentum(0.9, false).with_weight_decay(0.01);
            o.dampening = 0.1;
            Box::new(o)
        },
        &|w, g, step, st| {
            let g: Vec<f64> = g.iter().zip(w.iter()).map(|(g, w)| g + 0.01 * w).collect();
            if step == 1 {
                *st = vec![g.clone()];
            } else {
                st[0] = st[0].iter().zip(&g).map(|(b, g)| 0.9 * b + 0.9 * g).collect();
            }
            for (w, b) in w.iter_mut().zip(&st[0]) {
                *w -= 0.1 * b;
            }
        },
    );
    // Nesterov.
    run_opt(&|p| Box::new(Sgd::new(p, 0.05).with_momentum(0.8, true)), &|w, g, step, st| {
        if step == 1 {
            *st = vec![g.to_vec()];
        } else {
            st[0] = st[0].iter().zip(g).map(|(b, g)| 0.8 * b + g).collect();
        }
        for ((w, b), g) in w.iter_mut().zip(&st[0]).zip(g) {
            *w -= 0.05 * (g + 0.8 * b);
        }
    });
    // Adam and AdamW.
    for decoupled in [false, true] {
        run_opt(
            &|p| {
                let mut o = Adam::new(p, 0.1);
                o.weight_decay = 0.05;
                o.decoupled = decoupled;
                Box::new(o)
            },
            &|w, g, step, st| {
                if step == 1 {
                    *st = vec![vec![0.0; 3], vec![0.0; 3]];
                }
                for i in 0..3 {
                    let mut gi = g[i];
                    if decoupled {
                        w[i] *= 1.0 - 0.1 * 0.05;
                    } else {
                        gi += 0.05 * w[i];
                    }
                    st[0][i] = 0.9 * st[0][i] + 0.1 * gi;
                    st[1][i] = 0.999 * st[1][i] + 0.001 * gi * gi;
                    let mh = st[0][i] / (1.0 - 0.9f64.powi(step as i32));
                    let vh = st[1][i] / (1.0 - 0.999f64.powi(step as i32));
                    w[i] -= 0.1 * mh / (vh.sqrt() + 1e-8);
                }
            },
        );
    }
}

/// Adam over several parameters updates them as one vector: odd sizes, a
/// matrix, an empty parameter, one replaced between steps (its moments
/// carry over) and a state saved and loaded mid-run, each step against the
/// f64 reference, on the CPU and the GPU (lavapipe in CI).
#[test]
fn adam_over_several_parameters_follows_pytorch_formulas() {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    let shapes: [&[usize]; 4] = [&[3], &[2, 5], &[67], &[0]];
    for device in [Device::Cpu, Device::Gpu(0)] {
        for decoupled in [false, true] {
            let what = format!("{device:?}, decoupled {decoupled}");
            let mut w: Vec<Vec<f64>> = shapes.iter().enumerate().map(|(i, s)| (0..s.iter().product::<usize>()).map(|j| ((i * 7 + j * 3) % 11) as f64 * 0.3 - 1.4).collect()).collect();
            let targets: Vec<Vec<f64>> = w.iter().map(|v| v.iter().enumerate().map(|(j, _)| (j % 5) as f64 * 0.5 - 1.0).collect()).collect();
            let params: Vec<Parameter> = w.iter().zip(shapes).map(|(v, s)| Parameter::new(t(v, s).to_dtype(DType::F32).unwrap().to_device(device).unwrap()).unwrap()).collect();
            let make = |p: Vec<Parameter>| {
                let mut o = Adam::new(p, 0.1);
                o.weight_decay = 0.05;
                o.decoupled = decoupled;
                o
            };
            let mut opt = make(params.clone());
            let (mut m, mut v): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (w.iter().map(|x| vec![0.0; x.len()]).collect(), w.iter().map(|x| vec![0.0; x.len()]).collect());
            for step in 1..=6 {
                if step == 3 {
                    // A parameter replaced by a tensor of its own.
                    w[1] = w[1].iter().map(|x| x + 0.25).collect();
                    params[1].set(t(&w[1], shapes[1]).to_dtype(DType::F32).unwrap().to_device(device).unwrap()).unwrap();
                }
                if step == 5 {
                    // The state (moments and step count) saved and loaded
                    // into a new optimizer, which goes on from it.
                    let mut next = make(params.clone());
                    next.load_state(&opt.state()).unwrap();
                    opt = next;
                }
                opt.zero_grad();
                let mut loss = Tensor::zeros(&[], DType::F32, device).unwrap();
                for (i, (p, c)) in params.iter().zip(&targets).enumerate() {
                    let c = t(c, shapes[i]).to_dtype(DType::F32).unwrap().to_device(device).unwrap();
                    loss = loss.add(p.value().sub(&c).unwrap().sqr().unwrap().mul((i + 1) as f64).unwrap().sum_all().unwrap()).unwrap();
                }
                loss.backward().unwrap();
                opt.step().unwrap();
                for i in 0..w.len() {
                    for j in 0..w[i].len() {
                        let mut g = 2.0 * (i + 1) as f64 * (w[i][j] - targets[i][j]);
                        if decoupled {
                            w[i][j] *= 1.0 - 0.1 * 0.05;
                        } else {
                            g += 0.05 * w[i][j];
                        }
                        m[i][j] = 0.9 * m[i][j] + 0.1 * g;
                        v[i][j] = 0.999 * v[i][j] + 0.001 * g * g;
                        let (mh, vh) = (m[i][j] / (1.0 - 0.9f64.powi(step)), v[i][j] / (1.0 - 0.999f64.powi(step)));
                        w[i][j] -= 0.1 * mh / (vh.sqrt() + 1e-8);
                    }
                    let got = params[i].value().to_f64_vec().unwrap();
                    close(&got, &w[i], 2e-5, &format!("{what}: step {step}, parameter {i}"));
                    assert_eq!(params[i].value().dims(), shapes[i], "{what}: parameter {i}'s shape");
                }
            }
            let state = opt.state();
            for i in [0, 2] {
                let got = state.iter().find(|(n, _)| *n == format!("{i}.exp_avg_sq")).unwrap().1.to_f64_vec().unwrap();
                close(&got, &v[i], 1e-4, &format!("{what}: second moment of parameter {i}"));
            }
        }
    }
}

#[test]
fn schedules_and_clipping() {
    let s = StepLr { step_size: 3, gamma: 0.5 };
    assert_eq!((s.lr(1.0, 0), s.lr(1.0, 3), s.lr(1.0, 7)), (1.0, 0.5, 0.25));
    let c = CosineLr { t_max: 10, min_lr: 0.1 };
    assert!((c.lr(1.0, 0) - 1.0).abs() < 1e-12 && (c.lr(1.0, 5) - 0.55).abs() < 1e-12 && (c.lr(1.0, 10) - 0.1).abs() < 1e-12);
    let w = WarmupLr { warmup: 4, after: c };
    assert_eq!(w.lr(1.0, 0), 0.25);
    assert!((w.lr(1.0, 4) - 1.0).abs() < 1e-12);
    let a = Parameter::new(t(&[3.0, 4.0], &[2])).unwrap();
    let b = Parameter::new(t(&[12.0], &[1])).unwrap();
    a.value().sum_all().unwrap().mul(0.0).unwrap().backward().unwrap();
    a.value().set_grad(Some(t(&[3.0, 4.0], &[2]))).unwrap();
    b.value().set_grad(Some(t(&[12.0], &[1]))).unwrap();
    let norm = clip_grad_norm(&[a.clone(), b.clone()], 1.3).unwrap().unwrap().item::<f32>().unwrap();
    assert!((norm - 13.0).abs() < 1e-5);
    let ga = a.grad().unwrap().to_vec::<f64>().unwrap();
    close(&ga, &[0.3, 0.4], 1e-6, "clipped gradient");
}

#[test]
fn checkpoints_round_trip_and_refuse_bad_files() {
    let dir = std::env::temp_dir().join(format!("voltaic-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    voltaic::manual_seed(9);
    let model = nn::Sequential::new().add(Linear::new(5, 4, true, Device::Cpu).unwrap()).add(BatchNorm::new(4, Device::Cpu).unwrap());
    model.forward(&Tensor::randn(&[6, 5], DType::F32, Device::Cpu).unwrap()).unwrap();
    let path = dir.join("m.safetensors");
    nn::save(&model, &path).unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary file is left behind: {leftovers:?}");
    voltaic::manual_seed(10);
    let other = nn::Sequential::new().add(Linear::new(5, 4, true, Device::Cpu).unwrap()).add(BatchNorm::new(4, Device::Cpu).unwrap());
    nn::load(&other, &path).unwrap();
    for ((n1, a), (n2, b)) in model.named_tensors().iter().zip(other.named_tensors()) {
        assert_eq!(n1, &n2);
        assert_eq!(a.value().to_f64_vec().unwrap(), b.value().to_f64_vec().unwrap(), "{n1}");
    }
    // num_batches_tracked is stored as I64, as PyTorch does.
    let f = voltaic::io::safetensors::SafetensorsFile::open(&path).unwrap();
    assert_eq!(f.info("1.num_batches_tracked").unwrap(), (vec![], "I64".to_string()));
    // A model of another shape: the error names the tensor and both shapes.
    let wrong = nn::Sequential::new().add(Linear::new(5, 3, true, Device::Cpu).unwrap());
    let e = nn::load(&wrong, &path).unwrap_err().to_string();
    assert!(e.contains("0.weight") && e.contains("[4, 5]") && e.contains("[3, 5]"), "{e}");
    let fewer = nn::Sequential::new().add(Linear::new(5, 4, true, Device::Cpu).unwrap());
    let e = nn::load(&fewer, &path).unwrap_err().to_string();
    assert!(e.contains("unexpected") && e.contains("\"1.weight\"") && e.contains("\"1.num_batches_tracked\""), "{e}");
    // Non-strict: the extra tensors are reported, the matching ones loaded.
    let keys = nn::load_state_dict(&fewer, &path, false).unwrap();
    assert!(keys.missing.is_empty());
    let mut unexpected = keys.unexpected.clone();
    unexpected.sort();
    assert_eq!(unexpected, ["1.bias", "1.num_batches_tracked", "1.running_mean", "1.running_var", "1.weight"]);
    assert_eq!(fewer.named_tensors()[0].1.value().to_f64_vec().unwrap(), model.named_tensors()[0].1.value().to_f64_vec().unwrap());
    // Truncated and garbage files are errors, not panics.
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 7, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(dir.join("cut.safetensors"), &bytes[..cut]).unwrap();
        assert!(nn::load(&other, dir.join("cut.safetensors")).is_err(), "cut at {cut}");
    }
    // Optimizer state round trip.
    let mut opt = Adam::new(model.parameters(), 0.01);
    model.forward(&Tensor::randn(&[6, 5], DType::F32, Device::Cpu).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    opt.step().unwrap();
    voltaic::io::safetensors::save(dir.join("opt.safetensors"), &opt.state()).unwrap();
    let loaded = voltaic::io::safetensors::SafetensorsFile::open(dir.join("opt.safetensors")).unwrap().tensors(Device::Cpu).unwrap();
    let mut opt2 = Adam::new(model.parameters(), 0.01);
    opt2.load_state(&loaded).unwrap();
    let (s1, s2) = (opt.state(), opt2.state());
    assert_eq!(s1.len(), s2.len());
    for ((n1, a), (n2, b)) in s1.iter().zip(&s2) {
        assert_eq!((n1, a.to_f64_vec().unwrap()), (n2, b.to_f64_vec().unwrap()));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn synthetic(n: usize) -> Dataset {
    Dataset { pixels: (0..n * 4).map(|i| (i * 37 % 256) as u8).collect(), labels: (0..n).map(|i| (i % 3) as i32).collect(), item_dims: vec![1, 2, 2] }
}

#[test]
fn the_data_loader_shuffles_by_seed_and_covers_every_item() {
    let a = epoch_order(100, true, 7, 1);
    assert_eq!(a, epoch_order(100, true, 7, 1), "same seed and epoch, same order");
    assert_ne!(a, epoch_order(100, true, 7, 2), "each epoch reshuffles");
    let mut s = a.clone();
    s.sort();
    assert_eq!(s, (0..100).collect::<Vec<_>>());
    let data = Arc::new(synthetic(10));
    let opts = LoaderOpts { batch_size: 4, shuffle: true, seed: 3, mean: 0.5, std: 0.25, drop_last: false, device: Device::Cpu };
    let order = epoch_order(10, true, 3, 0);
    let batches: Vec<_> = DataLoader::new(data.clone(), &opts, 0).unwrap().map(|b| b.unwrap()).collect();
    assert_eq!(batches.iter().map(|b| b.y.numel()).collect::<Vec<_>>(), vec![4, 4, 2]);
    let xs: Vec<f32> = batches.iter().flat_map(|b| b.x.to_vec::<f32>().unwrap()).collect();
    let ys: Vec<i32> = batches.iter().flat_map(|b| b.y.to_vec::<i32>().unwrap()).collect();
    for (k, &i) in order.iter().enumerate() {
        assert_eq!(ys[k], data.labels[i]);
        for j in 0..4 {
            let want = (data.pixels[i * 4 + j] as f32 / 255.0 - 0.5) / 0.25;
            assert!((xs[k * 4 + j] - want).abs() < 1e-5);
        }
    }
    assert_eq!(batches[0].x.dims(), &[4, 1, 2, 2]);
    let dropped = DataLoader::new(data, &LoaderOpts { drop_last: true, ..opts }, 0).unwrap();
    assert_eq!(dropped.len(), 2);
}

/// A short training run gives the same losses, step by step, on CPU and GPU.
#[test]
fn training_gives_the_same_losses_on_cpu_and_gpu() {
    assert!(!voltaic::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
    let gpu = Device::Gpu(std::env::var("VOLTAIC_TEST_GPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0));
    let data = Arc::new(Dataset {
        // Each image is its class times 25 plus a little texture: learnable.
        pixels: (0..96 * 64).map(|i| ((i / 64) % 10 * 25 + (i * 13) % 20) as u8).collect(),
        labels: (0..96).map(|i| i % 10).collect(),
        item_dims: vec![1, 8, 8],
    });
    let run = |device: Device| -> Vec<f32> {
        voltaic::manual_seed(17);
        let model = nn::Sequential::new()
            .add(nn::Conv2d::new(1, 4, [3, 3], voltaic::Conv2dOpts { padding: [1, 1], ..Default::default() }, true, device).unwrap())
            .add(nn::ReLU)
            .add(nn::MaxPool2d::new(2))
            .add(nn::Flatten)
            .add(Linear::new(64, 32, true, device).unwrap())
            .add(nn::ReLU)
            .add(Linear::new(32, 10, true, device).unwrap());
        let mut opt = Adam::new(model.parameters(), 3e-3);
        let opts = LoaderOpts { batch_size: 16, shuffle: true, seed: 1, mean: 0.5, std: 0.3, drop_last: false, device };
        let mut losses = vec![];
        for epoch in 0..2 {
            for b in DataLoader::new(data.clone(), &opts, epoch).unwrap() {
                let b = b.unwrap();
                let loss = model.forward(&b.x).unwrap().cross_entropy(&b.y, 0.0, Reduction::Mean).unwrap();
                opt.zero_grad();
                loss.backward().unwrap();
                opt.step().unwrap();
                losses.push(loss.item::<f32>().unwrap());
            }
        }
        losses
    };
    let (c, g) = (run(Device::Cpu), run(gpu));
    assert_eq!(c.len(), 12);
    for (i, (a, b)) in c.iter().zip(&g).enumerate() {
        assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "step {i}: cpu loss {a}, gpu loss {b}");
    }
    assert!(c[11] < c[0], "the loss goes down: {c:?}");
}
