#!/usr/bin/env bash
# Mixed precision (issue 19) on the lent GPU, everything logged under $OUT.
# Build and pack here first:
#   strip -o .bin/voltaic target/release/voltaic, and the `lib` and
#   `mixed_precision` and `gpu` test binaries (cargo test --release --no-run), gzipped,
#   with the Fashion-MNIST files in .bin/data (see scripts/device_pack.sh)
# then call with carry [".gl", ".bin"] (and the MiniLM parts, see
# scripts/device_run.sh, for "embed"):
#   bash scripts/device_amp.sh tests,bench,train,embed
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
if [[ "$what" == *train* ]]; then
    for p in f32 f16 bf16; do
        .bin/voltaic train --model cnn --batch-size 256 --epochs 3 --seed 1 --precision $p --device gpu --out /tmp/run-$p --json --quiet 2>> "$OUT/train.err" | tee -a "$OUT/train.jsonl"
    done
fi
if [[ "$what" == *embed* ]]; then
    .bin/bert --test-threads=1 --nocapture minilm 2>&1 | grep -E "cosine|test result|panicked" | tee "$OUT/bert.txt"
fi
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
