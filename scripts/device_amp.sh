#!/usr/bin/env bash
# Mixed precision (issue 19) on the lent GPU, everything logged under $OUT.
# Build and pack here first:
#   strip -o .bin/voltaic target/release/voltaic, and the `lib` and
#   `mixed_precision` and `gpu` test binaries (cargo test --release --no-run), gzipped,
#   with the Fashion-MNIST files in .bin/data (see scripts/device_pack.sh)
# then call with carry [".gl", ".bin"] (and the MiniLM parts, see
# scripts/device_run.sh, for "embed"):
#   bash scripts/device_amp.sh tests,bench,profile,train,embed
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 VOLTAIC_FASHION_MNIST=$PWD/.bin/data
for f in .bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x .bin/* 2>/dev/null
what="${1:-tests,bench,train}"
.bin/voltaic devices > "$OUT/devices.txt" 2>&1
if [[ "$what" == *embed* ]] && [ -z "${VOLTAIC_MINILM_DIR:-}" ]; then
    [ -f .m2/model/model.safetensors ] || cat /tmp/part1 .m2/part2 > .m2/model/model.safetensors
    export VOLTAIC_MINILM_DIR=$PWD/.m2/model
fi
if [[ "$what" == *tests* ]]; then
    [ -x .bin/mixed_precision ] && .bin/mixed_precision >> "$OUT/tests.txt" 2>&1
    # The tensor-core plans, bf16 included, against the CPU.
    [ -x .bin/lib ] && .bin/lib every_plan_matches_the_cpu >> "$OUT/tests.txt" 2>&1
    # Every kernel family against the CPU, special values included.
    [ -x .bin/gpu ] && .bin/gpu >> "$OUT/tests.txt" 2>&1
    grep -E "test result|panicked|FAILED" "$OUT/tests.txt"
fi
if [[ "$what" == *bench* ]]; then
    .bin/voltaic bench --suite gpu --filter matmul_ --json 2> "$OUT/bench.err" | tee "$OUT/bench.jsonl"
    .bin/voltaic bench --suite train --filter encoder --json 2>> "$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
fi
if [[ "$what" == *tune* ]]; then
    # Every candidate's time for the encoder's products (the tuner's view).
    # An empty cache, so that every shape is tuned again here.
    VOLTAIC_CACHE_DIR=$(mktemp -d) VOLTAIC_AUTOTUNE_LOG=2 .bin/voltaic bench --suite train --filter encoder_f16 --runs 1 --no-peer > "$OUT/tune-f16.out" 2> "$OUT/tune-f16.txt"
    grep "autotune" "$OUT/tune-f16.txt" | grep -- "->" | sort | uniq
    cat ~/.cache/voltaic/matmul-*.txt > "$OUT/tuned-plans.txt" 2>/dev/null
fi
if [[ "$what" == *profile* ]]; then
    # Kernel and host time of the encoder steps, summed by kind of kernel
    # over the last realizations (the last steps).
    for p in f32 f16; do
        VOLTAIC_PROFILE=1 .bin/voltaic bench --suite train --filter encoder_$p --runs 1 --no-peer > "$OUT/profile-$p.out" 2> "$OUT/profile-$p.txt"
        python3 scripts/profile_sum.py "$OUT/profile-$p.txt" --last 12 --top 30 > "$OUT/profile-$p.sum" 2>&1
        cat "$OUT/profile-$p.sum"
        gzip -f "$OUT/profile-$p.txt"
    done
fi
if [[ "$what" == *train* ]]; then
    for p in f32 f16 bf16; do
        .bin/voltaic train --model cnn --batch-size 256 --epochs 3 --seed 1 --precision $p --device gpu --out /tmp/run-$p --json --quiet 2>> "$OUT/train.err" | tee -a "$OUT/train.jsonl"
    done
fi
if [[ "$what" == *embed* ]]; then
    .bin/bert --test-threads=1 --nocapture minilm 2>&1 | grep -E "cosine|test result|panicked" | tee "$OUT/bert.txt"
fi
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
