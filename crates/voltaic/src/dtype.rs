//! Element types, promotion rules and host-side element conversion.

use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Booleans, one byte each.
    Bool,
    /// Unsigned 32-bit integers.
    U32,
    /// Signed 32-bit integers (also the dtype of indices, where PyTorch uses int64).
    I32,
    /// IEEE half precision (storage; arithmetic happens in f32).
    F16,
    /// bfloat16 (storage; arithmetic happens in f32).
    BF16,
    /// IEEE single precision, the default.
    F32,
    /// IEEE double precision (CPU).
    F64,
}

impl DType {
    /// Every dtype, for tests and tools.
    pub const ALL: [DType; 7] =
        [DType::Bool, DType::U32, DType::I32, DType::F16, DType::BF16, DType::F32, DType::F64];

    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool => 1,
            DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// Floating-point dtypes.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// Integer dtypes (not bool).
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::U32)
    }

    /// The type arithmetic is done in: half types compute in f32.
    pub fn compute(self) -> DType {
        match self {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        }
    }

    /// Short name as used in messages and Display (`f32`, `i32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// The dtype two operands are promoted to, following PyTorch's lattice
    /// bool < integers < floats; i32 with u32 gives i32 (PyTorch would use
    /// int64), f16 with bf16 gives f32.
    pub fn promote(a: DType, b: DType) -> DType {
        use DType::*;
        if a == b {
            return a;
        }
        match (a, b) {
            (Bool, x) | (x, Bool) => x,
            (I32, U32) | (U32, I32) => I32,
            (F16, BF16) | (BF16, F16) => F32,
            (x, y) if x.is_int() && y.is_float() => y,
            (x, y) if x.is_float() && y.is_int() => x,
            (x, y) => x.max(y),
        }
    }

    /// The float dtype an op that needs floats computes in for this input
    /// (ints and bool become f32, as PyTorch's default dtype).
    pub fn to_float(self) -> DType {
        if self.is_float() {
            self
        } else {
            DType::F32
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is the element of a tensor dtype.
pub trait WithDType: Copy + Send + Sync + 'static + std::fmt::Debug {
    /// The dtype this Rust type stores.
    const DTYPE: DType;
    /// Convert to f64 (exact for every type but u64-sized values, which Voltaic has none of).
    fn to_f64(self) -> f64;
    /// Convert from f64 with Rust `as` semantics (saturating for ints; NaN becomes 0).
    fn from_f64(v: f64) -> Self;
}

macro_rules! with_dtype {
    ($t:ty, $d:ident, $to:expr, $from:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$d;
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
        }
    };
}
with_dtype!(f32, F32, |x: f32| x as f64, |v: f64| v as f32);
with_dtype!(f64, F64, |x: f64| x, |v: f64| v);
with_dtype!(i32, I32, |x: i32| x as f64, |v: f64| v as i32);
with_dtype!(u32, U32, |x: u32| x as f64, |v: f64| v as u32);
with_dtype!(bool, Bool, |x: bool| x as u8 as f64, |v: f64| v != 0.0);
with_dtype!(f16, F16, |x: f16| x.to_f64(), f16::from_f64);
with_dtype!(bf16, BF16, |x: bf16| x.to_f64(), bf16::from_f64);
