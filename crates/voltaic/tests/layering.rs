//! The crate's layers only look down. The allowed order is written once, in
//! ARCHITECTURE.md between `<!-- layers -->` markers; this test reads it,
//! maps every source file to its layer and fails when a file names a module
//! of a higher layer (through `crate::...` paths, `use` included), or when
//! one executor names another.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `(layer index, name, modules)` from ARCHITECTURE.md, lowest first.
fn layers() -> Vec<(usize, String, Vec<String>)> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let start = text.find("<!-- layers -->").expect("ARCHITECTURE.md has a <!-- layers --> block");
    let end = text[start + 1..].find("<!-- /layers -->").expect("the layers block is closed") + start + 1;
    let mut out = vec![];
    for line in text[start..end].lines() {
        // "| 3 | backend | `backend` (the seam), `backend::cpu`, ... | ..." in a table.
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 {
            continue;
        }
        let Ok(n) = cells[1].parse::<usize>() else { continue };
        let modules: Vec<String> = cells[3].split('`').skip(1).step_by(2).map(str::to_string).collect();
        out.push((n, cells[2].to_string(), modules));
    }
    assert!(out.len() >= 5, "the layers table in ARCHITECTURE.md lists {} layers", out.len());
    out
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a source file (`backend/wgpu/exec.rs` -> `backend::wgpu::exec`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// The layer of a module path: its longest prefix listed in the table.
fn layer_of(module: &str, table: &[(usize, String, Vec<String>)]) -> Option<(usize, String)> {
    let mut best: Option<(usize, usize, String)> = None;
    for (n, _, mods) in table {
        for m in mods {
            let hit = module == m || module.starts_with(&format!("{m}::"));
            if hit && best.as_ref().is_none_or(|b| m.len() > b.1) {
                best = Some((*n, m.len(), m.clone()));
            }
        }
    }
    best.map(|(n, _, m)| (n, m))
}

/// Source text without test code: `#[cfg(test)]` items (a `mod x;` line or
/// an inline `mod tests { ... }`, which always closes the file).
fn non_test(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l.trim() == "#[cfg(test)]" {
            match lines.next() {
                Some(n) if n.trim_end().ends_with(';') => continue,
                _ => break,
            }
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// Files declared as `#[cfg(test)] mod name;` (test-only modules).
fn test_only_files(files: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = vec![];
    for f in files {
        let text = std::fs::read_to_string(f).unwrap();
        let dir = match f.file_stem().unwrap().to_str().unwrap() {
            "mod" | "lib" => f.parent().unwrap().to_path_buf(),
            stem => f.parent().unwrap().join(stem),
        };
        let mut lines = text.lines();
        while let Some(l) = lines.next() {
            if l.trim() != "#[cfg(test)]" {
                continue;
            }
            let Some(next) = lines.next() else { break };
            let decl = next.trim().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            if let Some(name) = decl.strip_prefix("mod ").and_then(|n| n.strip_suffix(';')) {
                out.push(dir.join(format!("{name}.rs")));
                out.push(dir.join(name).join("mod.rs"));
            }
        }
    }
    out
}

/// The module paths a text names through `crate::`: `crate::a::b::C` gives
/// `a::b` (stopping at the first capitalised or unknown segment); names the
/// crate root re-exports map to the module they come from.
fn references(text: &str, reexports: &HashMap<String, String>) -> Vec<String> {
    let mut out = vec![];
    for (i, _) in text.match_indices("crate::") {
        // `$crate::` in macros counts too; `voltaic_crate::` and the like do not.
        if i > 0 && text[..i].chars().last().is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[i + "crate::".len()..];
        let path: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
        let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
        if segs.is_empty() {
            continue;
        }
        if let Some(m) = reexports.get(segs[0]) {
            out.push(m.clone());
            continue;
        }
        while segs.last().is_some_and(|s| s.starts_with(char::is_uppercase)) {
            segs.pop();
        }
        if !segs.is_empty() {
            out.push(segs.join("::"));
        }
    }
    out
}

/// Names lib.rs re-exports, and the module each comes from.
fn root_reexports(lib: &str) -> HashMap<String, String> {
    let mut map = HashMap::new();
    for line in lib.lines() {
        let Some(rest) = line.trim().strip_prefix("pub use ") else { continue };
        // `pub use crate::a::b` (the prelude) names the same module as `pub use a::b`.
        let rest = rest.trim_end_matches(';');
        let rest = rest.strip_prefix("crate::").unwrap_or(rest);
        let (module, names) = match rest.split_once("::{") {
            Some((m, names)) => (m.to_string(), names.trim_end_matches('}').split(',').map(|s| s.trim().to_string()).collect::<Vec<_>>()),
            None => {
                let (m, n) = rest.rsplit_once("::").expect("pub use a::b");
                (m.to_string(), vec![n.to_string()])
            }
        };
        for n in names.into_iter().filter(|n| !n.is_empty()) {
            map.insert(n, module.clone());
        }
    }
    map
}

#[test]
fn no_module_imports_a_higher_layer() {
    let table = layers();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let reexports = root_reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut files = vec![];
    sources(&src, &mut files);
    files.sort();
    let tests_only = test_only_files(&files);
    files.retain(|f| !tests_only.contains(f));
    let mut bad = vec![];
    let mut checked = 0;
    for f in &files {
        let module = module_of(&src, f);
        if module == "lib" {
            continue;
        }
        let Some((mine, my_mod)) = layer_of(&module, &table) else {
            bad.push(format!("{module}: not in any layer of ARCHITECTURE.md's table"));
            continue;
        };
        checked += 1;
        let text = non_test(&std::fs::read_to_string(f).unwrap());
        for r in references(&text, &reexports) {
            let Some((theirs, their_mod)) = layer_of(&r, &table) else {
                bad.push(format!("{module}: names crate::{r}, which is in no layer"));
                continue;
            };
            if theirs > mine {
                bad.push(format!("{module} (layer {mine}) names crate::{r} (layer {theirs})"));
            }
            // Executors are siblings behind the seam: neither names the other.
            let exec = |m: &str| m.starts_with("backend::") && m != "backend";
            if exec(&my_mod) && exec(&their_mod) && my_mod != their_mod {
                bad.push(format!("{module} (executor {my_mod}) names another executor: crate::{r}"));
            }
            // Above the seam, nothing names an executor.
            if exec(&their_mod) && !module.starts_with("backend") {
                bad.push(format!("{module} names an executor past the seam: crate::{r}"));
            }
        }
    }
    assert!(checked > 40, "only {checked} files were checked");
    assert!(bad.is_empty(), "layering violations:\n  {}", bad.join("\n  "));
}

#[test]
fn the_checker_catches_an_upward_import() {
    let table = layers();
    let reexports = root_reexports("pub use tensor::Tensor;\npub use device::Device;");
    let refs = references("use crate::tensor::Tensor;\nfn f() { crate::Device::Cpu; $crate::graph::Value }", &reexports);
    assert_eq!(refs, vec!["tensor", "device", "graph"]);
    let (graph, _) = layer_of("graph", &table).unwrap();
    let (tensor, _) = layer_of("tensor", &table).unwrap();
    let (cpu, m) = layer_of("backend::cpu::reduce", &table).unwrap();
    assert!(tensor > graph && graph > cpu, "tensor {tensor}, graph {graph}, backend::cpu {cpu}");
    assert_eq!(m, "backend::cpu");
    assert_eq!(non_test("a\n#[cfg(test)]\nmod testing;\nb\n#[cfg(test)]\nmod tests {\nuse crate::tensor;\n}\n"), "a\nb\n");
}
