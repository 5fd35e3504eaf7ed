//! `#[derive(Module)]`: the names it gives (PyTorch `state_dict` order and
//! spelling), what it visits (nested modules, `Vec`, `Option`, `Box`, tuple
//! structs, renames, skips), training mode reaching nested layers, and
//! strict and non-strict loading of what it saves.

use voltaic::nn::{self, Dropout, Forward, Linear, Module, Parameter};
use voltaic::{DType, Device, Result, Tensor};

#[derive(Module)]
struct Block {
    fc: Linear,
    drop: Dropout,
}

#[derive(Module)]
struct Pair(Linear, Option<Linear>);

#[derive(Module)]
struct Net {
    embed: Parameter,
    blocks: Vec<Block>,
    head: Option<Linear>,
    missing_head: Option<Linear>,
    pair: Pair,
    boxed: Box<dyn Forward>,
    #[module(rename = "encoder.scale")]
    scale: Parameter,
    #[module(skip)]
    scratch: Tensor,
    width: usize,
    name: String,
}

#[derive(Module)]
struct Generic<M> {
    inner: M,
    extra: [Parameter; 2],
}

fn lin(i: usize, o: usize, bias: bool) -> Linear {
    Linear::new(i, o, bias, Device::Cpu).unwrap()
}

fn net() -> Net {
    let dev = Device::Cpu;
    Net {
        embed: Parameter::new(Tensor::randn(&[5, 3], DType::F32, dev).unwrap()).unwrap(),
        blocks: vec![Block { fc: lin(3, 3, true), drop: Dropout::new(0.5).unwrap() }, Block { fc: lin(3, 3, false), drop: Dropout::new(0.5).unwrap() }],
        head: Some(lin(3, 2, true)),
        missing_head: None,
        pair: Pair(lin(2, 2, false), Some(lin(2, 1, true))),
        boxed: Box::new(nn::Sequential::new().add(lin(1, 1, true)).add(nn::ReLU)),
        scale: Parameter::buffer(Tensor::ones(&[1], DType::F32, dev).unwrap()),
        scratch: Tensor::zeros(&[7], DType::F32, dev).unwrap(),
        width: 3,
        name: "net".into(),
    }
}

impl Forward for Net {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.matmul(&self.embed.value())?;
        for b in &self.blocks {
            x = b.drop.forward(&b.fc.forward(&x)?)?;
        }
        let x = self.head.as_ref().unwrap().forward(&x)?;
        self.boxed.forward(&self.pair.1.as_ref().unwrap().forward(&self.pair.0.forward(&x)?)?)
    }
}

#[test]
fn derived_names_follow_the_fields() {
    voltaic::manual_seed(1);
    let n = net();
    let names: Vec<(String, Vec<usize>, bool)> = n.named_tensors().into_iter().map(|(k, p)| (k, p.value().dims().to_vec(), p.is_trainable())).collect();
    let want: Vec<(&str, Vec<usize>, bool)> = vec![
        ("embed", vec![5, 3], true),
        ("blocks.0.fc.weight", vec![3, 3], true),
        ("blocks.0.fc.bias", vec![3], true),
        ("blocks.1.fc.weight", vec![3, 3], true),
        ("head.weight", vec![2, 3], true),
        ("head.bias", vec![2], true),
        ("pair.0.weight", vec![2, 2], true),
        ("pair.1.weight", vec![1, 2], true),
        ("pair.1.bias", vec![1], true),
        ("boxed.0.weight", vec![1, 1], true),
        ("boxed.0.bias", vec![1], true),
        ("encoder.scale", vec![1], false),
    ];
    let want: Vec<(String, Vec<usize>, bool)> = want.into_iter().map(|(a, b, c)| (a.to_string(), b, c)).collect();
    assert_eq!(names, want);
    // Parameters are the trainable ones, in the same order; the skipped field is not there.
    assert_eq!(n.parameters().len(), 11);
    assert_eq!(n.scratch.dims(), &[7]);
    assert_eq!((n.width, n.name.as_str()), (3, "net"));

    let g = Generic { inner: lin(2, 2, true), extra: [n.embed.clone(), n.scale.clone()] };
    let names: Vec<String> = g.named_tensors().into_iter().map(|(k, _)| k).collect();
    assert_eq!(names, ["inner.weight", "inner.bias", "extra.0", "extra.1"]);
}

#[test]
fn training_mode_reaches_nested_layers() {
    voltaic::manual_seed(2);
    let n = net();
    let x = Tensor::randn(&[64, 5], DType::F32, Device::Cpu).unwrap();
    let block = &n.blocks[0];
    let h = x.matmul(&n.embed.value()).unwrap();
    let y = block.fc.forward(&h).unwrap();
    n.eval();
    assert_eq!(block.drop.forward(&y).unwrap().to_f64_vec().unwrap(), y.to_f64_vec().unwrap(), "eval: dropout is the identity");
    n.train();
    let dropped = block.drop.forward(&y).unwrap().to_f64_vec().unwrap();
    let zeros = dropped.iter().filter(|v| **v == 0.0).count();
    assert!(zeros > dropped.len() / 5, "train: dropout zeroes about half, got {zeros} of {}", dropped.len());
    // The whole model runs in both modes.
    n.eval();
    assert_eq!(n.forward(&x).unwrap().dims(), &[64, 1]);
}

#[test]
fn save_then_strict_and_lenient_load() {
    voltaic::manual_seed(3);
    let dir = std::env::temp_dir().join(format!("voltaic-module-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("net.safetensors");
    let a = net();
    nn::save(&a, &path).unwrap();
    let b = net();
    nn::load(&b, &path).unwrap();
    for ((na, pa), (nb, pb)) in a.named_tensors().into_iter().zip(b.named_tensors()) {
        assert_eq!(na, nb);
        assert_eq!(pa.value().to_f64_vec().unwrap(), pb.value().to_f64_vec().unwrap(), "{na}");
    }
    // A model with a second head and without the first: strict load lists
    // every missing and unexpected name at once, and changes nothing.
    let mut c = net();
    c.head = None;
    c.missing_head = Some(lin(3, 2, true));
    let before = c.named_tensors()[0].1.value().to_f64_vec().unwrap();
    let e = nn::load(&c, &path).unwrap_err().to_string();
    for name in ["missing_head.weight", "missing_head.bias", "head.weight", "head.bias", "missing:", "unexpected:"] {
        assert!(e.contains(name), "{name} not in {e}");
    }
    assert_eq!(c.named_tensors()[0].1.value().to_f64_vec().unwrap(), before, "a failed load changes nothing");
    let keys = nn::load_state_dict(&c, &path, false).unwrap();
    assert_eq!(keys.missing, ["missing_head.weight", "missing_head.bias"]);
    assert_eq!(keys.unexpected, ["head.bias", "head.weight"], "in the file's (sorted) order");
    assert_eq!(c.named_tensors()[0].1.value().to_f64_vec().unwrap(), a.named_tensors()[0].1.value().to_f64_vec().unwrap());
    // A shape mismatch is an error even when not strict.
    let mut d = net();
    d.blocks[1].fc = lin(3, 3, true);
    d.head = Some(lin(3, 2, true));
    d.embed = Parameter::new(Tensor::zeros(&[4, 3], DType::F32, Device::Cpu).unwrap()).unwrap();
    let e = nn::load_state_dict(&d, &path, false).unwrap_err().to_string();
    assert!(e.contains("\"embed\" is [5, 3] in the file, [4, 3] in the model"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
