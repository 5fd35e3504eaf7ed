# The PyTorch side of the `epoch_*` rows of `voltaic bench --suite train`:
# one epoch of Fashion-MNIST through the same model, optimizer (Adam, lr 1e-3,
# cosine schedule per step) and batch size, written two ways:
#   - the idiomatic DataLoader loop: a TensorDataset on the host, shuffled
#     batches copied to the device each step (pinned memory on CUDA), running
#     loss and accuracy read with .item() every step, as tutorials do;
#   - the GPU-resident loop an expert writes: the dataset moved to the device
#     once, each shuffled batch gathered there, per-step loss and accuracy
#     summed on the device and read once per 100 steps.
# Evaluation is excluded from both. One JSON line per case: "ms" is the
# DataLoader loop's median warm epoch, "resident_ms" the resident loop's,
# each after one warm-up epoch.
import gzip, json, os, sys, time
import numpy as np
import torch

cases = sys.argv[1].split(",")
runs = int(sys.argv[2])
device = sys.argv[3]
data_dir = sys.argv[5]
dev = torch.device("cuda" if device.startswith("gpu") else "cpu")
if dev.type == "cpu":
    torch.set_num_threads(int(sys.argv[4]))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
MEAN, STD = 0.2860, 0.3530


def idx(name):
    path = os.path.join(data_dir, name)
    raw = gzip.open(path + ".gz").read() if os.path.exists(path + ".gz") else open(path, "rb").read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


images = idx("train-images-idx3-ubyte")
labels = idx("train-labels-idx1-ubyte")
x_host = torch.from_numpy(((images.astype(np.float32) / 255.0 - MEAN) / STD)[:, None, :, :].copy())
y_host = torch.from_numpy(labels.astype(np.int64))
n = len(y_host)


def model(name):
    nn = torch.nn
    if name.startswith("epoch_mlp"):
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3136, 10))


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def setup(name, batch, epochs):
    torch.manual_seed(0)
    m = model(name).to(dev)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    steps = (n + batch - 1) // batch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * epochs)
    return m, opt, sched


def train_step(m, opt, sched, x, y):
    """One Adam step with the cosine schedule; the logits and the loss."""
    out = m(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return out, loss


def dataloader_epochs(name, batch, epochs):
    m, opt, sched = setup(name, batch, epochs)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_host, y_host), batch_size=batch, shuffle=True,
                                         pin_memory=dev.type == "cuda")
    times = []
    for _ in range(epochs):
        sync()
        t0 = time.perf_counter()
        running, correct, seen = 0.0, 0, 0
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            out, loss = train_step(m, opt, sched, x, y)
            running += loss.item() * len(y)
            correct += (out.argmax(1) == y).sum().item()
            seen += len(y)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        assert np.isfinite(running / seen) and correct > 0
    return times


def resident_epochs(name, batch, epochs):
    m, opt, sched = setup(name, batch, epochs)
    x_dev, y_dev = x_host.to(dev), y_host.to(dev)
    times = []
    for _ in range(epochs):
        sync()
        t0 = time.perf_counter()
        perm = torch.randperm(n, device=dev)
        loss_sum = torch.zeros((), device=dev)
        correct = torch.zeros((), dtype=torch.int64, device=dev)
        for step, i in enumerate(range(0, n, batch)):
            j = perm[i:i + batch]
            x, y = x_dev[j], y_dev[j]
            out, loss = train_step(m, opt, sched, x, y)
            loss_sum += loss.detach() * len(y)
            correct += (out.argmax(1) == y).sum()
            if (step + 1) % 100 == 0:
                loss_sum.item()
        seen_loss = loss_sum.item() / n
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        assert np.isfinite(seen_loss) and correct.item() > 0
    return times


for c in cases:
    batch = int(c.rsplit("_b", 1)[1])
    epochs = 1 + max(runs, 1)
    # The first epoch warms caches (cuDNN autotuning, allocator); the rest are timed.
    dl = sorted(dataloader_epochs(c, batch, epochs)[1:])
    res = sorted(resident_epochs(c, batch, epochs)[1:])
    print(json.dumps({"name": c, "ms": dl[len(dl) // 2], "resident_ms": res[len(res) // 2]}), flush=True)

print(json.dumps({"peer": f"torch {torch.__version__} ({dev.type})"}), flush=True)
