//! safetensors files: memory-mapped reading with every dtype of the format
//! mapped or refused by name, and atomic writing (temporary file, then rename).

use crate::error::{Error, Result};
use crate::storage::CpuStorage;
use crate::tensor::Tensor;
use crate::Device;
use half::{bf16, f16};
use safetensors::{Dtype as St, SafeTensors};
use super::Bytes;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn format_err(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Format(format!("{}: {msg}", path.display()))
}

/// An open safetensors file: the header is parsed and checked, the data is
/// memory-mapped (or held, when it came as bytes) and read only when a
/// tensor is asked for.
pub struct SafetensorsFile {
    path: PathBuf,
    data: Bytes,
}

impl SafetensorsFile {
    /// Open and validate `path` (header, offsets, sizes).
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref().to_path_buf();
        let data = Bytes::Mapped(super::map_file(&path, "safetensors")?);
        SafeTensors::deserialize(&data).map_err(|e| format_err(&path, e))?;
        Ok(SafetensorsFile { path, data })
    }

    /// Validate a file already in memory (`name` stands for its path in
    /// errors): where there is no filesystem, as in a browser.
    pub fn from_bytes(bytes: Vec<u8>, name: &str) -> Result<SafetensorsFile> {
        let path = PathBuf::from(name);
        SafeTensors::deserialize(&bytes).map_err(|e| format_err(&path, e))?;
        Ok(SafetensorsFile { path, data: Bytes::Owned(bytes) })
    }

    /// The path it was opened from (or the name it was given).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn parsed(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.data).map_err(|e| format_err(&self.path, e))
    }

    /// The header's string metadata (empty when it has none).
    pub fn metadata(&self) -> Result<HashMap<String, String>> {
        let (_, meta) = SafeTensors::read_metadata(&self.data).map_err(|e| format_err(&self.path, e))?;
        Ok(meta.metadata().clone().unwrap_or_default())
    }

    /// Tensor names in the order of their data in the file.
    pub fn names(&self) -> Result<Vec<String>> {
        let st = self.parsed()?;
        let mut v: Vec<(usize, String)> =
            st.tensors().into_iter().map(|(n, t)| (t.data().as_ptr() as usize, n)).collect();
        v.sort();
        Ok(v.into_iter().map(|(_, n)| n).collect())
    }

    /// Shape and file dtype of a tensor.
    pub fn info(&self, name: &str) -> Result<(Vec<usize>, String)> {
        let st = self.parsed()?;
        let t = st.tensor(name).map_err(|_| format_err(&self.path, format!("no tensor named {name:?}")))?;
        Ok((t.shape().to_vec(), format!("{:?}", t.dtype())))
    }

    /// Tensor `name` on `device`, converted to the Voltaic dtype that holds
    /// it exactly (see [`convert`]).
    pub fn tensor(&self, name: &str, device: Device) -> Result<Tensor> {
        let st = self.parsed()?;
        let t = st.tensor(name).map_err(|_| format_err(&self.path, format!("no tensor named {name:?}")))?;
        let storage = convert(t.dtype(), t.data()).map_err(|m| format_err(&self.path, format!("tensor {name:?}: {m}")))?;
        Tensor::from_storage(storage, t.shape(), device)
    }

    /// Every tensor, in file order.
    pub fn tensors(&self, device: Device) -> Result<Vec<(String, Tensor)>> {
        self.names()?.into_iter().map(|n| Ok((n.clone(), self.tensor(&n, device)?))).collect()
    }
}

/// Every tensor of a safetensors file held in memory (`what` names it in
/// errors), in file order: where there is no filesystem to map, as in a
/// browser.
pub fn read_bytes(bytes: &[u8], what: &str, device: Device) -> Result<Vec<(String, Tensor)>> {
    SafetensorsFile::from_bytes(bytes.to_vec(), what)?.tensors(device)
}

/// Little-endian elements of a file as a host buffer. Floats and 32-bit
/// integers map directly; smaller integers widen to i32; i64/u64 narrow to
/// i32/u32 when every value fits (Voltaic has no 64-bit integers); the
/// 8-bit, 6-bit and 4-bit float formats and complex numbers are refused.
pub fn convert(dt: St, b: &[u8]) -> std::result::Result<CpuStorage, String> {
    fn le<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N).map(|c| f(c.try_into().expect("chunks_exact gives N bytes"))).collect()
    }
    Ok(match dt {
        St::F32 => CpuStorage::F32(le(b, f32::from_le_bytes)),
        St::F64 => CpuStorage::F64(le(b, f64::from_le_bytes)),
        St::F16 => CpuStorage::F16(le(b, |c| f16::from_bits(u16::from_le_bytes(c)))),
        St::BF16 => CpuStorage::BF16(le(b, |c| bf16::from_bits(u16::from_le_bytes(c)))),
        St::I32 => CpuStorage::I32(le(b, i32::from_le_bytes)),
        St::U32 => CpuStorage::U32(le(b, u32::from_le_bytes)),
        St::BOOL => CpuStorage::Bool(b.iter().map(|&v| v != 0).collect()),
        St::U8 => CpuStorage::I32(b.iter().map(|&v| v as i32).collect()),
        St::I8 => CpuStorage::I32(b.iter().map(|&v| v as i8 as i32).collect()),
        St::I16 => CpuStorage::I32(le(b, |c| i16::from_le_bytes(c) as i32)),
        St::U16 => CpuStorage::I32(le(b, |c| u16::from_le_bytes(c) as i32)),
        St::I64 => {
            let v: Vec<i64> = le(b, i64::from_le_bytes);
            if let Some(x) = v.iter().find(|&&x| x < i32::MIN as i64 || x > i32::MAX as i64) {
                return Err(format!("I64 value {x} does not fit the i32 that Voltaic holds integers in"));
            }
            CpuStorage::I32(v.into_iter().map(|x| x as i32).collect())
        }
        St::U64 => {
            let v: Vec<u64> = le(b, u64::from_le_bytes);
            if let Some(x) = v.iter().find(|&&x| x > u32::MAX as u64) {
                return Err(format!("U64 value {x} does not fit the u32 that Voltaic holds it in"));
            }
            CpuStorage::U32(v.into_iter().map(|x| x as u32).collect())
        }
        other => return Err(format!("dtype {other:?} is not supported (no Voltaic dtype holds it)")),
    })
}

/// The file dtype and little-endian bytes of a tensor's values. Integer
/// tensors named in `as_i64` are written as I64 (PyTorch's `num_batches_tracked`).
fn encode(t: &Tensor, as_i64: bool) -> Result<(St, Vec<u8>)> {
    let host = t.read_host(|s, l| crate::storage::map_storage!(s, v => crate::storage::StorageElem::wrap(l.gather(v))))?;
    Ok(match host {
        CpuStorage::I32(v) if as_i64 => (St::I64, v.iter().flat_map(|&x| (x as i64).to_le_bytes()).collect()),
        CpuStorage::F32(v) => (St::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        CpuStorage::F64(v) => (St::F64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        CpuStorage::F16(v) => (St::F16, v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()),
        CpuStorage::BF16(v) => (St::BF16, v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()),
        CpuStorage::I32(v) => (St::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        CpuStorage::U32(v) => (St::U32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        CpuStorage::Bool(v) => (St::BOOL, v.iter().map(|&x| x as u8).collect()),
    })
}

/// Write tensors to `path` as safetensors, through a temporary file in the
/// same directory that is renamed into place: a crash never leaves a
/// half-written file. Names ending in `num_batches_tracked` are written as
/// I64, as PyTorch stores them.
pub fn save(path: impl AsRef<Path>, tensors: &[(String, Tensor)]) -> Result<()> {
    save_with_metadata(path, tensors, &HashMap::new())
}

/// [`save`], with string metadata in the header (read back with
/// [`SafetensorsFile::metadata`]): a checkpoint's epoch, step and settings
/// commit in the same atomic write as its tensors.
pub fn save_with_metadata(path: impl AsRef<Path>, tensors: &[(String, Tensor)], metadata: &HashMap<String, String>) -> Result<()> {
    let path = path.as_ref();
    let mut encoded = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (dt, bytes) = encode(t, name.ends_with("num_batches_tracked"))?;
        encoded.push((name.clone(), dt, t.dims().to_vec(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = encoded
        .iter()
        .map(|(n, dt, shape, b)| {
            let v = safetensors::tensor::TensorView::new(*dt, shape.clone(), b).map_err(|e| format_err(path, e))?;
            Ok((n.clone(), v))
        })
        .collect::<Result<_>>()?;
    let meta = if metadata.is_empty() { None } else { Some(metadata.clone()) };
    let bytes = safetensors::serialize(views, meta).map_err(|e| format_err(path, e))?;
    super::write_atomic(path, &bytes).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}
