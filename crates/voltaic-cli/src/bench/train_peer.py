# The PyTorch side of `voltaic bench --suite train`: the same models, the same
# batch, Adam steps timed the same way (warm-up, then the median over runs of
# several steps, each run ended by a full synchronize). One JSON line per case.
import json, sys, time
import torch

# The models are also imported by the scaling suite's DDP peer (scale_peer.py).
dev = torch.device("cpu")


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def model(name):
    nn = torch.nn
    if name.startswith("train_mlp"):
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3136, 10))


class Encoder(torch.nn.Module):
    """MiniLM-sized post-LN encoder (BERT's layout) with a classifier on the first token."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.word, self.pos, self.typ = nn.Embedding(30522, 384), nn.Embedding(512, 384), nn.Embedding(2, 384)
        self.norm = nn.LayerNorm(384, eps=1e-12)
        layer = nn.TransformerEncoderLayer(384, 12, 1536, dropout=0.0, activation="gelu", batch_first=True, layer_norm_eps=1e-12)
        self.enc = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        self.head = nn.Linear(384, 10)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.norm(self.word(ids) + self.pos.weight[:t] + self.typ.weight[0])
        return self.head(self.enc(x)[:, 0])


def step_fn(c):
    """The case's training step: Adam on the Fashion-MNIST models, or AdamW
    on the encoder in f32 or under torch.autocast (f16 with a GradScaler)."""
    if c.startswith("encoder_"):
        low = {"f16": torch.float16, "bf16": torch.bfloat16}.get(c.split("_", 1)[1])
        m = Encoder().to(dev)
        opt = torch.optim.AdamW(m.parameters(), 1e-4)
        x = torch.randint(0, 30522, (32, 128), device=dev)
        y = torch.arange(32, device=dev) % 10
        scaler = torch.amp.GradScaler(dev.type) if low == torch.float16 else None

        def step():
            with torch.autocast(dev.type, dtype=low or torch.float32, enabled=low is not None):
                loss = torch.nn.functional.cross_entropy(m(x), y)
            opt.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        return step
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
    return step


if __name__ == "__main__":
    cases = sys.argv[1].split(",")
    runs = int(sys.argv[2])
    device = sys.argv[3]
    dev = torch.device("cuda" if device.startswith("gpu") else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(int(sys.argv[4]))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)

    for c in cases:
        step = step_fn(c)

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
