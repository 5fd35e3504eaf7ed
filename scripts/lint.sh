#!/usr/bin/env bash
# The lints CI runs after the tests: clippy and rustdoc with warnings as
# errors, and checks that the library still builds for the other targets.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
say() { echo "scripts/lint.sh: $*" >&2; }

# With the MPI feature too (scripts/test.sh installed Open MPI): its code is linted and documented.
say "cargo clippy --workspace --all-targets --features voltaic-cli/mpi -- -D warnings"
cargo clippy --workspace --all-targets --features voltaic-cli/mpi -- -D warnings
say "cargo doc --workspace --no-deps (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --features voltaic-cli/mpi
# The library for the other platforms wgpu serves (a build check: nothing
# runs; the standard library for each comes from rustup): aarch64 Linux,
# macOS (Metal), Windows (DX12), and the browser (wasm32 + WebGPU, where
# clippy runs too, since that code is compiled nowhere else).
for target in aarch64-unknown-linux-gnu x86_64-apple-darwin x86_64-pc-windows-msvc wasm32-unknown-unknown; do
    if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
        say "installing the $target standard library: rustup target add $target"
        rustup target add "$target" || { say "error: could not install $target"; exit 1; }
    fi
    if [ "$target" = wasm32-unknown-unknown ]; then
        say "cargo clippy -p voltaic -p voltaic-web --target $target -- -D warnings"
        cargo clippy -p voltaic -p voltaic-web --lib --target "$target" -- -D warnings
    else
        say "cargo check -p voltaic --target $target"
        cargo check -p voltaic --target "$target"
    fi
done
