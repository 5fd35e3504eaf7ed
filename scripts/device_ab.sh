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
#   ROUNDS=2 bash scripts/device_ab.sh ab        (then: peer,profile,tests)
# BINS: the binaries of the rounds (default "voltaic-prev voltaic").
# FILTER narrows the rows (a substring of their names, or several separated
# by spaces, each run in turn; all but cold_ rows when empty). TUNE=1 gives
# each binary a cache of its own, tuned before the rounds. The step tunelog
# (before ab) has the new binary time every candidate of the products of
# the rows matching each of TUNE_ROWS (default encoder_f16) in its own
# cache, logging each time (VOLTAIC_AUTOTUNE=sync, VOLTAIC_AUTOTUNE_LOG=2)
# within TUNE_SECS (default 240) each; the other binary then tunes in the
# background as usual. tuned-plans.txt holds what the new binary's cache
# ends with (what `tuned/` ships for an adapter).
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
# The cache directory binary $1 runs with: its own with TUNE=1, else the default.
cache() { if [ -n "${TUNE:-}" ] || [[ "$what" == *tunelog* ]]; then echo "/tmp/cache-$1"; else echo "${VOLTAIC_CACHE_DIR:-$HOME/.cache/voltaic}"; fi; }
.bin/voltaic devices > "$OUT/devices.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv >> "$OUT/devices.txt"
if [[ "$what" == *tunelog* ]]; then
    for p in ${TUNE_ROWS:-encoder_f16}; do
        timeout "${TUNE_SECS:-240}" env VOLTAIC_CACHE_DIR="$(cache voltaic)" VOLTAIC_AUTOTUNE=sync VOLTAIC_AUTOTUNE_LOG=2 .bin/voltaic bench --suite train --filter "$p" --runs 1 --no-peer > /dev/null 2> "$OUT/tune-$p.txt"
        echo "tunelog $p: rc $?, $(grep -c 'in turn\|->' "$OUT/tune-$p.txt") choices"
    done
fi
for pattern in "${filters[@]}"; do
    filter=()
    [ -n "$pattern" ] && filter=(--filter "$pattern")
    if [[ "$what" == *ab* ]]; then
        # Warm the caches of both (pipelines, tuned plans) before timing.
        # With TUNE=1 each binary has a cache of its own and measures every
        # product's candidates first (VOLTAIC_AUTOTUNE=sync); for the three
        # encoder rows that did not end within 9.5 minutes on an H200
        # (2026-12-01): give it one row, or tune offline.
        # The tuner's choices go to ab.err; the new binary's plans are kept at once.
        for b in ${BINS:-voltaic-prev voltaic}; do
            env VOLTAIC_CACHE_DIR="$(cache "$b")" VOLTAIC_AUTOTUNE_LOG=1 ${TUNE:+VOLTAIC_AUTOTUNE=sync} .bin/$b bench --suite train "${filter[@]}" --no-peer --runs 1 > /dev/null 2>> "$OUT/ab.err"
        done
        cat "$(cache voltaic)"/matmul-2-*.txt > "$OUT/tuned-plans.txt" 2>/dev/null
        for r in $(seq "$rounds"); do
            for b in ${BINS:-voltaic-prev voltaic}; do
                VOLTAIC_CACHE_DIR=$(cache "$b") .bin/$b bench --suite train "${filter[@]}" --no-peer --json 2>> "$OUT/ab.err" | sed "s/^/{\"bin\":\"$b\",\"round\":$r} /" | tee -a "$OUT/ab.jsonl"
            done
        done
    fi
    if [[ "$what" == *peer* ]]; then
        VOLTAIC_CACHE_DIR=$(cache voltaic) .bin/voltaic bench --suite train "${filter[@]}" --json 2>> "$OUT/peer.err" | tee -a "$OUT/peer.jsonl"
    fi
done
if [[ "$what" == *profile* ]]; then
    # The new binary's encoder steps under each of PROFILE_MODES (default
    # "dispatch pass": a stamp after each kernel in the step's one pass, and
    # the pass as a whole; "1" is a pass per kernel), summed over the last
    # realizations (PROFILE_ROWS, default f32 f16); dispatch logs are also
    # summed by whole label.
    for p in ${PROFILE_ROWS:-f32 f16}; do
        for m in ${PROFILE_MODES:-dispatch pass}; do
            VOLTAIC_CACHE_DIR=$(cache voltaic) VOLTAIC_PROFILE=$m .bin/voltaic bench --suite train --filter encoder_$p --runs 1 --no-peer > /dev/null 2> "$OUT/prof-$m-$p.txt"
            python3 scripts/profile_sum.py "$OUT/prof-$m-$p.txt" --last 12 --top 40 > "$OUT/prof-$m-$p.sum" 2>&1
            [ "$m" = dispatch ] && python3 scripts/profile_sum.py "$OUT/prof-$m-$p.txt" --last 12 --top 80 --labels > "$OUT/prof-$m-$p.labels" 2>&1
            head -3 "$OUT/prof-$m-$p.sum"
            gzip -f "$OUT/prof-$m-$p.txt"
        done
    done
fi
if [[ "$what" == *tests* ]]; then
    # TESTS: binaries to run, each optionally NAME:FILTER (lib:every_plan).
    for spec in ${TESTS:-lib gpu opinfo nn grad train mixed_precision matmul elementwise}; do
        t=${spec%%:*}
        f=()
        [[ "$spec" == *:* ]] && f=("${spec#*:}")
        [ -x ".bin/$t" ] && ".bin/$t" --test-threads=4 "${f[@]}" >> "$OUT/tests.txt" 2>&1
    done
    grep -E "test result|panicked|FAILED" "$OUT/tests.txt"
fi
# The plans the new binary's tuner chose (what `tuned/` ships for an adapter).
cat "$(cache voltaic)"/matmul-2-*.txt > "$OUT/tuned-plans.txt" 2>/dev/null
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
