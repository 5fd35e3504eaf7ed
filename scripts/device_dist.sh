#!/usr/bin/env bash
# Data-parallel training (issue 20) on the lent GPU, everything under $OUT.
# Pack here first (a voltaic built with --features mpi, Open MPI's Debian
# packages, Fashion-MNIST):
#   cargo build --release -p voltaic-cli --features mpi
#   strip -o .bin/voltaic target/release/voltaic && gzip -f .bin/voltaic
#   cp /usr/share/datasets/fashion-mnist/*.gz .bin/data/
#   (cd .mpi && apt-get download openmpi-bin openmpi-common libopenmpi3 libhwloc15 \
#      libevent-core-2.1-7 libevent-pthreads-2.1-7 libpmix2 libnuma1 libltdl7)
# then call with carry [".gl", ".bin", ".mpi"]: bash scripts/device_dist.sh [cnn,bench]
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 VOLTAIC_FASHION_MNIST=$PWD/.bin/data
for f in .bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x .bin/voltaic
source scripts/device_mpi_env.sh
MPIRUN="$MPIRUN_BASE -np 2"
what="${1:-cnn,bench}"
V=.bin/voltaic
$V devices > "$OUT/devices.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia.txt" 2>&1
python3 -c "import torch; print(torch.__version__)" >> "$OUT/nvidia.txt" 2>&1

if [[ "$what" == *cnn* ]]; then
# (a) The CNN: 50 steps of batch 256 on one device, on two devices of the
# adapter, and on two MPI ranks sharing it; per-step losses compared.
common="train --model cnn --epochs 1 --limit 12800 --batch-size 256 --quiet --json"
$V $common --device gpu:0 --data-on-device no --out /tmp/c1 --loss-log "$OUT/cnn_one.csv" > "$OUT/cnn.jsonl" 2> "$OUT/cnn.err"
$V $common --devices gpu:0,gpu:0 --out /tmp/c2 --loss-log "$OUT/cnn_group2.csv" >> "$OUT/cnn.jsonl" 2>> "$OUT/cnn.err"
$MPIRUN $V $common --distributed --device gpu --out /tmp/c3 --loss-log "$OUT/cnn_mpi2.csv" >> "$OUT/cnn.jsonl" 2>> "$OUT/cnn.err"
python3 - "$OUT" > "$OUT/cnn_compare.txt" 2>&1 <<'PY'
import sys, csv
out = sys.argv[1]
read = lambda n: [float(r["loss"]) for r in csv.DictReader(open(f"{out}/{n}.csv"))]
one = read("cnn_one")
for n in ["cnn_group2", "cnn_mpi2"]:
    try:
        got = read(n)
    except Exception as e:
        print(n, "missing", e); continue
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, one))
    print(f"{n}: {len(got)} steps (one device: {len(one)}), max relative difference {rel:.2e}, loss {one[0]:.4f} -> {one[-1]:.4f}")
PY
cat "$OUT/cnn_compare.txt"
# Whole epochs at a fixed per-device batch of 256: one device, then two.
$V train --model cnn --epochs 2 --batch-size 256 --quiet --json --device gpu:0 --out /tmp/e1 >> "$OUT/cnn_epochs.jsonl" 2>> "$OUT/cnn.err"
$V train --model cnn --epochs 2 --batch-size 512 --quiet --json --devices gpu:0,gpu:0 --out /tmp/e2 >> "$OUT/cnn_epochs.jsonl" 2>> "$OUT/cnn.err"
$MPIRUN $V train --model cnn --epochs 2 --batch-size 512 --quiet --json --distributed --device gpu --out /tmp/e3 >> "$OUT/cnn_epochs.jsonl" 2>> "$OUT/cnn.err"
cat "$OUT/cnn_epochs.jsonl"
fi

if [[ "$what" == *bench* ]]; then
# (a, b) The encoder, staging and the all-reduce.
$V bench --suite dist --json --runs 7 > "$OUT/dist.jsonl" 2> "$OUT/dist.err"
$MPIRUN $V bench --suite dist --json --runs 7 >> "$OUT/dist.jsonl" 2>> "$OUT/dist.err"
cat "$OUT/dist.jsonl"
tail -n 5 "$OUT/dist.err"
fi
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
