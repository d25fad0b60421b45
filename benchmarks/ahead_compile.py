"""The loop-pass launch's compile forked ahead (engine/ahead_compile.py), alone, without a GPU: AheadCompile.fork
`--children` times in turn on one empty Triton cache folder (the first compiles and hashes Triton's key, the later
ones find both on disk), at the shape of a model (default Ouro-1.4B's), for sm`--capability`. Prints a markdown
table and writes ahead_compile.json and ahead_compile.md to --out. Needs Triton with Gluon; no GPU.

    python benchmarks/ahead_compile.py --out DIR [--children 3] [--hidden 2048 --inter 5632 --heads 16 --layers 24]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(args) -> list[dict]:
    import torch

    from engine import kernel_cases
    from engine.ahead_compile import AheadCompile

    s = SimpleNamespace(dtype=torch.bfloat16, hidden_size=args.hidden, intermediate_size=args.inter,
                        num_heads=args.heads, num_kv_heads=args.heads, head_dim=args.hidden // args.heads,
                        block_size=16, table_width=args.table_width, eps=1e-6, num_layers=args.layers)
    (rows, layers), = kernel_cases.layers_keys(s, True).values()  # the pass's launch of this model
    out = []
    for child in range(1, args.children + 1):
        t = time.perf_counter()
        ahead = AheadCompile.fork(s, rows, layers, args.capability, args.sms, {"USE_PDL": True, "launch_pdl": True})
        forked = time.perf_counter() - t
        r = ahead.join() if ahead is not None else None
        out.append(dict(child=child, fork_s=forked, ok=bool(r and r.ok), compiled=bool(r and r.compiled),
                        child_s=r.seconds if r else None, key=r.key if r else None,
                        launcher=bool(r and r.launcher), wall_s=time.perf_counter() - t))
        print(json.dumps(out[-1]), flush=True)
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Loop-pass launch compiled ahead, {meta['shape']}, sm{meta['capability']}, {meta['machine']}, "
             f"Triton {meta['triton']} ({meta['date']})", "",
             "| child | compiled | key | child s | fork s | wall s | launcher built |", "|---" * 7 + "|"]
    for r in rows:
        lines.append(f"| {r['child']} | {r['compiled']} | {r['key']} | {r['child_s']:.3f} | {r['fork_s']:.3f} | "
                     f"{r['wall_s']:.3f} | {r['launcher']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--children", type=int, default=3, help="children in turn on one cache folder (>= 1)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--table-width", type=int, default=64, help="block-table row width (max_model_len / 16)")
    ap.add_argument("--capability", type=int, default=90, help="the target GPU's, as 10 x major + minor")
    ap.add_argument("--sms", type=int, default=132, help="the launch's grid (the GPU's SMs)")
    args = ap.parse_args(argv)
    if args.children < 1:
        ap.error(f"--children must be >= 1, got {args.children}")
    try:
        import triton
        from triton.experimental import gluon  # noqa: F401
    except ImportError as exc:
        ap.error(f"needs Triton with Gluon ({exc})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ourobatch-ahead-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        rows = measure(args)
    meta = dict(date=datetime.date.today().isoformat(), machine=f"{platform.node()}, {os.cpu_count()} cores",
                triton=triton.__version__, capability=args.capability,
                shape=f"hidden {args.hidden}, intermediate {args.inter}, {args.heads} heads, {args.layers} layers")
    (out / "ahead_compile.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = markdown(rows, meta)
    (out / "ahead_compile.md").write_text(md)
    print(md)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
