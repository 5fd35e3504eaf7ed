//! Files: safetensors (weights, checkpoints) and IDX (MNIST-style datasets).
//! Readers check every size and offset and never panic on malformed input;
//! writers never leave a half-written file behind.

pub mod idx;
pub mod safetensors;

use std::io::Write;
use std::path::Path;

/// Write `bytes` to `path` through a temporary file in the same directory
/// and a rename, so a crash never leaves half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}
