# The PyTorch side of `voltaic bench --suite llm` on a GPU: a plain forward of
# the same LLaMA architecture over the same GGUF file's weights, dequantized
# by the `gguf` package and kept in f16, with a KV cache. Eager (the cache is
# sliced to the filled length) and, for decode, torch.compile with
# mode="reduce-overhead" over a static cache (marked with
# torch._dynamo.mark_static_address, as transformers' StaticCache does, so
# that CUDA graphs engage). Every generated token id is read back to the
# host, as a streaming generation loop does: before the next step
# ("eager_ms", "compiled_ms"), and, compiled, also two steps behind with the
# id fed to the next step on the device and copied out asynchronously
# ("pipelined_ms", as Voltaic's generate loop does). One JSON line per
# case: "ms" is the row's peer time (the faster compiled decode, eager
# prefill).
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.quants import dequantize

cases = sys.argv[1].split(",")
runs = int(sys.argv[2])
path = sys.argv[3]
ids = [int(x) for x in sys.argv[4].split(",")]
decode_prompt = int(sys.argv[5])
decode_tokens = int(sys.argv[6])
dev = torch.device("cuda")
DT = torch.float16


def field(r, key):
    f = r.fields[key]
    if f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


r = GGUFReader(path)
A = field(r, "general.architecture")
L, H, NH, KVH = (field(r, f"{A}.{k}") for k in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv"))
D = H // NH
BASE = float(field(r, f"{A}.rope.freq_base"))
EPS = float(field(r, f"{A}.attention.layer_norm_rms_epsilon"))
W = {}
for t in r.tensors:
    shape = [int(d) for d in reversed(t.shape)]
    W[t.name] = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)).to(dev, DT)
OUT = W.get("output.weight", W["token_embd.weight"])
blocks = [{n: W[f"blk.{l}.{n}.weight"] for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")} for l in range(L)]
MAX = len(ids) + decode_tokens + 16
ang = torch.arange(MAX, dtype=torch.float64)[:, None] * BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)[None, :]
COS, SIN = ang.cos().to(dev, torch.float32), ang.sin().to(dev, torch.float32)


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(DT) * w


def rope(x, pos):
    # x [t, heads, D]; llama.cpp's layout: adjacent pairs (2i, 2i + 1) rotate.
    c, s = COS[pos][:, None, :], SIN[pos][:, None, :]
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2).to(DT)


def forward(tok, pos, kc, vc, static):
    # tok, pos: [t] on the device; kc, vc: [L, KVH, MAX, D]. With `static`,
    # attention runs over the whole cache under a mask (shapes never change).
    t = tok.shape[0]
    x = W["token_embd.weight"][tok]
    for l, b in enumerate(blocks):
        h = rms(x, b["attn_norm"])
        q = rope((h @ b["attn_q"].T).view(t, NH, D), pos).transpose(0, 1)
        k = rope((h @ b["attn_k"].T).view(t, KVH, D), pos).transpose(0, 1)
        v = (h @ b["attn_v"].T).view(t, KVH, D).transpose(0, 1)
        kc[l].index_copy_(1, pos, k)
        vc[l].index_copy_(1, pos, v)
        if static:
            K, V = kc[l], vc[l]
            mask = torch.arange(MAX, device=dev)[None, :] <= pos[:, None]
        else:
            n = int(pos[-1]) + 1
            K, V = kc[l][:, :n], vc[l][:, :n]
            mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]
        a = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)
        x = x + a.transpose(0, 1).reshape(t, H) @ b["attn_output"].T
        h = rms(x, b["ffn_norm"])
        x = x + (F.silu(h @ b["ffn_gate"].T) * (h @ b["ffn_up"].T)) @ b["ffn_down"].T
    return rms(x[-1:], W["output_norm.weight"]) @ OUT.T


def new_cache():
    return torch.zeros(L, KVH, MAX, D, device=dev, dtype=DT), torch.zeros(L, KVH, MAX, D, device=dev, dtype=DT)


def greedy(logits):
    return logits[0].argmax()


def prefill(kc, vc):
    tok = torch.tensor(ids, device=dev)
    return int(greedy(forward(tok, torch.arange(len(ids), device=dev), kc, vc, False)))


def decode(step, kc, vc):
    # The prompt eagerly, then the timed greedy steps; returns (ms, tokens).
    n = decode_prompt
    tok = greedy(forward(torch.tensor(ids[:n], device=dev), torch.arange(n, device=dev), kc, vc, False)).view(1)
    out = []
    torch.cuda.synchronize()
    s = time.perf_counter()
    for p in range(n, n + decode_tokens):
        tok = greedy(step(tok, torch.tensor([p], device=dev), kc, vc)).view(1)
        out.append(int(tok))
    return (time.perf_counter() - s) * 1e3, out


def decode_pipelined(step, kc, vc):
    # As decode, but steps p + 1 and p + 2 are queued before token p is
    # read (Voltaic's generate loop keeps two steps ahead too): the id stays
    # on the device for the next step and is copied to pinned host memory
    # behind it (CUDA graphs reuse their output buffers: clone).
    n = decode_prompt
    tok = greedy(forward(torch.tensor(ids[:n], device=dev), torch.arange(n, device=dev), kc, vc, False)).view(1)
    host = torch.empty(decode_tokens, dtype=torch.int64, pin_memory=True)
    out, pending = [], []
    torch.cuda.synchronize()
    s = time.perf_counter()
    for i, p in enumerate(range(n, n + decode_tokens)):
        tok = greedy(step(tok, torch.tensor([p], device=dev), kc, vc)).view(1).clone()
        host[i : i + 1].copy_(tok, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        pending.append((done, i))
        if len(pending) > 2:
            done_i, j = pending.pop(0)
            done_i.synchronize()
            out.append(int(host[j]))
    for done_i, j in pending:
        done_i.synchronize()
        out.append(int(host[j]))
    return (time.perf_counter() - s) * 1e3, out


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


eager_step = lambda tok, pos, kc, vc: forward(tok, pos, kc, vc, False)
compiled_step = torch.compile(lambda tok, pos, kc, vc: forward(tok, pos, kc, vc, True), mode="reduce-overhead", fullgraph=True)
with torch.no_grad():
    for c in cases:
        row = {"name": c}
        if c == "llm_prefill_128":
            kc, vc = new_cache()
            for _ in range(3):
                prefill(kc, vc)
            ts = []
            for _ in range(max(runs, 1)):
                torch.cuda.synchronize()
                s = time.perf_counter()
                prefill(kc, vc)
                ts.append((time.perf_counter() - s) * 1e3)
            row["eager_ms"] = row["ms"] = median(ts)
        elif c == "llm_decode_b1":
            for key, step, loop in (("eager_ms", eager_step, decode), ("compiled_ms", compiled_step, decode), ("pipelined_ms", compiled_step, decode_pipelined)):
                kc, vc = new_cache()
                if step is compiled_step:
                    torch._dynamo.mark_static_address(kc)
                    torch._dynamo.mark_static_address(vc)
                loop(step, kc, vc)  # warm-up: compiles and records the graphs
                times, tokens = [], None
                for _ in range(max(runs, 1)):
                    kc.zero_(), vc.zero_()
                    ms, out = loop(step, kc, vc)
                    times.append(ms)
                    tokens = tokens or out
                row[key] = median(times)
                row[key.replace("_ms", "_tokens")] = tokens[:8]
            row["ms"] = min(row["compiled_ms"], row["pipelined_ms"])
        else:
            raise SystemExit(f"unknown case {c}")
        print(json.dumps(row), flush=True)

print(json.dumps({"peer": f"torch {torch.__version__} (cuda, f16 weights)", "gpu": torch.cuda.get_device_name()}), flush=True)
