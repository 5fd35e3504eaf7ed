# The numpy side of `voltaic bench --suite cpu`: same workloads, timed the same
# way (median of N runs after warm-up), one JSON line per case on stdout.
import json, sys, time
import numpy as np

cases = sys.argv[1].split(",")
runs = int(sys.argv[2])
rng = np.random.default_rng(0)


def median_ms(f, warmup=2):
    for _ in range(warmup):
        f()
    ts = []
    for _ in range(max(runs, 1)):
        s = time.perf_counter()
        f()
        ts.append((time.perf_counter() - s) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def chain10(x, y):
    t = x * 2.0
    t = t + 1.0
    t = np.maximum(t, 0.0)
    t = t - y
    t = np.abs(t)
    t = np.sqrt(t)
    t = t * y
    t = t + 3.0
    t = t * 0.5
    t = t - y
    return t


def softmax(x):
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def conv2d(x, w):
    # im2col through a strided window view, then one BLAS product.
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # N C H W 3 3
    return np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)


for c in cases:
    if c == "matmul_f32_1024":
        a = rng.standard_normal((1024, 1024), dtype=np.float32)
        b = rng.standard_normal((1024, 1024), dtype=np.float32)
        ms = median_ms(lambda: a @ b)
    elif c == "chain10_f32_16m":
        x = rng.standard_normal(1 << 24, dtype=np.float32)
        y = rng.standard_normal(1 << 24, dtype=np.float32)
        ms = median_ms(lambda: chain10(x, y))
    elif c == "softmax_rows_4096":
        x = rng.standard_normal((4096, 4096), dtype=np.float32)
        ms = median_ms(lambda: softmax(x))
    elif c == "sum_f32_64m":
        x = rng.standard_normal(1 << 26, dtype=np.float32)
        ms = median_ms(lambda: x.sum())
    elif c == "conv2d_resnet_block":
        x = rng.standard_normal((8, 64, 56, 56), dtype=np.float32)
        w = rng.standard_normal((64, 64, 3, 3), dtype=np.float32)
        ms = median_ms(lambda: conv2d(x, w))
    else:
        continue
    print(json.dumps({"name": c, "ms": ms}), flush=True)

blas = ""
try:
    from threadpoolctl import threadpool_info
    blas = ",".join(sorted({f"{i.get('internal_api')}/{i.get('architecture')}/{i.get('num_threads')}t" for i in threadpool_info()}))
except Exception:
    pass
print(json.dumps({"peer": f"numpy {np.__version__}", "blas": blas}), flush=True)
