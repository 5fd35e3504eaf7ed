#!/usr/bin/env python3
"""Print the Markdown table of a `voltaic bench --json` run (JSON lines on stdin or in a file)."""
import json, sys

lines = [json.loads(l) for l in (open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin) if l.strip()]
print("| row | Voltaic ms | peer ms | speedup | note |")
print("|---|---:|---:|---:|---|")
for r in lines:
    extra = f"; torch.compile {r['torch_compile_ms']} ms" if "torch_compile_ms" in r else ""
    peer = r.get("peer_ms")
    sp = r.get("speedup")
    print(f"| `{r['name']}` | {r['voltaic_ms']:.3f} | {peer if peer is not None else '-'} | {sp if sp is not None else '-'} | {r.get('note', '')}{extra} |")
