//! The one error type of Voltaic.
//!
//! Every fallible public function returns [`Result`]. Messages name the op, the
//! shapes or values involved, and what was expected, e.g.
//! `matmul: cannot multiply [2, 3] by [4, 5]: inner dimensions 3 and 4 differ`.

/// Everything that can go wrong in Voltaic.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Shapes that do not fit the op (broadcasting, matmul, reshape, ...).
    #[error("{op}: {msg}")]
    Shape {
        /// The op that refused its inputs.
        op: &'static str,
        /// What was wrong, with the shapes.
        msg: String,
    },
    /// A dtype the op does not accept.
    #[error("{op}: {msg}")]
    DType {
        /// The op that refused its inputs.
        op: &'static str,
        /// What was wrong, with the dtypes.
        msg: String,
    },
    /// An axis out of range, repeated, or otherwise invalid.
    #[error("{op}: {msg}")]
    Axis {
        /// The op that refused its axes.
        op: &'static str,
        /// What was wrong, with the axes and the rank.
        msg: String,
    },
    /// An index (given as an argument or found in an index tensor) out of range.
    #[error("{op}: {msg}")]
    Index {
        /// The op that met the index.
        op: &'static str,
        /// What was wrong, with the index and the size.
        msg: String,
    },
    /// An argument value outside what the op accepts (negative stride, p > 1, ...).
    #[error("{op}: {msg}")]
    Value {
        /// The op that refused the value.
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
    /// Tensors on different devices met in one op, or a device is unavailable.
    #[error("{op}: {msg}")]
    Device {
        /// The op that met the devices.
        op: &'static str,
        /// What was wrong, with the devices.
        msg: String,
    },
    /// A collective operation of data-parallel training failed: another
    /// replica or rank failed, ranks disagree, or a peer stopped answering.
    #[error("{op}: {msg}")]
    Distributed {
        /// The collective or step that failed.
        op: &'static str,
        /// What happened, naming the rank or replica.
        msg: String,
    },
    /// An allocation could not be satisfied.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A failure inside a backend (shader compilation, validation, device loss).
    #[error("backend: {0}")]
    Backend(String),
    /// An I/O failure, with the path or operation.
    #[error("io: {0}")]
    Io(String),
    /// A malformed file (safetensors, GGUF, IDX, ...).
    #[error("format: {0}")]
    Format(String),
}

/// Voltaic's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Is this a shape error?
    pub fn is_shape(&self) -> bool {
        matches!(self, Error::Shape { .. })
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

/// Build an error of the given variant with a formatted message: `err!(Shape, "matmul", "...", ..)`.
macro_rules! err {
    ($kind:ident, $op:expr, $($fmt:tt)+) => {
        $crate::error::Error::$kind { op: $op, msg: format!($($fmt)+) }
    };
}
/// Return early with an error: `bail!(Shape, "matmul", "...", ..)`.
macro_rules! bail {
    ($kind:ident, $op:expr, $($fmt:tt)+) => {
        return Err($crate::error::err!($kind, $op, $($fmt)+))
    };
}
pub(crate) use bail;
pub(crate) use err;
