//! The file readers against malformed input: random bytes, truncations and
//! mutations of valid files give `Ok` or `Err`, never a panic; valid files
//! round-trip.

use proptest::prelude::*;
use voltaic::io::{idx, safetensors};
use voltaic::{DType, Device, Tensor};

fn idx_bytes(ty: u8, dims: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut b = vec![0, 0, ty, dims.len() as u8];
    for d in dims {
        b.extend(d.to_be_bytes());
    }
    b.extend_from_slice(payload);
    b
}

fn gzip(b: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

#[test]
fn idx_reads_every_type_plain_and_gzipped() {
    let u8s = idx_bytes(0x08, &[2, 3], &[1, 2, 3, 4, 5, 255]);
    for bytes in [u8s.clone(), gzip(&u8s)] {
        let f = idx::parse_bytes(&bytes, "test").unwrap();
        assert_eq!(f.dims, vec![2, 3]);
        assert_eq!(f.data, idx::IdxData::U8(vec![1, 2, 3, 4, 5, 255]));
        assert_eq!(f.to_tensor(Device::Cpu).unwrap().to_vec::<i32>().unwrap(), vec![1, 2, 3, 4, 5, 255]);
    }
    let f32s: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_be_bytes()).collect();
    let f = idx::parse_bytes(&idx_bytes(0x0D, &[2], &f32s), "test").unwrap();
    assert_eq!(f.data, idx::IdxData::Wide(vec![1.5, -2.0]));
    let i16s: Vec<u8> = [-3i16, 7].iter().flat_map(|v| v.to_be_bytes()).collect();
    assert_eq!(idx::parse_bytes(&idx_bytes(0x0B, &[2], &i16s), "t").unwrap().data, idx::IdxData::Wide(vec![-3.0, 7.0]));
}

#[test]
fn idx_refuses_malformed_files_with_clear_errors() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "too short"),
        (vec![1, 0, 8, 1], "not an IDX file"),
        (vec![0, 0, 0x42, 1, 0, 0, 0, 1, 0], "unknown IDX element type"),
        (idx_bytes(0x08, &[4], &[1, 2]), "need 4 bytes"),
        (idx_bytes(0x08, &[2], &[1, 2, 3]), "trailing data"),
        (idx_bytes(0x08, &[65536, 65536, 65536], &[]), "limit"),
        (vec![0, 0, 8, 3, 0, 0], "dimension list"),
    ];
    for (bytes, want) in cases {
        let e = idx::parse_bytes(&bytes, "f.idx").unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("f.idx"), "{e:?} should mention {want:?}");
    }
}

/// `read_dims` gives the dims of a file's header, plain or gzipped,
/// without its data (a file cut after its header still has them), and
/// refuses a file whose header is cut or malformed.
#[test]
fn idx_dims_come_from_the_header_alone() {
    let dir = std::env::temp_dir().join(format!("voltaic-idx-dims-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let full = idx_bytes(0x08, &[3, 2, 4], &[7; 24]);
    // (file name, bytes, the dims expected or None for an error)
    let cases = [
        ("plain", full.clone(), Some(vec![3usize, 2, 4])),
        ("gz", gzip(&full), Some(vec![3, 2, 4])),
        ("no-data", full[..16].to_vec(), Some(vec![3, 2, 4])),
        ("cut-header", full[..9].to_vec(), None),
        ("bad-type", idx_bytes(0x42, &[3], &[0; 3]), None),
    ];
    for (name, bytes, want) in cases {
        let path = dir.join(name);
        std::fs::write(&path, &bytes).unwrap();
        match (idx::read_dims(&path), want) {
            (Ok(d), Some(w)) => assert_eq!(d, w, "{name}"),
            (Err(e), None) => assert!(e.to_string().contains(name), "{name}: the error names the file: {e}"),
            (got, want) => panic!("{name}: got {got:?}, expected {want:?}"),
        }
    }
    assert!(idx::read_dims(dir.join("missing")).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

fn valid_safetensors() -> Vec<u8> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("voltaic-readers-{}-{k}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("v.safetensors");
    let tensors = vec![
        ("a".to_string(), Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu).unwrap()),
        ("b".to_string(), Tensor::from_vec(vec![7i32, -1], &[2], Device::Cpu).unwrap()),
        ("c".to_string(), Tensor::from_vec(vec![true, false, true], &[3], Device::Cpu).unwrap()),
    ];
    safetensors::save(&path, &tensors).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    bytes
}

fn open_bytes(bytes: &[u8], tag: u64) -> voltaic::Result<Vec<(String, Tensor)>> {
    let path = std::env::temp_dir().join(format!("voltaic-fuzz-{}-{tag}.safetensors", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let r = safetensors::SafetensorsFile::open(&path).and_then(|f| f.tensors(Device::Cpu));
    std::fs::remove_file(&path).unwrap();
    r
}

#[test]
fn safetensors_round_trips_and_maps_dtypes() {
    let t = open_bytes(&valid_safetensors(), 0).unwrap();
    assert_eq!(t.len(), 3);
    let get = |n: &str| t.iter().find(|(k, _)| k == n).unwrap().1.clone();
    assert_eq!(get("a").to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(get("b").to_vec::<i32>().unwrap(), vec![7, -1]);
    assert_eq!(get("c").dtype(), DType::Bool);
    // Narrow integer and unsupported float formats.
    use ::safetensors::Dtype;
    assert!(matches!(safetensors::convert(Dtype::I64, &5i64.to_le_bytes()).unwrap(), voltaic::CpuStorage::I32(v) if v == vec![5]));
    let e = safetensors::convert(Dtype::I64, &(1i64 << 40).to_le_bytes()).unwrap_err();
    assert!(e.contains("does not fit"), "{e}");
    assert!(safetensors::convert(Dtype::F8_E4M3, &[0u8]).unwrap_err().contains("not supported"));
    assert!(matches!(safetensors::convert(Dtype::U8, &[200]).unwrap(), voltaic::CpuStorage::I32(v) if v == vec![200]));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    #[test]
    fn idx_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = idx::parse_bytes(&bytes, "fuzz");
        let mut gz = vec![0x1f, 0x8b];
        gz.extend(&bytes);
        let _ = idx::parse_bytes(&gz, "fuzz");
    }

    #[test]
    fn idx_never_panics_on_mutated_files(pos in 0usize..40, val in any::<u8>(), cut in 0usize..40) {
        let mut b = idx_bytes(0x0C, &[2, 3], &[7u8; 24]);
        let p = pos % b.len();
        b[p] = val;
        b.truncate(cut.max(1).min(b.len()));
        let _ = idx::parse_bytes(&b, "fuzz");
        let _ = idx::parse_bytes(&gzip(&b), "fuzz");
        let path = std::env::temp_dir().join(format!("voltaic-idx-fuzz-{}", std::process::id()));
        std::fs::write(&path, &b).unwrap();
        let _ = idx::read_dims(&path);
    }

    #[test]
    fn safetensors_never_panics_on_mutated_files(edits in proptest::collection::vec((any::<u16>(), any::<u8>()), 1..6), cut in any::<u16>(), tag in any::<u64>()) {
        let mut b = valid_safetensors();
        for (pos, val) in edits {
            let p = pos as usize % b.len();
            b[p] = val;
        }
        if (cut as usize).is_multiple_of(3) {
            b.truncate(cut as usize % b.len());
        }
        let _ = open_bytes(&b, tag);
    }

    #[test]
    fn safetensors_never_panics_on_random_headers(header in "[ -~]{0,80}", len_delta in -8i64..8, tag in any::<u64>()) {
        let mut b = ((header.len() as i64 + len_delta).max(0) as u64).to_le_bytes().to_vec();
        b.extend(header.as_bytes());
        b.extend([0u8; 16]);
        let _ = open_bytes(&b, tag);
    }
}
