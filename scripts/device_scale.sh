#!/usr/bin/env bash
# Scaling over the GPUs of a multi-GPU machine (issue 21), everything under
# $OUT. Pack as scripts/device_dist.sh says (a voltaic built with
# --features mpi, Open MPI's Debian packages in .mpi/, Fashion-MNIST), then
# call with carry [".gl", ".bin", ".mpi"] on a kind with several GPUs:
#   bash scripts/device_scale.sh [bench,epochs]
set -uo pipefail
source .gl/env.sh
export RUST_BACKTRACE=1 VOLTAIC_FASHION_MNIST=$PWD/.bin/data
# NVLink multicast stays off on shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for f in .bin/*.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x .bin/voltaic
source scripts/device_mpi_env.sh
export VOLTAIC_MPIRUN="$MPIRUN_BASE"
what="${1:-bench,epochs}"
V=.bin/voltaic
$V devices > "$OUT/devices.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv > "$OUT/nvidia.txt" 2>&1
nvidia-smi topo -m >> "$OUT/nvidia.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())" >> "$OUT/nvidia.txt" 2>&1
nproc >> "$OUT/nvidia.txt"
G=$(nvidia-smi -L | wc -l)
if [[ "$what" == *bench* ]]; then
    # The encoder and the CNN on 1, 2, 4, 8 GPUs: device group, MPI ranks, PyTorch DDP.
    $V bench --suite scale --json --runs 5 --plot "$OUT/scale.png" > "$OUT/scale.jsonl" 2> "$OUT/scale.err"
    cat "$OUT/scale.jsonl"; tail -n 5 "$OUT/scale.err"
fi
if [[ "$what" == *overlap* ]]; then
    # Same binary, no peer, alternating: each step's gradient sums off the
    # replica's thread (1) or on it, before backward returns (0); the MPI
    # ranks are told too.
    for o in 0 1 0; do
        VOLTAIC_DDP_OVERLAP=$o VOLTAIC_MPIRUN="$MPIRUN_BASE -x VOLTAIC_DDP_OVERLAP" $V bench --suite scale --no-peer --json --runs 5 >> "$OUT/scale_overlap$o.jsonl" 2>> "$OUT/scale.err"
    done
    cut -c1-200 "$OUT"/scale_overlap*.jsonl
fi
if [[ "$what" == *rows* ]]; then
    # Same binary, no peer, alternating: a word embedding's gradient
    # exchanged as the rows its batch touched (1) or summed whole (0); the
    # MPI ranks are told too.
    for o in 0 1 0 1; do
        VOLTAIC_DDP_ROWS=$o VOLTAIC_MPIRUN="$MPIRUN_BASE -x VOLTAIC_DDP_ROWS" $V bench --suite scale --filter encoder --no-peer --json --runs 5 >> "$OUT/scale_rows$o.jsonl" 2>> "$OUT/scale.err"
    done
    cut -c1-200 "$OUT"/scale_rows*.jsonl
fi
if [[ "$what" == *parts* ]]; then
    # Same binary, no peer, alternating: a batch held back behind a
    # gradient upload finished in parts while it waits (1) or whole when
    # the upload arrives (0); the MPI ranks are told too.
    for o in 0 1 0 1; do
        VOLTAIC_GATED_PARTS=$o VOLTAIC_MPIRUN="$MPIRUN_BASE -x VOLTAIC_GATED_PARTS" $V bench --suite scale --no-peer --json --runs 5 >> "$OUT/scale_parts$o.jsonl" 2>> "$OUT/scale.err"
    done
    cut -c1-200 "$OUT"/scale_parts*.jsonl
fi
if [[ "$what" == *repeat* ]]; then
    # The encoder's rows three more times, no peer: one-GPU and data-parallel
    # steps drift between runs on these hosts, and efficiency divides by
    # the one-GPU row of the same run.
    for i in 1 2 3; do
        $V bench --suite scale --filter encoder --no-peer --json --runs 5 >> "$OUT/scale_repeat.jsonl" 2>> "$OUT/scale.err"
    done
    cut -c1-200 "$OUT/scale_repeat.jsonl"
fi
if [[ "$what" == *spin* ]]; then
    # The encoder's rows again with reads that sleep in the driver at once
    # instead of polling for 2 ms: do the replicas' polls slow each other?
    VOLTAIC_SPIN_WAIT_US=0 $V bench --suite scale --filter encoder --no-peer --json --runs 5 > "$OUT/scale_nospin.jsonl" 2>> "$OUT/scale.err"
    cut -c1-400 "$OUT/scale_nospin.jsonl"
fi
if [[ "$what" == *stage* ]]; then
    $V bench --suite dist --filter stage --json --runs 7 > "$OUT/stage.jsonl" 2>> "$OUT/scale.err"
    cut -c1-300 "$OUT/stage.jsonl"
fi
if [[ "$what" == *profile* ]]; then
    # Host phases and per-realization lines of the encoder's data-parallel
    # step (examples/ddp_profile.rs, packed as .bin/ddp_profile).
    chmod +x .bin/ddp_profile
    list=$(seq -s, -f "gpu:%g" 0 $((G - 1)))
    VOLTAIC_PROFILE=1 .bin/ddp_profile $list minilm > "$OUT/ddp_profile.txt" 2> "$OUT/ddp_profile.err"
    cat "$OUT/ddp_profile.txt"
fi
if [[ "$what" == *amp* ]]; then
    # Issue 19's rows on gpu:0, PyTorch in the same call.
    $V bench --suite gpu --filter matmul_bf16 --json > "$OUT/amp.jsonl" 2> "$OUT/amp.err"
    $V bench --suite train --filter encoder --json >> "$OUT/amp.jsonl" 2>> "$OUT/amp.err"
    cut -c1-420 "$OUT/amp.jsonl"
fi
if [[ "$what" == *epochs* ]]; then
    # Whole epochs of `voltaic train` at 256 images per GPU (the data through
    # the host loader everywhere, as the parallel paths take it).
    common="train --model cnn --epochs 2 --quiet --json"
    $V $common --batch-size 256 --device gpu:0 --data-on-device no --out /tmp/e1 >> "$OUT/epochs.jsonl" 2>> "$OUT/epochs.err"
    for n in 2 4 8; do
        [ $n -le $G ] || continue
        list=$(seq -s, -f "gpu:%g" 0 $((n - 1)))
        $V $common --batch-size $((256 * n)) --devices $list --out /tmp/e$n >> "$OUT/epochs.jsonl" 2>> "$OUT/epochs.err"
        $MPIRUN_BASE -np $n $V $common --batch-size $((256 * n)) --distributed --device gpu --out /tmp/m$n >> "$OUT/epochs.jsonl" 2>> "$OUT/epochs.err"
    done
    cat "$OUT/epochs.jsonl" | cut -c1-400
fi
if [[ "$what" == *mca* ]]; then
    # Open MPI's all-reduce of the encoder's 90 MB between 2 and 4 ranks
    # under a few shared-memory settings.
    for n in 2 4; do
        for mca in "" "--mca btl_vader_single_copy_mechanism cma" "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4"; do
            echo "np $n mca [$mca]" >> "$OUT/mca.txt"
            $MPIRUN_BASE -np $n $mca $V bench --suite dist --filter allreduce --json --runs 5 >> "$OUT/mca.txt" 2>&1
        done
    done
    cat "$OUT/mca.txt" | cut -c1-300
fi
(cd "$OUT" && tar czf /tmp/voltaic-out.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/voltaic-out.tgz "$OUT/all.tgz")
