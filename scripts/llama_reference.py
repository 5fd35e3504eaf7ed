#!/usr/bin/env python3
"""Reference for Voltaic's LLaMA decoder: a float64 numpy forward pass over
the dequantized weights of a GGUF file (the PyPI `gguf` package reads and
dequantizes them), written from the architecture's definition, independent
of Voltaic's code.

For each prompt it records the prompt's token ids (BPE from the file's own
vocabulary and merges through the Python `tokenizers` package), the logits
of the first generated step, and the greedy continuation with, at every
step, the gap between the two largest logits (to recognise near-ties).

    python3 scripts/llama_reference.py MODEL.gguf OUT_DIR

writes OUT_DIR/llama_reference.json and OUT_DIR/llama_logits.f32 (the
first-step logits of every prompt, little-endian f32, prompt after prompt).
"""
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

NEW_TOKENS = 16

PROMPTS = [
    ("plain", "The capital of France is", False),
    ("story", "Once upon a time, in a small village by the sea,", False),
    ("code", "def fibonacci(n):\n    ", False),
    ("rust", "fn main() {\n    let v: Vec<i32> =", False),
    ("chat", "What is the boiling point of water at sea level?", True),
    ("chat_list", "Give me three tips for learning a new language.", True),
    ("german", "Die Hauptstadt von Deutschland ist", False),
    ("french", "Le chat est assis sur", False),
    ("digits", "1, 2, 3, 4, 5, 6,", False),
    ("math", "12 + 35 = 47. 20 + 22 =", False),
    ("json", '{"name": "Alice", "age":', False),
]


def field(r, key):
    f = r.fields[key]
    t = f.types
    if t[0].name == "ARRAY":
        if t[-1].name == "STRING":
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if t[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def tokenizer(r):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokens = field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    types = field(r, "tokenizer.ggml.token_type")
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    return tok


def chat(r, text):
    # The file's template for one user message (rendered by hand here; the
    # Rust side renders the Jinja template itself).
    tpl = field(r, "tokenizer.chat_template")
    assert "<|im_start|>" in tpl, "the reference knows SmolLM2's ChatML template only"
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


class Model:
    def __init__(self, r):
        a = field(r, "general.architecture")
        g = lambda k: field(r, f"{a}.{k}")
        self.layers = g("block_count")
        self.heads = g("attention.head_count")
        self.kv_heads = g("attention.head_count_kv")
        self.hidden = g("embedding_length")
        self.head_dim = self.hidden // self.heads
        self.base = float(g("rope.freq_base"))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.w = {}
        for t in r.tensors:
            shape = [int(d) for d in reversed(t.shape)]
            self.w[t.name] = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        # x [t, heads, d]; llama.cpp's layout: pairs (2i, 2i + 1) rotate.
        d = x.shape[-1]
        theta = self.base ** (-np.arange(0, d, 2) / d)
        ang = pos[:, None] * theta[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def forward(self, ids, cache):
        t, p0 = len(ids), cache["len"]
        pos = np.arange(p0, p0 + t, dtype=np.float64)
        x = self.w["token_embd.weight"][ids]
        g = self.heads // self.kv_heads
        for l in range(self.layers):
            w = lambda n: self.w[f"blk.{l}.{n}"]
            h = self.norm(x, w("attn_norm.weight"))
            q = self.rope((h @ w("attn_q.weight").T).reshape(t, self.heads, self.head_dim), pos)
            k = self.rope((h @ w("attn_k.weight").T).reshape(t, self.kv_heads, self.head_dim), pos)
            v = (h @ w("attn_v.weight").T).reshape(t, self.kv_heads, self.head_dim)
            cache["k"][l] = np.concatenate([cache["k"][l], k]) if p0 else k
            cache["v"][l] = np.concatenate([cache["v"][l], v]) if p0 else v
            K, V = cache["k"][l], cache["v"][l]
            out = np.empty((t, self.heads, self.head_dim))
            for hd in range(self.heads):
                kv = hd // g
                sc = q[:, hd] @ K[:, kv].T / np.sqrt(self.head_dim)
                sc = np.where(np.arange(p0 + t)[None, :] <= pos[:, None], sc, -np.inf)
                sc = np.exp(sc - sc.max(-1, keepdims=True))
                out[:, hd] = (sc / sc.sum(-1, keepdims=True)) @ V[:, kv]
            x = x + out.reshape(t, -1) @ w("attn_output.weight").T
            h = self.norm(x, w("ffn_norm.weight"))
            gate = h @ w("ffn_gate.weight").T
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ w("ffn_up.weight").T)) @ w("ffn_down.weight").T
        cache["len"] = p0 + t
        return self.norm(x[-1], self.w["output_norm.weight"]) @ self.out.T


def main():
    path, out_dir = sys.argv[1], sys.argv[2]
    r = GGUFReader(path)
    tok = tokenizer(r)
    m = Model(r)
    eos = field(r, "tokenizer.ggml.eos_token_id")
    cases, logits_all = [], []
    for name, text, is_chat in PROMPTS:
        prompt = chat(r, text) if is_chat else text
        ids = tok.encode(prompt, add_special_tokens=False).ids
        cache = {"len": 0, "k": [None] * m.layers, "v": [None] * m.layers}
        logits = m.forward(np.array(ids), cache)
        logits_all.append(logits.astype(np.float32))
        gen, gaps = [], []
        for _ in range(NEW_TOKENS):
            top = np.argsort(logits)[::-1][:2]
            gaps.append(float(logits[top[0]] - logits[top[1]]))
            gen.append(int(top[0]))
            if top[0] == eos:
                break
            logits = m.forward(np.array([top[0]]), cache)
        cases.append({"name": name, "text": text, "chat": is_chat, "prompt": prompt, "ids": ids, "greedy": gen,
                      "top2_gaps": gaps, "greedy_text": tok.decode(gen)})
        print(f"{name}: {len(ids)} prompt tokens -> {tok.decode(gen)!r}", file=sys.stderr)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "llama_reference.json"), "w") as f:
        json.dump({"model": os.path.basename(path), "new_tokens": NEW_TOKENS, "vocab": len(logits_all[0]), "cases": cases}, f, indent=1, ensure_ascii=False)
    np.concatenate(logits_all).astype("<f4").tofile(os.path.join(out_dir, "llama_logits.f32"))


if __name__ == "__main__":
    main()
