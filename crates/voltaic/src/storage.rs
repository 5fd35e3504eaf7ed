//! Host-side storage of one buffer, one variant per dtype.

use crate::dtype::{DType, WithDType};
use half::{bf16, f16};

/// A buffer in host memory.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// bool elements.
    Bool(Vec<bool>),
    /// u32 elements.
    U32(Vec<u32>),
    /// i32 elements.
    I32(Vec<i32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
}

/// Apply an expression to the Vec inside a [`CpuStorage`], whatever its type.
macro_rules! map_storage {
    ($s:expr, $v:ident => $e:expr) => {
        match $s {
            $crate::storage::CpuStorage::Bool($v) => $e,
            $crate::storage::CpuStorage::U32($v) => $e,
            $crate::storage::CpuStorage::I32($v) => $e,
            $crate::storage::CpuStorage::F16($v) => $e,
            $crate::storage::CpuStorage::BF16($v) => $e,
            $crate::storage::CpuStorage::F32($v) => $e,
            $crate::storage::CpuStorage::F64($v) => $e,
        }
    };
}
pub(crate) use map_storage;

/// Rust element types that can live in a [`CpuStorage`].
pub trait StorageElem: WithDType {
    /// Wrap a Vec.
    fn wrap(v: Vec<Self>) -> CpuStorage;
    /// Borrow the Vec if the storage holds this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// Take the Vec out if the storage holds this type.
    fn unwrap(s: CpuStorage) -> Option<Vec<Self>>;
}
macro_rules! elem {
    ($t:ty, $v:ident) => {
        impl StorageElem for $t {
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$v(v)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn unwrap(s: CpuStorage) -> Option<Vec<Self>> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
elem!(bool, Bool);
elem!(u32, U32);
elem!(i32, I32);
elem!(f16, F16);
elem!(bf16, BF16);
elem!(f32, F32);
elem!(f64, F64);

impl CpuStorage {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::Bool(_) => DType::Bool,
            CpuStorage::U32(_) => DType::U32,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        map_storage!(self, v => v.len())
    }
    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.len() * self.dtype().size_in_bytes()
    }
    /// Element `i` as f64.
    pub fn get_f64(&self, i: usize) -> f64 {
        map_storage!(self, v => v[i].to_f64())
    }
    /// A buffer of `n` zeros.
    pub fn zeros(dtype: DType, n: usize) -> CpuStorage {
        match dtype {
            DType::Bool => CpuStorage::Bool(vec![false; n]),
            DType::U32 => CpuStorage::U32(vec![0; n]),
            DType::I32 => CpuStorage::I32(vec![0; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
        }
    }
    /// A buffer from f64 values, converted with `as` semantics.
    pub fn from_f64(dtype: DType, v: &[f64]) -> CpuStorage {
        fn conv<T: StorageElem>(v: &[f64]) -> CpuStorage {
            T::wrap(v.iter().map(|&x| T::from_f64(x)).collect())
        }
        match dtype {
            DType::Bool => conv::<bool>(v),
            DType::U32 => conv::<u32>(v),
            DType::I32 => conv::<i32>(v),
            DType::F16 => conv::<f16>(v),
            DType::BF16 => conv::<bf16>(v),
            DType::F32 => conv::<f32>(v),
            DType::F64 => conv::<f64>(v),
        }
    }
}

/// Fail with `OutOfMemory` instead of aborting when a large host buffer
/// cannot be allocated (Rust aborts the process on a failed infallible
/// allocation).
pub(crate) fn check_alloc(bytes: usize) -> crate::error::Result<()> {
    if bytes >= 1 << 28 {
        let mut probe: Vec<u8> = Vec::new();
        if probe.try_reserve_exact(bytes).is_err() {
            return Err(crate::Error::OutOfMemory(format!("cannot allocate {bytes} bytes of host memory")));
        }
    }
    Ok(())
}
