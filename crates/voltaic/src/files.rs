//! Small file-system helpers shared by every layer: atomic writes and the
//! cache directory.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Write `bytes` to `path` through a temporary file in the same directory
/// and a rename, so a crash never leaves half a file; the file and then the
/// directory are synced, so the rename itself survives a power cut.
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
        std::fs::rename(&tmp, path)?;
        sync_dir(path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Make a directory's entries (a rename into it) durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    std::fs::File::open(dir)?.sync_all()?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Remove the temporary files [`write_atomic`] leaves in `dir` when its
/// process is killed mid-write (`.NAME.tmpPID`, for a PID that is no longer
/// running). Returns how many were removed.
pub fn remove_stale_temp_files(dir: &Path) -> std::io::Result<usize> {
    let mut removed = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix('.').and_then(|n| n.rsplit_once(".tmp")).map(|(_, pid)| pid) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        let alive = pid == std::process::id() || (cfg!(target_os = "linux") && Path::new(&format!("/proc/{pid}")).exists());
        if !alive && e.file_type()?.is_file() {
            std::fs::remove_file(e.path())?;
            removed += 1;
        }
    }
    Ok(removed)
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
