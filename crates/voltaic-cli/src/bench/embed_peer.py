# The PyTorch side of `voltaic bench --suite embed`: the same BERT forward
# (MiniLM weights read from the same safetensors file), mean pooling and L2
# normalisation, on the same device, timed like Voltaic. One JSON line per case.
import json, struct, sys, time
import numpy as np
import torch
import torch.nn.functional as F

cases = sys.argv[1].split(",")
runs = int(sys.argv[2])
device = sys.argv[3]
model_dir = sys.argv[4]
dev = torch.device("cuda" if device.startswith("gpu") else "cpu")
if dev.type == "cpu":
    torch.set_num_threads(int(sys.argv[5]))
torch.backends.cuda.matmul.allow_tf32 = False

raw = open(model_dir + "/model.safetensors", "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8 : 8 + n])
W = {}
for name, info in header.items():
    if name == "__metadata__" or info["dtype"] != "F32":
        continue
    a, b = info["data_offsets"]
    W[name] = torch.from_numpy(np.frombuffer(raw[8 + n + a : 8 + n + b], dtype=np.float32).reshape(info["shape"]).copy()).to(dev)
cfg = json.load(open(model_dir + "/config.json"))
H, NH, L, EPS = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg["layer_norm_eps"]


def forward(ids, mask):
    b, t = ids.shape
    x = W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:t] + W["embeddings.token_type_embeddings.weight"][0]
    x = F.layer_norm(x, (H,), W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], EPS)
    bias = (1.0 - mask[:, None, None, :]) * -1e9
    for l in range(L):
        p = f"encoder.layer.{l}."
        lin = lambda v, k: F.linear(v, W[p + k + ".weight"], W[p + k + ".bias"])
        q, k, v = (lin(x, f"attention.self.{m}").view(b, t, NH, H // NH).transpose(1, 2) for m in ("query", "key", "value"))
        s = torch.softmax(q @ k.transpose(-1, -2) / (H // NH) ** 0.5 + bias, -1)
        ctx = (s @ v).transpose(1, 2).reshape(b, t, H)
        x = F.layer_norm(x + lin(ctx, "attention.output.dense"), (H,), W[p + "attention.output.LayerNorm.weight"], W[p + "attention.output.LayerNorm.bias"], EPS)
        x = F.layer_norm(x + lin(F.gelu(lin(x, "intermediate.dense")), "output.dense"), (H,), W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"], EPS)
    m = mask[:, :, None]
    e = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return e / e.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


for c in cases:
    batch = int(c.split("_b")[1].split("_")[0])
    seq = int(c.split("_s")[1])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, seq), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    ids, mask = ids.to(dev), torch.ones(batch, seq, device=dev)
    with torch.no_grad():
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.5 or n < 3:
            forward(ids, mask)
            n += 1
        sync()
        per = (time.perf_counter() - t0) / n
        reps = max(1, min(200, int(0.3 / per)))
        ts = []
        for _ in range(max(runs, 1)):
            s = time.perf_counter()
            for _ in range(reps):
                forward(ids, mask)
            sync()
            ts.append((time.perf_counter() - s) * 1e3 / reps)
    ts.sort()
    print(json.dumps({"name": c, "ms": ts[len(ts) // 2]}), flush=True)

print(json.dumps({"peer": f"torch {torch.__version__} ({dev.type})"}), flush=True)
