# The PyTorch side of `voltaic bench --suite gpu`: the same workloads on the
# same GPU, timed the same way (warm-up of at least 300 ms, then the median of
# several runs of back-to-back calls ended by a full synchronize), one JSON
# line per case on stdout.
import json, sys, time, subprocess
import torch

cases = sys.argv[1].split(",")
runs = int(sys.argv[2])
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)


def sync():
    torch.cuda.synchronize()


def median_ms(f, per_call_sync=False):
    # Warm up for 300 ms so the clocks are up, and estimate the cost of a call.
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3 or n < 3:
        f()
        if per_call_sync:
            sync()
        n += 1
    sync()
    per = (time.perf_counter() - t0) / n
    reps = 1 if per_call_sync else max(1, min(1000, int(0.02 / max(per, 1e-7))))
    ts = []
    for _ in range(max(runs, 1)):
        s = time.perf_counter()
        for _ in range(reps):
            f()
        sync()
        ts.append((time.perf_counter() - s) * 1e3 / reps)
    ts.sort()
    return ts[len(ts) // 2]


def check(got, want, tol, what):
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item() + 1.0
    if not err <= tol * scale:
        raise SystemExit(f"torch peer: {what} check failed: max error {err} (scale {scale})")


def chain10(x, y):
    t = x * 2.0
    t = t + 1.0
    t = torch.relu(t)
    t = t - y
    t = torch.abs(t)
    t = torch.sqrt(t)
    t = t * y
    t = t + 3.0
    t = t * 0.5
    t = t - y
    return t


def mm_case(m, k, n, dtype=torch.float32, batch=None):
    shape_a = (m, k) if batch is None else (*batch, m, k)
    shape_b = (k, n) if batch is None else (*batch, k, n)
    a = torch.randn(shape_a, device=dev, dtype=dtype)
    b = torch.randn(shape_b, device=dev, dtype=dtype)
    c = a @ b
    ref = (a[..., :8, :].double() @ b.double())
    check(c[..., :8, :], ref, 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4, "matmul")
    return median_ms(lambda: a @ b)


extra = {}
for c in cases:
    if c == "matmul_f32_4096":
        ms = mm_case(4096, 4096, 4096)
    elif c == "matmul_f32_4096x4096x4100":
        ms = mm_case(4096, 4100, 4096)
    elif c == "bmm_f32_attention":
        ms = mm_case(128, 64, 128, batch=(64, 12))
    elif c == "linear_f32_b128":
        ms = mm_case(128, 784, 256)
    elif c == "gemv_f32_4096":
        ms = mm_case(1, 4096, 4096)
    elif c == "matmul_f16_4096":
        ms = mm_case(4096, 4096, 4096, dtype=torch.float16)
    elif c == "matmul_bf16_4096":
        ms = mm_case(4096, 4096, 4096, dtype=torch.bfloat16)
    elif c.startswith("linear_f32_"):
        m, k, n = (int(v) for v in c.removeprefix("linear_f32_").split("x"))
        x = torch.randn(m, k, device=dev)
        w = torch.randn(n, k, device=dev)
        check(torch.nn.functional.linear(x[:8], w), x[:8].double() @ w.double().t(), 1e-4, "linear")
        ms = median_ms(lambda: torch.nn.functional.linear(x, w))
    elif c == "add_f32_256m":
        a = torch.randn(1 << 28, device=dev)
        b = torch.randn(1 << 28, device=dev)
        ms = median_ms(lambda: a + b)
    elif c == "chain10_f32_16m":
        x = torch.randn(1 << 24, device=dev)
        y = torch.randn(1 << 24, device=dev)
        ms = median_ms(lambda: chain10(x, y))
        try:
            cc = torch.compile(chain10)
            check(cc(x, y), chain10(x, y), 1e-5, "compiled chain")
            extra[c] = {"torch_compile_ms": round(median_ms(lambda: cc(x, y)), 4)}
        except Exception as e:  # no compiler toolchain on the machine, etc.
            extra[c] = {"torch_compile_error": str(e).splitlines()[0][:200]}
    elif c == "softmax_rows_8192":
        x = torch.randn(8192, 8192, device=dev)
        ms = median_ms(lambda: torch.softmax(x, -1))
    elif c == "layernorm_rows_8192":
        x = torch.randn(8192, 8192, device=dev)
        w = torch.randn(8192, device=dev)
        b = torch.randn(8192, device=dev)
        ms = median_ms(lambda: torch.nn.functional.layer_norm(x, (8192,), w, b, 1e-5))
    elif c == "sum_f32_256m":
        x = torch.rand(1 << 28, device=dev)
        ms = median_ms(lambda: x.sum())
    elif c == "conv2d_resnet_block":
        x = torch.randn(8, 64, 56, 56, device=dev)
        w = torch.randn(64, 64, 3, 3, device=dev)
        ms = median_ms(lambda: torch.nn.functional.conv2d(x, w, padding=1))
    elif c == "launch_1000_small":
        x0 = torch.randn(1024, device=dev)

        def chain():
            x = x0
            for i in range(500):
                x = x * 1.0001
                x = x - 0.0001
            return x.cpu()

        ms = median_ms(chain, per_call_sync=True)
    elif c == "realize_small_graph":
        a = torch.randn(1024, device=dev)
        b = torch.randn(1024, device=dev)
        ms = median_ms(lambda: (a + b).cpu(), per_call_sync=True)
    else:
        continue
    line = {"name": c, "ms": ms}
    line.update(extra.get(c, {}))
    print(json.dumps(line), flush=True)

clocks = ""
try:
    clocks = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=10).stdout.strip()
except Exception:
    pass
print(json.dumps({"peer": f"torch {torch.__version__} cuda {torch.version.cuda}", "gpu": torch.cuda.get_device_name(0),
                  "clocks": clocks}), flush=True)
