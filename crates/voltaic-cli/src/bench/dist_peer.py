# PyTorch side of `voltaic bench --suite dist`: 32 and 256 MB host<->device copies
# from and to pinned memory, median ms over `runs`, as JSON {name: ms}.
import json, sys, time
import torch

runs = int(sys.argv[1])

def median_ms(f):
    for _ in range(2):
        f()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]

out = {"torch": torch.__version__}
for mb in [32, 256]:
    n = (mb << 20) // 4
    host = torch.arange(n, dtype=torch.float32).pin_memory()
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    back = torch.empty(n, dtype=torch.float32).pin_memory()
    out[f"stage_h2d_{mb}mb"] = median_ms(lambda: dev.copy_(host, non_blocking=True))
    out[f"stage_d2h_{mb}mb"] = median_ms(lambda: back.copy_(dev, non_blocking=True))
print(json.dumps(out))
