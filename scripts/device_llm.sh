#!/usr/bin/env bash
# Runs on the lent GPU machine: the llm suite against PyTorch, the LLaMA and
# quantized-tensor tests on the GPU, and one generation, all logged under
# $OUT. The 98 MB model does not fit one call's 64 MiB with the repo, so it
# travels xz-compressed (90.5 MB) in two parts: here, `xz -6 -c MODEL >
# model.xz`, the first 56,000,000 bytes into .l1/p and the rest into .l2/p
# (both git-ignored). One call carries [".l1"] and runs `mkdir -p /tmp/llm &&
# cp .l1/p /tmp/llm/p1`; the next, within 30 seconds, carries [".gl", ".bin",
# ".whl", ".l2"] and runs this script. .bin holds voltaic, llama and qtensor
# (stripped, gzipped; the tests from `cargo test --release --no-run`) and
# .whl the wheels of `gguf` and PyYAML (cp312) for the PyTorch peer.
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
for f in .bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x .bin/*
cat /tmp/llm/p1 $( [ -e .l2/p ] && echo .l2/p || echo /tmp/llm/p2 ) | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > /tmp/llm/model.gguf
sha256sum /tmp/llm/model.gguf | tee "$OUT/model.sha256"
export VOLTAIC_LLM_MODEL=/tmp/llm/model.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# The tests find their fixtures under the path they were built in.
mkdir -p /work && [ -e /work/main ] || ln -sfn "$PWD" /work/main
.bin/voltaic devices 2>&1 | tee "$OUT/devices.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee -a "$OUT/devices.txt"
what="${1:-bench,tests,generate}"
if [[ "$what" == *bench* ]]; then
    .bin/voltaic bench --suite llm --device gpu --json --plot "$OUT/llm_gpu.png" 2> "$OUT/llmbench.err" | tee "$OUT/llmbench.jsonl" \
        || .bin/voltaic bench --suite llm --device gpu --json --no-peer 2>> "$OUT/llmbench.err" | tee "$OUT/llmbench.jsonl"
fi
if [[ "$what" == *tests* ]]; then
    .bin/llama --test-threads=1 --nocapture 2>&1 | tee "$OUT/llama_test.txt" | grep -E "^test |test result|first-step|parts|holds|panicked"
    .bin/qtensor --test-threads=1 2>&1 | tee "$OUT/qtensor_test.txt" | grep -E "test result|panicked"
    [ -x .bin/attention ] && .bin/attention --test-threads=1 2>&1 | tee "$OUT/attention_test.txt" | grep -E "test result|panicked"
    [ -x .bin/gpu ] && .bin/gpu --test-threads=1 long_and_strided 2>&1 | tee "$OUT/gpu_test.txt" | grep -E "test result|panicked"
fi
if [[ "$what" == *generate* ]]; then
    .bin/voltaic generate "The capital of France is" --device gpu -n 64 --json 2>&1 | tee "$OUT/generate.txt"
    VOLTAIC_PROFILE=1 .bin/voltaic generate "Hi" --device gpu -n 3 2>&1 | tail -80 > "$OUT/profile.txt"
fi
if [[ "$what" == *decode* ]]; then
    # The decode row alone, then one generation timed one pass per realization
    # (VOLTAIC_PROFILE=pass) and one kernel per pass (VOLTAIC_PROFILE=1).
    .bin/voltaic bench --suite llm --device gpu --filter decode --no-peer --json 2> "$OUT/decode.err" | tee "$OUT/decode.jsonl"
    VOLTAIC_PROFILE=pass .bin/voltaic generate "Hi" --device gpu -n 8 > "$OUT/profile_pass.txt" 2>&1
    VOLTAIC_PROFILE=1 .bin/voltaic generate "Hi" --device gpu -n 8 > "$OUT/profile_kernels.txt" 2>&1
    grep -E "one pass|total over|cached plan" "$OUT/profile_pass.txt" | tail -12
fi
if [[ "$what" == *gemv* ]]; then
    # The decode row of the session-start binary (.bin/voltaic-before) and
    # of this one under each GEMV shape (VOLTAIC_GEMV=threads,runs[,words][,unpack]),
    # two rounds, then each one's kernels timed in their passes over a
    # generation as long as the row's (a 16-token prompt, 128 new tokens).
    shapes="${GEMV_SHAPES:-64,1 32,4 32,2 64,2 16,4 128,1}"
    for round in 1 2; do
        .bin/voltaic-before bench --suite llm --device gpu --filter decode --no-peer 2>&1 | grep -E "^llm_decode" | sed "s/^/before /" | tee -a "$OUT/gemv.txt"
        for g in $shapes; do
            VOLTAIC_GEMV=$g .bin/voltaic bench --suite llm --device gpu --filter decode --no-peer 2>&1 | grep -E "^llm_decode" | sed "s/^/gemv=$g /" | tee -a "$OUT/gemv.txt"
        done
    done
    prompt="The history of the city goes back many centuries, to a small fishing village by the"
    i=0
    for g in before $shapes; do
        i=$((i + 1))
        if [ "$g" = before ]; then bin=.bin/voltaic-before; else bin=.bin/voltaic; fi
        VOLTAIC_GEMV=$g VOLTAIC_PROFILE=pass $bin generate "$prompt" --device gpu -n 128 > "$OUT/pass$i.txt" 2>&1
        echo "pass$i = $g: $(grep -E 'one pass of' "$OUT/pass$i.txt" | tail -100 | awk '{s += $1; n++} END {printf "%.1f us per realization over %d", s / n, n}')" | tee -a "$OUT/gemv.txt"
    done
    for t in .bin/attention .bin/llama; do
        [ -x "$t" ] && $t --test-threads=1 2>&1 | tee "$OUT/$(basename $t)_test.txt" | grep -E "test result|panicked|first-step"
    done
fi
if [[ "$what" == *rounds* ]]; then
    # The decode row, the session-start binary against this one (and this
    # one with VOLTAIC_GEMV variants, ROUND_VARIANTS, and with other
    # settings, ROUND_ENVS="VAR=value ..."), alternated.
    for round in $(seq ${ROUNDS:-2}); do
        for bin in ${ROUND_BINS:-.bin/voltaic-before .bin/voltaic-prev .bin/voltaic}; do
            [ -x $bin ] && $bin bench --suite llm --device gpu --filter decode --no-peer 2>&1 | grep -E "^llm_decode" | sed "s/^/${bin#.bin\/} /" | tee -a "$OUT/rounds.txt"
        done
        for g in ${ROUND_VARIANTS:-}; do
            VOLTAIC_GEMV=$g .bin/voltaic bench --suite llm --device gpu --filter decode --no-peer 2>&1 | grep -E "^llm_decode" | sed "s/^/gemv=$g /" | tee -a "$OUT/rounds.txt"
        done
        for e in ${ROUND_ENVS:-}; do
            env "$e" .bin/voltaic bench --suite llm --device gpu --filter decode --no-peer 2>&1 | grep -E "^llm_decode" | sed "s/^/$e /" | tee -a "$OUT/rounds.txt"
        done
    done
    prompt="The history of the city goes back many centuries, to a small fishing village by the"
    if [ -x .bin/voltaic-prev ]; then
        VOLTAIC_PROFILE=pass .bin/voltaic-prev generate "$prompt" --device gpu -n 128 > "$OUT/pass_prev.txt" 2>&1
        echo "prev: $(grep -E 'one pass of' "$OUT/pass_prev.txt" | tail -100 | awk '{s += $1; n++} END {printf "%.1f us per realization over %d", s / n, n}')" | tee -a "$OUT/rounds.txt"
    fi
    VOLTAIC_PROFILE=pass .bin/voltaic generate "$prompt" --device gpu -n 128 > "$OUT/pass_new.txt" 2>&1
    echo "new: $(grep -E 'one pass of' "$OUT/pass_new.txt" | tail -100 | awk '{s += $1; n++} END {printf "%.1f us per realization over %d", s / n, n}')" | tee -a "$OUT/rounds.txt"
    for e in ${ROUND_ENVS:-}; do
        env "$e" VOLTAIC_PROFILE=pass .bin/voltaic generate "$prompt" --device gpu -n 128 > "$OUT/pass_$e.txt" 2>&1
        echo "$e: $(grep -E 'one pass of' "$OUT/pass_$e.txt" | tail -100 | awk '{s += $1; n++} END {printf "%.1f us per realization over %d", s / n, n}')" | tee -a "$OUT/rounds.txt"
    done
    VOLTAIC_PROFILE=1 .bin/voltaic generate "$prompt" --device gpu -n 70 > "$OUT/prof_new.txt" 2>&1
fi
if [[ "$what" == *wide* ]]; then
    # The output head's GEMV (49,152 outputs) under each shape of
    # VOLTAIC_GEMV_WIDE (threads a row, runs a trip), each kernel timed in a
    # pass of its own, with the argmax after it.
    for g in ${WIDE_SHAPES:-64,1 32,1 16,1 16,2 8,1 8,2 8,4 4,2}; do
        VOLTAIC_GEMV_WIDE=$g VOLTAIC_PROFILE=1 .bin/voltaic generate "Hi" --device gpu -n 8 > "$OUT/wide_$g.txt" 2>&1
        head=$(grep -E 'x49152 \(' "$OUT/wide_$g.txt" | awk '{s += $1; n++} END {printf "%.2f us over %d", s / n, n}')
        arg=$(grep -E 'argmax|reduce_partials' "$OUT/wide_$g.txt" | awk '{s += $1; n++} END {printf "%.2f us over %d", s / n, n}')
        echo "wide=$g: head $head; argmax kernels $arg" | tee -a "$OUT/wide.txt"
    done
    grep -E 'x49152 \(|argmax|reduce_partials' "$OUT/wide_64,1.txt" | head -4 | tee -a "$OUT/wide.txt"
fi
if [[ "$what" == *kernels* ]]; then
    # The mean time of the kernels matching PROFILE_MATCH (each in a pass of
    # its own) over a 64-token generation, under each of PROFILE_ENVS
    # ("VAR=value ...", "-" for none).
    prompt="The history of the city goes back many centuries, to a small fishing village by the"
    for e in ${PROFILE_ENVS:--}; do
        [ "$e" = - ] && e=VOLTAIC_NONE=1
        env "$e" VOLTAIC_PROFILE=1 .bin/voltaic generate "$prompt" --device gpu -n 64 > "$OUT/kernels.log" 2>&1
        echo "$e: $(grep -E "${PROFILE_MATCH:-attention}" "$OUT/kernels.log" | awk '{s += $1; n++} END {printf "%.2f us over %d", s / n, n}')" | tee -a "$OUT/kernels.txt"
    done
fi
if [[ "$what" == *submit* ]]; then
    # Batches submitted by a thread of their own (the default) or by the
    # thread that records them (VOLTAIC_SUBMIT_THREAD=0), alternated; the
    # greedy tokens must not change.
    for i in 1 2; do
        for v in 1 0; do
            VOLTAIC_SUBMIT_THREAD=$v .bin/voltaic bench --suite llm --device gpu --filter decode --no-peer 2>&1 | grep llm_decode | sed "s/^/thread=$v /" | tee -a "$OUT/submit.txt"
        done
    done
    for v in 1 0; do
        VOLTAIC_SUBMIT_THREAD=$v .bin/voltaic generate "The capital of France is" --device gpu -n 48 --json 2>/dev/null | tail -1 | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print('thread=$v', d['ids'])" | tee -a "$OUT/submit.txt"
    done
    for v in 1 0 1 0; do
        for f in train_mlp_b64 train_cnn_b256 encoder_f; do
            VOLTAIC_SUBMIT_THREAD=$v .bin/voltaic bench --suite train --device gpu --filter $f --no-peer 2>&1 | grep -E "^(train_|encoder)" | sed "s/^/thread=$v /" | tee -a "$OUT/submit.txt"
        done
    done
fi
