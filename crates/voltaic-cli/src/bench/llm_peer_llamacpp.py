# The llama.cpp side of `voltaic bench --suite llm` on the CPU, through the
# PyPI package llama-cpp-python (built from source, so that ggml uses this
# CPU's instructions): the same GGUF file, the same token ids, the same
# thread count. Prefill evaluates the 128-token prompt in one batch; decode
# evaluates the short prompt, then generates greedily one token at a time,
# reading each token's logits back (as llama.cpp's own loop does). One JSON
# line per case with the median ms of the row's work.
import json
import sys
import time

import numpy as np
import llama_cpp

cases = sys.argv[1].split(",")
runs = int(sys.argv[2])
path = sys.argv[3]
ids = [int(x) for x in sys.argv[4].split(",")]
decode_prompt = int(sys.argv[5])
decode_tokens = int(sys.argv[6])
threads = int(sys.argv[7])

llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)


def last_argmax():
    # The last evaluated token's logits, straight from the context (Llama.eval
    # keeps them in `scores` only with logits_all, which would copy every row).
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def prefill():
    llm.reset()
    s = time.perf_counter()
    llm.eval(ids)
    tok = last_argmax()
    return (time.perf_counter() - s) * 1e3, [tok]


def decode():
    llm.reset()
    llm.eval(ids[:decode_prompt])
    tok, out = last_argmax(), []
    s = time.perf_counter()
    for _ in range(decode_tokens):
        llm.eval([tok])
        tok = last_argmax()
        out.append(tok)
    return (time.perf_counter() - s) * 1e3, out


for c in cases:
    f = {"llm_prefill_128": prefill, "llm_decode_b1": decode}[c]
    f()  # warm-up
    times, tokens = [], None
    for _ in range(max(runs, 1)):
        ms, out = f()
        times.append(ms)
        tokens = tokens or out
    times.sort()
    print(json.dumps({"name": c, "ms": times[len(times) // 2], "tokens": tokens[:8]}), flush=True)

print(json.dumps({"peer": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {threads} threads)"}), flush=True)
