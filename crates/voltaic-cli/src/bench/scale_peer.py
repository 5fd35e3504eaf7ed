# The PyTorch side of `voltaic bench --suite scale`: the train suite's models
# (train_peer.py, beside this file) on every GPU of a `torch.distributed.run`
# job, one process per GPU, DistributedDataParallel over NCCL with its
# default buckets; on one GPU, plain PyTorch. A fixed batch per GPU (32 x 128
# tokens for the encoder, 256 images for the CNN); rank 0 prints the median
# ms per step as {"name": "scale_M_gN", "ms": ...}, one line per model.
import json, os, sys, time
import torch
import torch.distributed as dist
import train_peer

models = sys.argv[1].split(",")
runs = int(sys.argv[2])
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
train_peer.dev = dev
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
if world > 1:
    dist.init_process_group("nccl", device_id=dev)


def step_fn(name):
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    if name == "encoder":
        m = train_peer.Encoder().to(dev)
        opt = torch.optim.AdamW(m.parameters(), 1e-4)
        g = torch.Generator(device=dev).manual_seed(1 + rank)
        x = torch.randint(0, 30522, (32, 128), device=dev, generator=g)
        y = torch.arange(32, device=dev) % 10
    else:
        m = train_peer.model("train_cnn").to(dev)
        opt = torch.optim.Adam(m.parameters(), 1e-3)
        g = torch.Generator(device=dev).manual_seed(1 + rank)
        x = torch.randn(256, 1, 28, 28, device=dev, generator=g)
        y = torch.arange(256, device=dev) % 10
    if world > 1:
        m = torch.nn.parallel.DistributedDataParallel(m, device_ids=[local])

    def step():
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


for name in models:
    step = step_fn(name)
    for _ in range(5 if name == "encoder" else 30):
        step()
    torch.cuda.synchronize()
    reps = 5 if name == "encoder" else 50
    ts = []
    for _ in range(max(runs, 1)):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - s) * 1e3 / reps)
    ts.sort()
    if rank == 0:
        print(json.dumps({"name": f"scale_{name}_g{world}", "ms": ts[len(ts) // 2]}), flush=True)

if rank == 0:
    print(json.dumps({"peer": f"torch {torch.__version__} DDP (NCCL) on {world} GPU(s)"}), flush=True)
if world > 1:
    dist.destroy_process_group()
