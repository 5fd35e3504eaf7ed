#!/usr/bin/env bash
# Runs on the lent GPU machine (see ../shared/gpu/README.md), everything
# logged under $OUT. Build here first (scripts/device_pack.sh), then call
# with carry [".gl", ".bin"]:
#   bash scripts/device_run.sh tests,bench,trainbench,train,embed [FILTER]
# "embed" needs the MiniLM directory: VOLTAIC_MINILM_DIR, or .m2/model with
# its safetensors file split into .m1/part1 and .m2/part2 (64 MiB a call; a
# call removes carried paths it does not name, so earlier calls copy their
# part to /tmp on the machine and set VOLTAIC_MINILM_DIR there).
# Other parts: cold (the cold-start rows, each in a child process with empty
# caches), tune (offline autotuning of the training shapes: the tables that
# src/backend/wgpu/tuned/ ships), small (realize_small_graph with its peer).
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 VOLTAIC_AUTOTUNE_LOG=1
export VOLTAIC_FASHION_MNIST=$PWD/.bin/data
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
if [[ "$what" == *perf* ]]; then
    # Where the host's time goes in a training step (when the machine has perf).
    if command -v perf > /dev/null; then
        perf record -F 4000 -g -o /tmp/perf.data .bin/voltaic bench --suite train --filter train_cnn_b64 --no-peer --runs 20 > /dev/null 2>&1
        perf report -i /tmp/perf.data --no-children --sort symbol 2>/dev/null | grep -E "^ +[0-9]" | head -80 > "$OUT/perf.txt"
    else
        echo "no perf" > "$OUT/perf.txt"
    fi
fi
if [[ "$what" == *cold* ]]; then
    .bin/voltaic bench --suite gpu --filter cold_start_demo --no-peer --json 2>> "$OUT/cold.err" | tee -a "$OUT/cold.jsonl"
    VOLTAIC_COMPILE_LOG=1 .bin/voltaic bench --suite train --filter cold_epoch --no-peer --json 2>> "$OUT/cold.err" | tee -a "$OUT/cold.jsonl"
fi
if [[ "$what" == *tune* ]]; then
    # Every matmul shape of the training runs (last batches and evaluation
    # included), measured before first use, into a cache directory of its own.
    export VOLTAIC_CACHE_DIR=/tmp/voltaic-tune
    for cfg in "mlp 64 6432" "cnn 64 6432" "mlp 256 2656" "cnn 256 2656"; do
        set -- $cfg
        VOLTAIC_AUTOTUNE=sync timeout 200 .bin/voltaic train --model $1 --batch-size $2 --limit $3 --epochs 1 --device gpu --out /tmp/tune-run --quiet --json 2>> "$OUT/tune.err"
    done
    VOLTAIC_AUTOTUNE=sync .bin/voltaic demo --device gpu > /dev/null 2>> "$OUT/tune.err"
    cp /tmp/voltaic-tune/matmul-*.txt "$OUT/" 2>/dev/null
    unset VOLTAIC_CACHE_DIR
fi
if [[ "$what" == *small* ]]; then
    .bin/voltaic bench --suite gpu --filter realize_small_graph --json 2>> "$OUT/small.err" | tee -a "$OUT/small.jsonl"
    VOLTAIC_PLAN_CACHE=0 .bin/voltaic bench --suite gpu --filter realize_small_graph --json 2>> "$OUT/small.err" | sed 's/^/{"plan_cache":0} /' | tee -a "$OUT/small.jsonl"
fi
if [[ "$what" == *tests* ]]; then
    for t in lib gpu gpu_runtime grad train bert opinfo api plan_cache autotune; do
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
    .bin/voltaic bench --suite train --filter "${filter:-_b}" --json 2> "$OUT/trainbench.err" | grep -v cold_ | tee "$OUT/trainbench.jsonl"
    # The host's time per phase of a step without the plan cache (as before it).
    VOLTAIC_PLAN_CACHE=0 .bin/voltaic bench --suite train --filter train_mlp --no-peer --json 2>> "$OUT/trainbench.err" | tee "$OUT/trainbench-nocache.jsonl"
fi
if [[ "$what" == *embed* ]]; then
    .bin/voltaic bench --suite embed --json 2> "$OUT/embedbench.err" | tee "$OUT/embedbench.jsonl"
fi
if [[ "$what" == *train,* ]] || [[ "$what" == *train ]]; then
    for m in mlp cnn; do
        .bin/voltaic train --model $m --device gpu --data .bin/data --out "$OUT/run-$m" --json --quiet 2>&1 | tee -a "$OUT/train.jsonl"
    done
fi
# Everything in one archive: a device call brings back only a few files.
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
