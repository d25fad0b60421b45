"""Does the key / value pool's layout or spread change what the decode attention reads per second?

The engine's pool holds a page as [page positions, kv heads, head_dim] (NHD, engine/kv_cache.py), so one
(request, kv head) program of the paged kernel (engine/triton_attention.py) reads 256-byte rows 4 KB apart.
This probe times the same kernel over:
- `nhd`: that layout; `hnd`: a page as [kv heads, page positions, head_dim], each head's page 4 KB in one piece
  (a permuted view: the kernel takes the plane's strides, so it runs unchanged);
- `compact`: the block tables' pages shuffled within just the blocks the calls read; `spread`: the same number
  of pages drawn from a pool of --pool-gib GiB (the engine's pools are that large).
Decode calls (one new row per request), Ouro-1.4B heads (16 = 16 kv heads, d = 128), pages of 16, KV copies
rotating so a graph replay defeats the L2 (attention_sweep.py's timing). Each output is checked against a dense
float64 reference over the request's gathered pages.

    python benchmarks/kv_layout_probe.py --out $OUT/kv_layout --shapes 64x640,64x768,8x640 --launches table,n16/w1/s4/k1
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_sweep import FLUSH_BYTES, HEAD_DIM, HEADS, KV_HEADS, PAGE, kv_bytes, time_call  # noqa: E402
from engine.attention_dispatch import parse_launch  # noqa: E402

LAYOUTS, POOLS = ("nhd", "hnd"), ("compact", "spread")


class Pool:
    """K and V planes [blocks, PAGE, KV_HEADS, HEAD_DIM] in `layout`, and `copies` block tables of n requests."""

    def __init__(self, n: int, ctx: int, layout: str, blocks: int, copies: int, seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        nb = -(-ctx // PAGE)
        used = copies * n * nb
        blocks = max(blocks, used)
        shape = (blocks, PAGE, KV_HEADS, HEAD_DIM) if layout == "nhd" else (blocks, KV_HEADS, PAGE, HEAD_DIM)
        planes = [torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_(generator=None) for _ in "kv"]
        self.k, self.v = (p if layout == "nhd" else p.permute(0, 2, 1, 3) for p in planes)
        pick = torch.randperm(blocks, generator=g)[:used].view(copies, n, nb)
        self.tables = [t.to("cuda", torch.int32).contiguous() for t in pick]
        self.ctx = torch.full((n,), ctx, dtype=torch.int32, device="cuda")
        self.n = n

    def reference(self, q: torch.Tensor) -> torch.Tensor:
        """Dense float64 attention of each request's row over its gathered pages (copy 0's table)."""
        out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
        for r in range(self.n):
            ctx = int(self.ctx[r])
            blocks = self.tables[0][r].long()
            k = self.k[blocks].flatten(0, 1)[:ctx].double()  # [ctx, heads, d], whatever the pool's layout
            v = self.v[blocks].flatten(0, 1)[:ctx].double()
            s = torch.einsum("hd,chd->hc", q[r].double(), k) * HEAD_DIM**-0.5
            out[r] = torch.einsum("hc,chd->hd", torch.softmax(s, -1), v)
        return out


def run_case(n: int, ctx: int, layout: str, pool: str, pool_gib: float, launches: list[str]) -> list[dict]:
    from engine import triton_attention

    nbytes = kv_bytes(n, ctx)
    copies = max(2, math.ceil(FLUSH_BYTES / nbytes))
    per_block = PAGE * KV_HEADS * HEAD_DIM * 2
    blocks = int(pool_gib * (1 << 30) / 2 / per_block) if pool == "spread" else 0
    p = Pool(n, ctx, layout, blocks, copies, seed=n * 7919 + ctx)
    g = torch.Generator(device="cpu").manual_seed(ctx)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16)
    starts = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    ref = p.reference(q)
    rows = []
    for label in launches:
        config = triton_attention.default_config(q, p.k, n, 1) if label == "table" else parse_launch(label)

        def fn(copy, config=config):
            return triton_attention.launch_paged_attention(q, p.k, p.v, p.tables[copy], p.ctx, starts, 1,
                                                           HEAD_DIM**-0.5, config)
        err = float((fn(0).double() - ref).norm() / ref.norm())
        s = time_call(fn, nbytes / 3e12, copies, True)
        row = {"n": n, "ctx": ctx, "layout": layout, "pool": pool, "pool_gib": pool_gib if blocks else
               round(copies * n * -(-ctx // PAGE) * per_block * 2 / (1 << 30), 2), "launch": label, "us": s * 1e6,
               "tbps": nbytes / s / 1e12, "rel_err": err, "ok": err < 1e-2}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """Per shape and launch: us (TB/s) in each layout x pool, and hnd's time over nhd's in each pool."""
    cols = list(itertools.product(LAYOUTS, POOLS))
    lines = ["| N | L | launch | " + " | ".join(f"{a} {b} us (TB/s)" for a, b in cols) + " | hnd / nhd |",
             "|---|---|---|" + "---|" * (len(cols) + 1)]
    keys = dict.fromkeys((r["n"], r["ctx"], r["launch"]) for r in rows)
    for n, ctx, launch in keys:
        got = {(r["layout"], r["pool"]): r for r in rows if (r["n"], r["ctx"], r["launch"]) == (n, ctx, launch)}
        cells = [f"{got[c]['us']:.1f} ({got[c]['tbps']:.2f})" + ("" if got[c]["ok"] else " WRONG") if c in got else "-"
                 for c in cols]
        ratios = [f"{got[('hnd', pool)]['us'] / got[('nhd', pool)]['us']:.3f}" for pool in POOLS
                  if ("hnd", pool) in got and ("nhd", pool) in got]
        lines.append(f"| {n} | {ctx} | {launch} | " + " | ".join(cells) + f" | {' / '.join(ratios) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="64x640,64x768,8x640,256x640", help="NxL,NxL,...")
    ap.add_argument("--launches", default="table,n16/w1/s4/k1", help="'table' and/or nBLOCK_N/wWARPS/sSTAGES[/kS]")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--pools", default=",".join(POOLS))
    ap.add_argument("--pool-gib", type=float, default=40.0, help="K + V bytes of the spread pool")
    ap.add_argument("--rounds", type=int, default=2, help="every case this many times, in turn")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    launches = args.launches.split(",")
    rows = []
    for rnd, (n, ctx) in itertools.product(range(args.rounds), shapes):
        for layout, pool in itertools.product(args.layouts.split(","), args.pools.split(",")):
            rows += [dict(r, round=rnd) for r in run_case(n, ctx, layout, pool, args.pool_gib, launches)]
            torch.cuda.empty_cache()  # the case's pool, freed on its return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_layout.json").write_text(json.dumps(rows, indent=1))
    table = "\n\n".join(markdown([r for r in rows if r["round"] == rnd]) for rnd in range(args.rounds))
    (args.out / "kv_layout.md").write_text(table + "\n")
    print(table)
    return rows


if __name__ == "__main__":
    main()
