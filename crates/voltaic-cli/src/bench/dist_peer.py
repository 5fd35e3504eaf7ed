# PyTorch side of `voltaic bench --suite dist`: 256 MB host<->device copies
# from and to pinned memory, median ms over `runs`, as JSON {name: ms}.
import json, sys, time
import torch

runs = int(sys.argv[1])
n = (256 << 20) // 4
host = torch.arange(n, dtype=torch.float32).pin_memory()
dev = torch.empty(n, dtype=torch.float32, device="cuda")
back = torch.empty(n, dtype=torch.float32).pin_memory()

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

out = {
    "stage_h2d_256mb": median_ms(lambda: dev.copy_(host, non_blocking=True)),
    "stage_d2h_256mb": median_ms(lambda: back.copy_(dev, non_blocking=True)),
    "torch": torch.__version__,
}
print(json.dumps(out))
