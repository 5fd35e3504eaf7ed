#!/usr/bin/env python3
"""Sum a `VOLTAIC_PROFILE=1` log (stderr) by kind of kernel.

    VOLTAIC_PROFILE=1 voltaic bench ... 2> prof.txt
    python3 scripts/profile_sum.py prof.txt [--last N] [--top K] [--labels]

`--last N` keeps the last N realizations (a realization's kernel block is
followed by its `voltaic host` line), e.g. the realizations of the last few
steps. Prints GPU time per kernel kind (the label's first word; products by
their shape), the share of each, and the host time per phase. `--labels`
groups by whole label and element count instead (which reduction, which
cat), for `VOLTAIC_PROFILE=dispatch` logs especially.
"""
import re
import sys
from collections import defaultdict


def realizations(lines):
    """[(kernels, host)] per realization: kernels as (us, label), host as {phase: us}."""
    out, kernels = [], []
    for line in lines:
        m = re.match(r"\s+([\d.]+) us\s+(\d+) elements\s+(.*)$", line)
        if m:
            label = m.group(3).strip()
            kernels.append((float(m.group(1)), f"{label} <{m.group(2)}>" if LABELS else label))
            continue
        if line.startswith("voltaic host"):
            host = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", line.split("us:", 1)[1])}
            out.append((kernels, host))
            kernels = []
    return out


LABELS = "--labels" in sys.argv


def kind(label):
    if LABELS:
        return label
    if label.startswith("matmul") or label.startswith("coop"):
        return " ".join(label.split()[:2])
    return label.split()[0] if label else "?"


def main():
    args = sys.argv[1:]
    last = int(args[args.index("--last") + 1]) if "--last" in args else None
    top = int(args[args.index("--top") + 1]) if "--top" in args else 25
    with open(args[0], errors="replace") as f:
        reals = realizations(f.read().splitlines())
    if last:
        reals = reals[-last:]
    by_kind, count = defaultdict(float), defaultdict(int)
    host = defaultdict(float)
    for kernels, h in reals:
        for us, label in kernels:
            by_kind[kind(label)] += us
            count[kind(label)] += 1
        for k, v in h.items():
            host[k] += v
    total = sum(by_kind.values())
    n = sum(count.values())
    print(f"{len(reals)} realizations, {n} kernels, {total / 1e3:.2f} ms of GPU time")
    for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / 1e3:9.3f} ms  {100 * us / max(total, 1e-9):5.1f}%  {count[k]:6d} x  {us / count[k]:8.1f} us  {k}")
    print("host ms: " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in host.items()))


if __name__ == "__main__":
    main()
