#!/usr/bin/env bash
# Runs on the lent GPU machine (see ../shared/gpu/README.md), everything
# logged under $OUT. Build here first (scripts/device_pack.sh), then call
# with carry [".gl", ".bin"]:
#   bash scripts/device_run.sh tests,bench,trainbench,train,embed [FILTER]
# "embed" needs the MiniLM directory: VOLTAIC_MINILM_DIR, or .m2/model with
# its safetensors file split into .m1/part1 and .m2/part2 (64 MiB a call; a
# call removes carried paths it does not name, so earlier calls copy their
# part to /tmp on the machine and set VOLTAIC_MINILM_DIR there).
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 VOLTAIC_AUTOTUNE_LOG=1
for f in .bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x .bin/* 2>/dev/null
what="${1:-tests,bench}"
filter="${2:-}"
.bin/voltaic devices 2>&1 | tee "$OUT/devices.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv | tee -a "$OUT/devices.txt"
if [[ "$what" == *embed* ]] && [ -z "${VOLTAIC_MINILM_DIR:-}" ]; then
    [ -f .m2/model/model.safetensors ] || cat .m1/part1 .m2/part2 > .m2/model/model.safetensors
    export VOLTAIC_MINILM_DIR=$PWD/.m2/model
fi
if [[ "$what" == *tests* ]]; then
    for t in lib gpu gpu_runtime grad train bert opinfo api; do
        [ -x ".bin/$t" ] && ".bin/$t" --test-threads=4 2>&1 | tee -a "$OUT/tests.txt" | grep -E "^test |test result|panicked"
    done
fi
if [[ "$what" == *profile* ]]; then
    VOLTAIC_PROFILE=1 .bin/voltaic demo --device gpu 2>&1 | tail -30 > "$OUT/profile.txt"
fi
if [[ "$what" == *bench* ]] && [[ "$what" != *nobench* ]]; then
    args=(--suite gpu --json)
    [ -n "$filter" ] && args+=(--filter "$filter")
    .bin/voltaic bench "${args[@]}" --plot "$OUT/gpu.png" 2> "$OUT/bench.err" | tee "$OUT/bench.jsonl"
fi
if [[ "$what" == *trainbench* ]]; then
    .bin/voltaic bench --suite train --json 2> "$OUT/trainbench.err" | tee "$OUT/trainbench.jsonl"
fi
if [[ "$what" == *embed* ]]; then
    .bin/voltaic bench --suite embed --json 2> "$OUT/embedbench.err" | tee "$OUT/embedbench.jsonl"
fi
if [[ "$what" == *train,* ]] || [[ "$what" == *train ]]; then
    for m in mlp cnn; do
        .bin/voltaic train --model $m --device gpu --data .bin/data --out "$OUT/run-$m" --json --quiet 2>&1 | tee -a "$OUT/train.jsonl"
    done
fi
