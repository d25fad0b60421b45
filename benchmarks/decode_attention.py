"""The Gluon decode attention kernel (engine/gluon_attention.py) against the Triton paged kernel's table pick.
With --triton-grid, the paged kernel's launches too (TRITON_GRID: BLOCK_N x warps x stages, each in both launch
orders, attention_dispatch.LaunchConfig.head_major); with --ceilings, the device's read and copy bandwidth first.

Decode calls only (one new row per request), Ouro-1.4B heads (16 q = 16 kv heads, d = 128), pages of 16,
shuffled block tables, every request at context L; KV copies rotate so one replay defeats the L2
(attention_sweep.py's Problem and timing: a CUDA graph of calls, CUDA events, median of 5; time_separated: each call
follows a one-element add launched without PDL, its own time measured alone and subtracted), so no call's first
programs start on the SMs the call before leaves: back to back (`--back-to-back`, the timing before session 40) a
persistent ring's last round hid behind the next call, 8 us a call at N = 64 on an H100
(benchmarks/attention_in_pool.py, docs/benchmarks.md session 40). Every output is checked against a float64
reference computed densely from the gathered pages.

    python benchmarks/decode_attention.py --out $OUT/decode_attention      # on an H200
    python benchmarks/decode_attention.py --out $OUT/da --shapes 64x640 --triton-grid --no-gluon --ceilings
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_sweep import (  # noqa: E402
    FLUSH_BYTES, HEAD_DIM, PAGE, Problem, kv_bytes, time_call, time_separated)
from engine.attention_dispatch import DecodeConfig, LaunchConfig, decode_config, launch_label  # noqa: E402

SHAPES = ((1, 640), (4, 640), (8, 640), (16, 640), (32, 640), (64, 640), (8, 2048), (16, 2048))
GLUON_BASES = (DecodeConfig(32, 6), DecodeConfig(64, 3), DecodeConfig(16, 12), DecodeConfig(32, 3), DecodeConfig(16, 6))
PERSISTENT = tuple(DecodeConfig(n, s, ctas_per_sm=k) for n, s, k in ((32, 6, 1), (32, 6, 2), (32, 3, 2), (64, 3, 1),
                                                                      (32, 12, 1)))
TRITON_GRID = tuple(LaunchConfig(n, w, s, 1, major) for n, w, s, major in
                    itertools.product((16, 32, 64), (1, 2, 4), (2, 3, 4), (False, True)) if not (n == 64 and w == 1))


def reference(p: Problem, q: torch.Tensor) -> torch.Tensor:
    """Dense float64 attention of each request's one row over its gathered context."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for r in range(p.n):
        ctx = int(p.ctx[r])
        blocks = p.tables[0][r, : -(-ctx // PAGE)].long()
        slots = (blocks[:, None] * PAGE + torch.arange(PAGE, device=q.device)).flatten()[:ctx]
        k = p.k.flatten(0, 1)[slots].double()  # [ctx, heads, d]
        v = p.v.flatten(0, 1)[slots].double()
        s = torch.einsum("hd,chd->hc", q[r].double(), k) * HEAD_DIM**-0.5
        out[r] = torch.einsum("hc,chd->hd", torch.softmax(s, -1), v)
    return out


def candidates(n: int, sms: int, triton_grid: bool = False,
               gluon: bool = True) -> list[tuple[str, DecodeConfig | LaunchConfig | None]]:
    cands: list[tuple[str, DecodeConfig | LaunchConfig | None]] = [("triton table", None)]
    if triton_grid:
        cands += [(f"triton {launch_label(c)}", c) for c in TRITON_GRID]
    if not gluon:
        return cands
    auto = (decode_config(n, 16, sms) or DecodeConfig()).splits
    for base in GLUON_BASES:
        for splits in sorted({max(1, auto // 2), auto, auto * 2}):
            c = replace(base, splits=splits)
            cands.append((f"gluon n{c.block_n}/s{c.stages}/k{c.splits}" + (" (auto)" if splits == auto else ""), c))
    cands += [(f"gluon n{c.block_n}/s{c.stages}/p{c.ctas_per_sm}", c) for c in PERSISTENT]
    return cands


def ceilings(nbytes: int = 2 << 30) -> dict:
    """The device's bandwidth in TB/s: a read (torch's sum and amax over nbytes of bf16) and a copy (bytes read
    + written), each the median of 9 timed calls after a warm one."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)

    def tbps(fn, moved: int) -> float:
        fn()
        times = []
        for _ in range(9):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return moved / statistics.median(times) / 1e12

    return {"read_sum_tbps": tbps(lambda: x.sum(dtype=torch.float32), nbytes), "read_amax_tbps": tbps(x.amax, nbytes),
            "copy_tbps": tbps(lambda: y.copy_(x), 2 * nbytes), "bytes": nbytes}


def run_shape(n: int, ctx: int, sms: int, triton_grid: bool = False, gluon: bool = True,
              breaks: bool = True) -> dict:
    from engine import triton_attention
    from engine.gluon_attention import launch_decode_attention

    nbytes = kv_bytes(n, ctx)
    copies = max(1, math.ceil(FLUSH_BYTES / nbytes))
    p = Problem(n, ctx, "cuda", torch.bfloat16, copies, seed=n * 7919 + ctx)
    q, starts = p.inputs(1, seed=ctx)
    ref = reference(p, q)
    res = {"n": n, "ctx": ctx, "floor_us": nbytes / 4.3e12 * 1e6, "candidates": {},
           "timing": "breaks" if breaks else "back to back"}
    for label, c in candidates(n, sms, triton_grid, gluon):
        def fn(copy, c=c):
            args = (q, p.k, p.v, p.tables[copy], p.ctx, starts)
            if c is None or isinstance(c, LaunchConfig):
                config = c or triton_attention.default_config(q, p.k, n, 1)
                return triton_attention.launch_paged_attention(*args, 1, HEAD_DIM**-0.5, config)
            return launch_decode_attention(*args, HEAD_DIM**-0.5, c)
        try:
            out = fn(0).double()
            err = float((out - ref).norm() / ref.norm())
            s = time_separated(fn, nbytes / 3e12, copies) if breaks else time_call(fn, nbytes / 3e12, copies, True)
            res["candidates"][label] = {"us": s * 1e6, "tbps": nbytes / s / 1e12, "rel_err": err, "ok": err < 1e-2}
        except Exception as e:  # noqa: BLE001 - recorded: a config that does not compile or fit
            res["candidates"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ok": False}
        print(n, ctx, label, res["candidates"][label], flush=True)
    return res


def markdown(results: list[dict]) -> str:
    lines = ["| N | L | floor us | triton table us | best gluon | us | TB/s | gluon auto us | rel err (worst) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["candidates"]
        tri = c.get("triton table", {})
        gl = {k: v for k, v in c.items() if k.startswith("gluon") and v.get("ok")}
        best = min(gl, key=lambda k: gl[k]["us"], default=None)
        auto = next((v for k, v in c.items() if k.endswith("(auto)") and k.startswith("gluon n32/s6")), {})
        worst = max((v["rel_err"] for v in c.values() if "rel_err" in v), default=math.nan)  # of those that ran
        lines.append(f"| {r['n']} | {r['ctx']} | {r['floor_us']:.1f} | {tri.get('us', math.nan):.1f} | {best} | "
                     f"{gl[best]['us'] if best else math.nan:.1f} | {gl[best]['tbps'] if best else 0:.2f} | "
                     f"{auto.get('us', math.nan):.1f} | {worst:.1e} |")
    return "\n".join(lines)


def triton_best(results: list[dict], count: int) -> list[str]:
    """The `count` paged-kernel launches (TRITON_GRID, correct in every shape) with the smallest geometric mean of
    their time over the shapes, among those whose mean beats the table's pick: gpu_suite.sh paged_decode runs the
    decode harness with them (OUROBATCH_PAGED_DECODE)."""
    def mean(label: str) -> float | None:
        runs = [r["candidates"].get(label, {}) for r in results]
        if not results or not all(run.get("ok") for run in runs):
            return None
        return math.exp(statistics.fmean(math.log(run["us"]) for run in runs))

    labels = {label for r in results for label in r["candidates"] if label.startswith("triton n")}
    means = {label: m for label in labels if (m := mean(label)) is not None}
    table = mean("triton table")
    ranked = sorted((label for label in means if table is None or means[label] < table), key=means.get)
    return [label.removeprefix("triton ") for label in ranked[:count]]


def triton_markdown(results: list[dict], ceiling: dict | None) -> str:
    """Per shape: the table's pick, the fastest correct launch overall and in each launch order."""
    lines = []
    if ceiling:
        lines += [f"Device bandwidth: read {ceiling['read_sum_tbps']:.2f} TB/s (sum), {ceiling['read_amax_tbps']:.2f} "
                  f"(amax); copy {ceiling['copy_tbps']:.2f} (read + written, over {ceiling['bytes'] >> 20} MiB).", ""]
    lines += ["| N | L | floor us | triton table us | best launch | us | TB/s | best by request | us |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["candidates"]
        grid = {k: v for k, v in c.items() if k.startswith("triton n") and v.get("ok")}
        best = min(grid, key=lambda k: grid[k]["us"], default=None)
        major = min((k for k in grid if k.endswith("/head")), key=lambda k: grid[k]["us"], default=None)
        us = lambda k: grid[k]["us"] if k else math.nan  # noqa: E731
        table = c.get("triton table", {}).get("us", math.nan)
        short = lambda k: k.removeprefix("triton ") if k else None  # noqa: E731
        lines.append(f"| {r['n']} | {r['ctx']} | {r['floor_us']:.1f} | {table:.1f} | {short(best)} | {us(best):.1f} | "
                     f"{grid[best]['tbps'] if best else 0:.2f} | {short(major)} | {us(major):.1f} |")
    best = triton_best(results, 5)
    return "\n".join(lines + ["", f"Fastest launches over all shapes that beat the table: {', '.join(best) or 'none'}"])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(f"{n}x{c}" for n, c in SHAPES), help="NxL,NxL,...")
    ap.add_argument("--triton-grid", action="store_true", help="time the paged kernel's TRITON_GRID launches too")
    ap.add_argument("--no-gluon", dest="gluon", action="store_false", help="leave the Gluon kernel's rings out")
    ap.add_argument("--ceilings", action="store_true", help="measure the device's read and copy bandwidth first")
    ap.add_argument("--back-to-back", dest="breaks", action="store_false",
                    help="time calls back to back (PDL overlaps each call's start with the last one's end)")
    ap.add_argument("--best", type=int, default=0,
                    help="print the N fastest launches of --out's decode_attention.json that beat the table, and stop")
    args = ap.parse_args(argv)
    if args.best:
        results = json.loads((args.out / "decode_attention.json").read_text())
        print(" ".join(triton_best(results, args.best)))
        return results
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    ceiling = ceilings() if args.ceilings else None
    torch.cuda.empty_cache()
    results = [run_shape(n, ctx, sms, args.triton_grid, args.gluon, args.breaks) for n, ctx in shapes]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attention.json").write_text(json.dumps(results, indent=1))
    table = (markdown(results) if args.gluon else "") + ("\n\n" if args.gluon and args.triton_grid else "")
    table += triton_markdown(results, ceiling) if args.triton_grid or ceiling else ""
    if ceiling:
        (args.out / "ceilings.json").write_text(json.dumps(ceiling, indent=1))
    (args.out / "decode_attention.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()
