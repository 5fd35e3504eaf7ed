//! Reference models built from the `nn` blocks.

pub mod bert;
pub mod classifier;
pub mod generate;
pub mod gguf_tokenizer;
pub mod llama;

/// The trimmed output of a Python snippet that locates an installed package,
/// run with Voltaic's own package cache (where `voltaic embed` and `voltaic
/// generate` install models) ahead of `PYTHONPATH`; `None` when it fails or
/// prints nothing. `what` names the package in the error when python3 cannot run.
pub(crate) fn find_with_python(code: &str, what: &str) -> crate::Result<Option<String>> {
    let mut cmd = std::process::Command::new("python3");
    cmd.args(["-c", code]);
    if let Some(cache) = bert::minilm_cache_dir() {
        let mut path = std::ffi::OsString::from(cache);
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            path.push(":");
            path.push(old);
        }
        cmd.env("PYTHONPATH", path);
    }
    let out = cmd.output().map_err(|e| crate::Error::Io(format!("running python3 to find {what}: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok((out.status.success() && !text.is_empty()).then_some(text))
}
