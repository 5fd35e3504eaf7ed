//! Small file-system helpers shared by every layer: atomic writes and the
//! cache directory.

use std::io::Write;
use std::path::{Path, PathBuf};

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

/// Where Voltaic keeps caches: `$VOLTAIC_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/voltaic`, else `~/.cache/voltaic`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("VOLTAIC_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("voltaic"))
}
