//! GGUF files (llama.cpp's model format, versions 2 and 3): the metadata
//! and the tensor directory, memory-mapped and checked.
//!
//! Layout: the magic `GGUF`, a version, the tensor and metadata counts, the
//! metadata as typed key/value pairs, one directory entry per tensor (name,
//! dims with the fastest-varying first, ggml type, offset), then the tensor
//! data from the next multiple of `general.alignment` (32 by default). Every
//! count, length and offset is checked against the bytes that are really
//! there before anything is allocated or read: a truncated or hostile file is
//! an `Err` naming the file and the field, never a panic or a huge allocation.

use crate::error::{Error, Result};
use super::Bytes;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use crate::quant::GgmlType;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // one variant per GGUF value type
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                GgufValue::I8(v) => Some(v as f64),
                GgufValue::I16(v) => Some(v as f64),
                GgufValue::I32(v) => Some(v as f64),
                GgufValue::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dims as GGUF stores them: the fastest-varying first (ggml's `ne`).
    pub ggml_dims: Vec<usize>,
    /// Element type.
    pub dtype: GgmlType,
    /// Offset of its data from the start of the data section.
    pub offset: usize,
    /// Bytes of data.
    pub bytes: usize,
}

impl GgufTensorInfo {
    /// Dims in Voltaic's (PyTorch's) order: the slowest-varying first.
    pub fn dims(&self) -> Vec<usize> {
        self.ggml_dims.iter().rev().copied().collect()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.ggml_dims.iter().product()
    }
}

/// An open GGUF file: metadata and directory parsed and checked, tensor
/// data memory-mapped and read only when asked for.
pub struct GgufFile {
    path: PathBuf,
    data: Bytes,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// The tensor directory, in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Where the data section starts in the file.
    pub data_offset: usize,
}

/// Most dims a ggml tensor has.
const MAX_DIMS: u32 = 4;
/// Deepest nesting of metadata arrays accepted (GGUF files use one level).
const MAX_ARRAY_DEPTH: usize = 2;

impl GgufFile {
    /// Open and check `path` (memory-mapped: a 100 MB model opens in
    /// microseconds; tensor data is read when asked for).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let mmap = super::map_file(&path, "GGUF")?;
        GgufFile::parse(path, Bytes::Mapped(mmap))
    }

    /// Parse a GGUF file held in memory; `name` is used in errors.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(name.into(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, data: Bytes) -> Result<GgufFile> {
        let mut r = Reader { buf: &data, pos: 0, path: &path };
        let magic = r.bytes(4, "magic")?.to_vec();
        if magic != b"GGUF" {
            return Err(r.err("magic", format!("expected \"GGUF\", found {magic:?}")));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(r.err("version", format!("version {version} is not supported (2 and 3 are)")));
        }
        let n_tensors = r.u64("tensor_count")?;
        let n_kv = r.u64("metadata_kv_count")?;
        // Each key/value takes at least 12 bytes and each tensor entry 24: a
        // count the file cannot hold is refused before anything is allocated.
        r.check_count(n_kv, 12, "metadata_kv_count")?;
        r.check_count(n_tensors, 24, "tensor_count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv as usize {
            let key = r.string(&format!("metadata key {i}"))?;
            let ty = r.u32(&format!("type of {key:?}"))?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors as usize {
            let name = r.string(&format!("tensor {i} name"))?;
            let n_dims = r.u32(&format!("{name:?} n_dims"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.err(&format!("{name:?} n_dims"), format!("{n_dims} dims, expected 1 to {MAX_DIMS}")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                let v = r.u64(&format!("{name:?} dim {d}"))?;
                dims.push(usize::try_from(v).map_err(|_| r.err(&format!("{name:?} dim {d}"), format!("{v} is too large")))?);
            }
            let type_id = r.u32(&format!("{name:?} type"))?;
            let dtype = GgmlType::from_id(type_id)
                .ok_or_else(|| r.err(&format!("{name:?} type"), format!("ggml type {type_id} is not supported")))?;
            let offset = r.u64(&format!("{name:?} offset"))?;
            let numel = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let (per_block, block_bytes) = dtype.block();
            let bytes = numel.filter(|n| n.is_multiple_of(per_block)).and_then(|n| (n / per_block).checked_mul(block_bytes));
            let Some(bytes) = bytes else {
                return Err(r.err(
                    &format!("{name:?} dims"),
                    format!("{dims:?} of {} is not a whole number of {per_block}-element blocks (or overflows)", dtype.name()),
                ));
            };
            let offset = usize::try_from(offset).map_err(|_| r.err(&format!("{name:?} offset"), format!("{offset} is too large")))?;
            tensors.push(GgufTensorInfo { name, ggml_dims: dims, dtype, offset, bytes });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a as usize,
                _ => return Err(r.err("general.alignment", format!("{v:?} is not a power of two up to 65536"))),
            },
        };
        let data_offset = r.pos.next_multiple_of(alignment);
        let data_len = data.len().saturating_sub(data_offset);
        let mut names = std::collections::HashSet::with_capacity(tensors.len());
        for t in &tensors {
            if !names.insert(t.name.as_str()) {
                return Err(r.err(&format!("{:?}", t.name), "the name appears twice in the tensor directory"));
            }
            if !t.offset.is_multiple_of(alignment) {
                return Err(r.err(&format!("{:?} offset", t.name), format!("{} is not a multiple of the alignment {alignment}", t.offset)));
            }
            if t.offset.checked_add(t.bytes).is_none_or(|end| end > data_len) {
                return Err(r.err(
                    &format!("{:?} offset", t.name),
                    format!("{} bytes at offset {} run past the {data_len} bytes of data (the file is truncated?)", t.bytes, t.offset),
                ));
            }
        }
        Ok(GgufFile { path, data, version, metadata, tensors, data_offset })
    }

    /// The file's path (or the name given to [`GgufFile::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory entry of the tensor called `name`.
    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::Format(format!("{}: no tensor named {name:?}", self.path.display())))
    }

    /// The raw (possibly block-quantized) bytes of the tensor called `name`.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor_info(name)?;
        let start = self.data_offset + t.offset;
        // Checked when the file was opened.
        Ok(&self.data[start..start + t.bytes])
    }

    /// The tensor called `name` dequantized to f32, in Voltaic's dim order
    /// (the slowest-varying first), on `device`.
    pub fn tensor(&self, name: &str, device: crate::Device) -> Result<crate::Tensor> {
        let t = self.tensor_info(name)?;
        let mut out = vec![0f32; t.numel()];
        crate::quant::dequantize(t.dtype, self.tensor_bytes(name)?, &mut out)
            .map_err(|e| Error::Format(format!("{}: tensor {name:?}: {e}", self.path.display())))?;
        crate::Tensor::from_vec(out, &t.dims(), device)
    }

    /// The 2-D block-quantized tensor called `name`, kept quantized, on
    /// `device` (see [`crate::QTensor`]).
    pub fn qtensor(&self, name: &str, device: crate::Device) -> Result<crate::QTensor> {
        let t = self.tensor_info(name)?;
        crate::QTensor::from_blocks(self.tensor_bytes(name)?, t.dtype, &t.dims(), device)
            .map_err(|e| Error::Format(format!("{}: tensor {name:?}: {e}", self.path.display())))
    }

    /// A metadata value that must be there.
    pub fn get(&self, key: &str) -> Result<&GgufValue> {
        self.metadata.get(key).ok_or_else(|| Error::Format(format!("{}: metadata key {key:?} is missing", self.path.display())))
    }

    /// A metadata value that must be a non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.get(key)?;
        v.as_u64().ok_or_else(|| Error::Format(format!("{}: {key} is {v:?}, expected a non-negative integer", self.path.display())))
    }

    /// A metadata value that must be a number.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.get(key)?;
        v.as_f64().ok_or_else(|| Error::Format(format!("{}: {key} is {v:?}, expected a number", self.path.display())))
    }

    /// A metadata value that must be a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.get(key)?;
        v.as_str().ok_or_else(|| Error::Format(format!("{}: {key} is {v:?}, expected a string", self.path.display())))
    }
}

/// A cursor over the file's bytes that never reads past the end.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn err(&self, field: &str, msg: impl std::fmt::Display) -> Error {
        Error::Format(format!("{}: {field} (at byte {}): {msg}", self.path.display(), self.pos))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn bytes(&mut self, n: usize, field: &str) -> Result<&[u8]> {
        if n > self.remaining() {
            return Err(self.err(field, format!("needs {n} bytes but the file ends after {} (it is truncated)", self.remaining())));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        Ok(self.bytes(N, field)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// Refuse a count of items of at least `min_bytes` each that the rest of the file cannot hold.
    fn check_count(&self, count: u64, min_bytes: u64, field: &str) -> Result<()> {
        if count.saturating_mul(min_bytes) > self.remaining() as u64 {
            return Err(self.err(field, format!("{count} entries cannot fit in the {} bytes left", self.remaining())));
        }
        Ok(())
    }

    fn string(&mut self, field: &str) -> Result<String> {
        let n = self.u64(field)?;
        if n > self.remaining() as u64 {
            return Err(self.err(field, format!("a string of {n} bytes, but only {} are left", self.remaining())));
        }
        let b = self.bytes(n as usize, field)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(field, "the string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(key)?[0]),
            1 => GgufValue::I8(self.array::<1>(key)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.err(key, format!("a bool must be 0 or 1, found {b}"))),
            },
            8 => GgufValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(key, format!("arrays nested deeper than {MAX_ARRAY_DEPTH}")));
                }
                let elem = self.u32(key)?;
                let n = self.u64(key)?;
                // The smallest element is one byte (strings take at least 8).
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(self.err(key, format!("array of unknown value type {t}"))),
                };
                self.check_count(n, min, key)?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(self.err(key, format!("unknown value type {t}"))),
        })
    }
}
