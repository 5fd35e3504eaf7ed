# The PyTorch side of `voltaic bench --suite train`: the same models, the same
# batch, Adam steps timed the same way (warm-up, then the median over runs of
# several steps, each run ended by a full synchronize). One JSON line per case.
import json, sys, time
import torch

cases = sys.argv[1].split(",")
runs = int(sys.argv[2])
device = sys.argv[3]
dev = torch.device("cuda" if device.startswith("gpu") else "cpu")
if dev.type == "cpu":
    torch.set_num_threads(int(sys.argv[4]))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def model(name):
    nn = torch.nn
    if name.startswith("train_mlp"):
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3136, 10))


for c in cases:
    batch = int(c.rsplit("_b", 1)[1])
    m = model(c).to(dev)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    x = torch.randn(batch, 1, 28, 28, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)

    def step():
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5 or n < 3:
        step()
        n += 1
    sync()
    per = (time.perf_counter() - t0) / n
    reps = max(1, min(200, int(0.3 / per)))
    ts = []
    for _ in range(max(runs, 1)):
        s = time.perf_counter()
        for _ in range(reps):
            step()
        sync()
        ts.append((time.perf_counter() - s) * 1e3 / reps)
    ts.sort()
    print(json.dumps({"name": c, "ms": ts[len(ts) // 2]}), flush=True)

print(json.dumps({"peer": f"torch {torch.__version__} ({dev.type})"}), flush=True)
