#!/usr/bin/env bash
# Runs on the lent GPU machine (see ../shared/gpu/README.md): the GPU test
# binaries and `voltaic bench --suite gpu` with PyTorch as the peer, all logs
# under $OUT. Build here first:
#   cargo build --release -p voltaic-cli && strip -o .bin/voltaic target/release/voltaic
#   cargo test --release --no-run -p voltaic --test gpu --test gpu_runtime   # then strip each into .bin/
# and call with carry [".gl", ".bin"]: `bash scripts/device_run.sh [tests] [bench] [FILTER]`.
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 VOLTAIC_AUTOTUNE_LOG=1
what="${1:-tests,bench}"
filter="${2:-}"
.bin/voltaic devices 2>&1 | tee "$OUT/devices.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv | tee -a "$OUT/devices.txt"
if [[ "$what" == *tests* ]]; then
    for t in .bin/lib .bin/gpu .bin/gpu_runtime; do
        [ -x "$t" ] && "$t" --test-threads=4 2>&1 | tee -a "$OUT/tests.txt" | grep -E "^test |test result|panicked" 
    done
fi
if [[ "$what" == *profile* ]]; then
    VOLTAIC_PROFILE=1 .bin/voltaic demo --device gpu 2>&1 | tail -30 > "$OUT/profile.txt"
    for f in softmax layernorm sum_f32 add_f32 conv2d; do
        VOLTAIC_PROFILE=1 .bin/voltaic bench --suite gpu --no-peer --runs 1 --filter $f 2>&1 | tail -8 >> "$OUT/profile.txt"
    done
    grep -E "us  " "$OUT/profile.txt" | tail -40
fi
if [[ "$what" == *bench* ]]; then
    args=(--suite gpu --json)
    [ -n "$filter" ] && args+=(--filter "$filter")
    .bin/voltaic bench "${args[@]}" 2> "$OUT/bench.err" | tee "$OUT/bench.jsonl"
    tail -5 "$OUT/bench.err"
fi
