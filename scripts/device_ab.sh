#!/usr/bin/env bash
# Two builds alternated on the lent GPU, everything logged under $OUT: the
# train suite's rows (steps, epochs, the encoder in f32/f16/bf16) without the
# peer, ROUNDS times each binary in turn, then the new binary once with
# PyTorch as the peer, then the tests carried in .bin. Pack here first:
#   strip -o .bin/voltaic target/release/voltaic (the change), the build
#   before it as .bin/voltaic-prev, test binaries (cargo test --release
#   --no-run) as .bin/NAME, all gzipped or xz-compressed (xz -9 keeps the
#   binaries and four test binaries under the 64 MiB carry), Fashion-MNIST
#   in .bin/data
# then call with carry [".gl", ".bin"]:
#   ROUNDS=2 bash scripts/device_ab.sh ab        (then: peer,tests)
# FILTER narrows the rows (a substring of their names, or several separated
# by spaces, each run in turn; all but cold_ rows when empty).
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 VOLTAIC_FASHION_MNIST=$PWD/.bin/data
for f in .bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
for f in .bin/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
chmod +x .bin/* 2>/dev/null
what="${1:-ab,peer,tests}"
# One run of the rows per substring of FILTER (all rows when it is empty).
filters=("${FILTER:-}")
[ -n "${FILTER:-}" ] && read -r -a filters <<< "$FILTER"
rounds="${ROUNDS:-2}"
.bin/voltaic devices > "$OUT/devices.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv >> "$OUT/devices.txt"
for pattern in "${filters[@]}"; do
    filter=()
    [ -n "$pattern" ] && filter=(--filter "$pattern")
    if [[ "$what" == *ab* ]]; then
        # Warm the caches of both (pipelines, tuned plans) before timing.
        for b in voltaic-prev voltaic; do
            .bin/$b bench --suite train "${filter[@]}" --no-peer --runs 1 > /dev/null 2>> "$OUT/ab.err"
        done
        for r in $(seq "$rounds"); do
            for b in voltaic-prev voltaic; do
                .bin/$b bench --suite train "${filter[@]}" --no-peer --json 2>> "$OUT/ab.err" | sed "s/^/{\"bin\":\"$b\",\"round\":$r} /" | tee -a "$OUT/ab.jsonl"
            done
        done
    fi
    if [[ "$what" == *peer* ]]; then
        .bin/voltaic bench --suite train "${filter[@]}" --json 2>> "$OUT/peer.err" | tee -a "$OUT/peer.jsonl"
    fi
done
if [[ "$what" == *tests* ]]; then
    for t in lib gpu opinfo nn grad train mixed_precision; do
        [ -x ".bin/$t" ] && ".bin/$t" --test-threads=4 >> "$OUT/tests.txt" 2>&1
    done
    grep -E "test result|panicked|FAILED" "$OUT/tests.txt"
fi
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
