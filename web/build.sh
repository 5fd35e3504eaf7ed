#!/usr/bin/env bash
# Builds the browser bundle into web/dist: Voltaic compiled to wasm32 with
# WebGPU (cargo), its JavaScript glue (wasm-bindgen), and the pages. Installs
# what is missing first, saying so: the wasm32 target (rustup) and
# wasm-bindgen-cli at the version Cargo.lock pins (cargo install).
#
#   bash web/build.sh            # then serve web/dist (see web/README in the README)
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "web/build.sh: $*" >&2; }

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    say "installing the wasm32 target: rustup target add wasm32-unknown-unknown"
    rustup target add wasm32-unknown-unknown
fi
want=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
have=$(wasm-bindgen --version 2>/dev/null | awk '{ print $2 }' || true)
if [ "$have" != "$want" ]; then
    say "installing wasm-bindgen-cli $want (it must match the wasm-bindgen crate): cargo install wasm-bindgen-cli --version $want"
    cargo install -q wasm-bindgen-cli --version "$want"
fi

say "cargo build -p voltaic-web --target wasm32-unknown-unknown --release"
cargo build -q -p voltaic-web --lib --target wasm32-unknown-unknown --release
target="${CARGO_TARGET_DIR:-target}"
rm -rf web/dist
mkdir -p web/dist/data
wasm-bindgen --target web --no-typescript --out-dir web/dist/pkg "$target/wasm32-unknown-unknown/release/voltaic_web.wasm"
cp web/www/* web/dist/
say "web/dist: $(du -h web/dist/pkg/voltaic_web_bg.wasm | cut -f1) of wasm; add data/ (model.safetensors, t10k-*.gz) and fixtures.json, then serve it"
