#!/usr/bin/env bash
# The lints CI runs after the tests: clippy and rustdoc with warnings as
# errors, and a check that the library still builds for aarch64 (the CPU
# code picks its instruction set at run time, with no x86-only paths).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
say() { echo "scripts/lint.sh: $*" >&2; }

say "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
say "cargo doc --workspace --no-deps (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
aarch64=aarch64-unknown-linux-gnu
if ! rustup target list --installed 2>/dev/null | grep -q "$aarch64"; then
    say "installing the aarch64 standard library: rustup target add $aarch64"
    rustup target add "$aarch64" || say "warning: could not install $aarch64; the aarch64 build check is NOT run"
fi
if rustup target list --installed 2>/dev/null | grep -q "$aarch64"; then
    say "cargo check -p voltaic --target $aarch64"
    cargo check -p voltaic --target "$aarch64"
fi
