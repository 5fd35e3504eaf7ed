#!/usr/bin/env bash
# Runs on the lent GPU machine: two binaries alternated in one call
# (.bin/voltaic-before and .bin/voltaic, stripped and gzipped), on the embed
# suite against PyTorch, the encoder training rows and the f32 product rows;
# then where the new binary's embed_b64 time goes (VOLTAIC_PROFILE=1) and
# every autotuner candidate's time for its products, for both binaries.
# MiniLM travels in two calls as device_run.sh says: the first copies
# .m1/part1 to /tmp/m/part1, the second carries [".gl", ".bin", ".m2"].
# Everything comes back as $OUT/all.tgz.
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1
for f in .bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x .bin/*
if [ -d .m2 ]; then
    [ -f .m2/model/model.safetensors ] || cat /tmp/m/part1 .m2/part2 > .m2/model/model.safetensors
    export VOLTAIC_MINILM_DIR=$PWD/.m2/model
fi
.bin/voltaic devices > "$OUT/devices.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv >> "$OUT/devices.txt"
what="${1:-embed,train,profile,tune}"
bins=(voltaic-before voltaic)
if [[ "$what" == *embed* ]]; then
    for i in 1 2; do
        for b in "${bins[@]}"; do
            peer=--no-peer
            [ "$i" = 1 ] && peer=""
            .bin/$b bench --suite embed --device gpu --json $peer 2>> "$OUT/err.txt" | sed "s/^/$b /" | tee -a "$OUT/embed.jsonl"
        done
    done
fi
if [[ "$what" == *train* ]]; then
    for b in "${bins[@]}"; do
        .bin/$b bench --suite gpu --filter matmul_f32 --json 2>> "$OUT/err.txt" | sed "s/^/$b /" | tee -a "$OUT/rows.jsonl"
        .bin/$b bench --suite train --filter encoder_f --json 2>> "$OUT/err.txt" | sed "s/^/$b /" | tee -a "$OUT/rows.jsonl"
    done
fi
if [[ "$what" == *profile* ]]; then
    VOLTAIC_PROFILE=1 .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --runs 2 --no-peer > /dev/null 2> "$OUT/profile-embed.txt"
    python3 scripts/profile_sum.py "$OUT/profile-embed.txt" --last 2 --top 30 > "$OUT/profile-embed.sum" 2>&1
    head -40 "$OUT/profile-embed.sum"
    gzip -f "$OUT/profile-embed.txt"
fi
if [[ "$what" == *tune* ]]; then
    for b in "${bins[@]}"; do
        VOLTAIC_CACHE_DIR=$(mktemp -d) VOLTAIC_AUTOTUNE=sync VOLTAIC_AUTOTUNE_LOG=2 .bin/$b bench --suite embed --device gpu --filter embed_b64 --runs 2 --no-peer > /dev/null 2> "$OUT/tune-$b.txt"
        grep -- "->" "$OUT/tune-$b.txt"
    done
fi
if [[ "$what" == *isolated* ]]; then
    # Each binary in a process of its own with an empty cache, its products
    # tuned before their first run on an otherwise idle GPU, then profiled.
    i=0
    for b in voltaic-before voltaic voltaic voltaic-before; do
        i=$((i + 1))
        VOLTAIC_CACHE_DIR=$(mktemp -d) VOLTAIC_AUTOTUNE=sync VOLTAIC_AUTOTUNE_LOG=2 VOLTAIC_PROFILE=1 \
            .bin/$b bench --suite embed --device gpu --filter embed_b64 --runs 3 --no-peer > "$OUT/iso$i-$b.out" 2> "$OUT/iso$i-$b.txt"
        echo "== $i $b"
        python3 scripts/profile_sum.py "$OUT/iso$i-$b.txt" --last 2 --top 8 2>&1 | head -10
        grep -- "->" "$OUT/iso$i-$b.txt"
        gzip -f "$OUT/iso$i-$b.txt"
    done
fi
if [[ "$what" == *linear* ]]; then
    .bin/voltaic bench --suite gpu --filter linear_f32 --json 2>> "$OUT/err.txt" | tee -a "$OUT/linear.jsonl"
fi
if [[ "$what" == *pass* ]]; then
    # embed_b64's GPU time in the passes it runs in unprofiled, and its host phases.
    .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --no-peer > /dev/null 2>> "$OUT/err.txt"
    VOLTAIC_PROFILE=pass .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --runs 2 --no-peer > "$OUT/pass-embed.out" 2> "$OUT/pass-embed.txt"
    grep -E "one pass|total over|host" "$OUT/pass-embed.txt" | tail -8
    gzip -f "$OUT/pass-embed.txt"
fi
if [[ "$what" == *steps* ]]; then
    # The train suite's step rows and the encoder steps, binaries alternated.
    for i in ${ROUNDS:-1 2}; do
        for b in "${bins[@]}"; do
            peer=--no-peer
            [ "$i" = 1 ] && [ "$b" = voltaic ] && peer=""
            .bin/$b bench --suite train --filter train_ --json $peer 2>> "$OUT/err.txt" | sed "s/^/$b /" | tee -a "$OUT/steps.jsonl"
            [ -z "${NO_ENCODER:-}" ] && .bin/$b bench --suite train --filter encoder_f --json $peer 2>> "$OUT/err.txt" | sed "s/^/$b /" | tee -a "$OUT/steps.jsonl"
        done
    done
fi
if [[ "$what" == *knobs* ]]; then
    # embed_b64 under the submission settings, to find where a batch's time
    # beyond its kernels goes.
    .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --no-peer > /dev/null 2>> "$OUT/err.txt"
    for knob in "" VOLTAIC_SUBMIT_THREAD=0 VOLTAIC_BATCH_DISPATCHES=1 VOLTAIC_BATCH_DISPATCHES=1000 VOLTAIC_MAX_IN_FLIGHT=1 VOLTAIC_MAX_IN_FLIGHT=2 VOLTAIC_MAX_IN_FLIGHT=32 ""; do
        echo "${knob:-default} $(env $knob .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --no-peer --runs 5 --json 2>> "$OUT/err.txt")" | tee -a "$OUT/knobs.txt"
    done
fi
if [[ "$what" == *clocks* ]]; then
    # SM clock, power and throttle reasons every 50 ms while embed_b64 runs,
    # Voltaic's loop and then PyTorch's.
    .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --no-peer > /dev/null 2>> "$OUT/err.txt"
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 50 > "$OUT/clocks.csv" &
    smi=$!
    sleep 1; echo "voltaic start $(date +%T.%N)" >> "$OUT/clocks-marks.txt"
    .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --no-peer --runs 20 2>> "$OUT/err.txt" | tee -a "$OUT/clocks-marks.txt"
    echo "voltaic end $(date +%T.%N)" >> "$OUT/clocks-marks.txt"; sleep 1
    echo "peer start $(date +%T.%N)" >> "$OUT/clocks-marks.txt"
    .bin/voltaic bench --suite embed --device gpu --filter embed_b64 --runs 20 2>> "$OUT/err.txt" | tee -a "$OUT/clocks-marks.txt"
    echo "peer end $(date +%T.%N)" >> "$OUT/clocks-marks.txt"
    kill $smi
fi
if [[ "$what" == *tuning* ]]; then
    # The tuner's choices for embed_b64's products in fresh processes (empty
    # caches, measured before the first run), twice per binary, with the SM
    # clock sampled meanwhile.
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50 > "$OUT/tuning-clocks.csv" &
    smi=$!
    for b in voltaic voltaic-before voltaic voltaic-before; do
        echo "$b start $(date +%T.%N)" >> "$OUT/tuning-marks.txt"
        VOLTAIC_CACHE_DIR=$(mktemp -d) VOLTAIC_AUTOTUNE=sync VOLTAIC_AUTOTUNE_LOG=2 .bin/$b bench --suite embed --device gpu --filter embed_b64 --runs 3 --no-peer 2>> "$OUT/tuning-$b.txt" | tee -a "$OUT/tuning-marks.txt"
        echo "$b end $(date +%T.%N)" >> "$OUT/tuning-marks.txt"
        grep "autotune: 1 8192.* -> " "$OUT/tuning-$b.txt" | tail -4
    done
    kill $smi
fi
if [[ "$what" == *fresh* ]]; then
    # The embed suite as a first-time user runs it: each binary with an
    # empty Voltaic cache (background tuning), PyTorch in the same run.
    for b in voltaic voltaic-before voltaic; do
        VOLTAIC_CACHE_DIR=$(mktemp -d) .bin/$b bench --suite embed --device gpu --json 2>> "$OUT/err.txt" | sed "s/^/$b /" | tee -a "$OUT/fresh.jsonl"
    done
fi
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
