//! Files: safetensors (weights, checkpoints), GGUF (quantized language
//! models) and IDX (MNIST-style datasets).
//! Readers check every size and offset and never panic on malformed input;
//! writers never leave a half-written file behind.

pub mod gguf;
pub mod idx;
pub mod safetensors;

pub use crate::files::{cache_dir, remove_stale_temp_files, write_atomic};

/// Memory-map `path` read-only for a reader of `kind` files (the error of a
/// directory names what was expected).
/// A file's bytes: mapped from disk, or handed over (read elsewhere, or a
/// browser's fetch). The readers parse either the same way.
pub(crate) enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

pub(crate) fn map_file(path: &std::path::Path, kind: &str) -> crate::error::Result<memmap2::Mmap> {
    use crate::error::Error;
    if path.is_dir() {
        return Err(Error::Io(format!("{} is a directory, expected a {kind} file", path.display())));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    // SAFETY: the map is read-only; another process changing the file
    // underneath could change what a reader sees, never the memory safety of
    // the bounds-checked parsing every reader does.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}
