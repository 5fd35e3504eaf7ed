//! The IDX format of MNIST and Fashion-MNIST, plain or gzipped.
//!
//! A header of two zero bytes, a type code, the number of dims, then each
//! dim as a big-endian u32, then the big-endian elements. Sizes are checked
//! before anything is allocated, so a malformed or hostile file is an error,
//! never a panic or a huge allocation.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::storage::CpuStorage;
use crate::tensor::Tensor;
use crate::Device;
use std::io::Read;
use std::path::Path;

/// Files larger than this (decompressed) are refused.
pub const MAX_BYTES: u64 = 1 << 32;

/// The contents of an IDX file.
#[derive(Clone, Debug, PartialEq)]
pub struct Idx {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// Elements in row-major order: u8 and i8 as `U8`/`I8`, wider types as f64 values.
    pub data: IdxData,
}

/// Element storage of an [`Idx`].
#[derive(Clone, Debug, PartialEq)]
pub enum IdxData {
    /// Type 0x08.
    U8(Vec<u8>),
    /// Type 0x09.
    I8(Vec<i8>),
    /// Types 0x0B (i16), 0x0C (i32), 0x0D (f32), 0x0E (f64), converted.
    Wide(Vec<f64>),
}

fn bad(what: &str, msg: impl std::fmt::Display) -> Error {
    Error::Format(format!("{what}: {msg}"))
}

/// Parse IDX from a reader (decompressed).
pub fn parse(mut r: impl Read, what: &str) -> Result<Idx> {
    let (code, size, dims) = header(&mut r, what)?;
    let total: u64 = dims.iter().map(|&d| d as u64).product();
    let want = (total * size) as usize;
    let mut bytes = Vec::new();
    r.by_ref().take(want as u64).read_to_end(&mut bytes).map_err(|e| bad(what, e))?;
    if bytes.len() != want {
        return Err(bad(what, format!("dimensions {dims:?} need {want} bytes of data, the file has {}", bytes.len())));
    }
    let mut extra = [0u8; 1];
    if r.read(&mut extra).map_err(|e| bad(what, e))? != 0 {
        return Err(bad(what, format!("trailing data after the {want} bytes that dimensions {dims:?} describe")));
    }
    let data = match code {
        0x08 => IdxData::U8(bytes),
        0x09 => IdxData::I8(bytes.into_iter().map(|b| b as i8).collect()),
        0x0B => IdxData::Wide(bytes.chunks_exact(2).map(|c| i16::from_be_bytes([c[0], c[1]]) as f64).collect()),
        0x0C => IdxData::Wide(bytes.chunks_exact(4).map(|c| i32::from_be_bytes([c[0], c[1], c[2], c[3]]) as f64).collect()),
        0x0D => IdxData::Wide(bytes.chunks_exact(4).map(|c| f32::from_be_bytes([c[0], c[1], c[2], c[3]]) as f64).collect()),
        _ => IdxData::Wide(bytes.chunks_exact(8).map(|c| f64::from_be_bytes(c.try_into().expect("8 bytes"))).collect()),
    };
    Ok(Idx { dims, data })
}

/// The dimensions of an IDX file (`.gz` or plain), from its header alone:
/// what a caller needs before the data is read (a gzipped file is only
/// decompressed as far as its header).
pub fn read_dims(path: impl AsRef<Path>) -> Result<Vec<usize>> {
    let path = path.as_ref();
    let what = path.display().to_string();
    let mut file = std::io::BufReader::new(std::fs::File::open(path).map_err(|e| Error::Io(format!("{what}: {e}")))?);
    let gz = std::io::BufRead::fill_buf(&mut file).map_err(|e| Error::Io(format!("{what}: {e}")))?.starts_with(&[0x1f, 0x8b]);
    let dims = if gz { header(&mut flate2::read::GzDecoder::new(file), &what)?.2 } else { header(&mut file, &what)?.2 };
    Ok(dims)
}

/// The header: the element type's code and size in bytes, and the
/// dimensions (their product checked against [`MAX_BYTES`]).
fn header(r: &mut impl Read, what: &str) -> Result<(u8, u64, Vec<usize>)> {
    let mut head = [0u8; 4];
    r.read_exact(&mut head).map_err(|_| bad(what, "file too short for the IDX header"))?;
    if head[0] != 0 || head[1] != 0 {
        return Err(bad(what, format!("not an IDX file (magic starts {:02x} {:02x}, expected 00 00)", head[0], head[1])));
    }
    let size = match head[2] {
        0x08 | 0x09 => 1u64,
        0x0B => 2,
        0x0C | 0x0D => 4,
        0x0E => 8,
        t => return Err(bad(what, format!("unknown IDX element type 0x{t:02x}"))),
    };
    let rank = head[3] as usize;
    if rank == 0 {
        return Err(bad(what, "IDX file with no dimensions"));
    }
    let mut dims = Vec::with_capacity(rank);
    let mut total: u64 = 1;
    for _ in 0..rank {
        let mut d = [0u8; 4];
        r.read_exact(&mut d).map_err(|_| bad(what, "file ends inside the dimension list"))?;
        let d = u32::from_be_bytes(d) as u64;
        total = total.checked_mul(d).filter(|&t| t.saturating_mul(size) <= MAX_BYTES).ok_or_else(|| {
            bad(what, format!("dimensions {:?}... exceed the {MAX_BYTES}-byte limit", dims))
        })?;
        dims.push(d as usize);
    }
    Ok((head[2], size, dims))
}

/// Parse IDX bytes, gunzipping them first when they start with the gzip magic.
pub fn parse_bytes(bytes: &[u8], what: &str) -> Result<Idx> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        parse(flate2::read::GzDecoder::new(bytes), what)
    } else {
        parse(bytes, what)
    }
}

/// Read an IDX file (`.gz` or plain).
pub fn read(path: impl AsRef<Path>) -> Result<Idx> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    parse_bytes(&bytes, &path.display().to_string())
}

impl Idx {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    /// No elements?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// As a tensor: u8 and i8 become i32 (labels, raw pixels), wider types f32.
    pub fn to_tensor(&self, device: Device) -> Result<Tensor> {
        let s = match &self.data {
            IdxData::U8(v) => CpuStorage::I32(v.iter().map(|&x| x as i32).collect()),
            IdxData::I8(v) => CpuStorage::I32(v.iter().map(|&x| x as i32).collect()),
            IdxData::Wide(v) => CpuStorage::from_f64(DType::F32, v),
        };
        Tensor::from_storage(s, &self.dims, device)
    }
}
