"""Launch-config sweep of the paged attention kernel (engine/triton_attention.py) at Ouro-1.4B's head shape.

For every (requests N, context L, rows per request R): bf16, 16 q = 16 kv heads, head_dim 128, block size
16, block tables of shuffled blocks, all N requests at context L. Each candidate is captured in a CUDA graph
of many back-to-back calls (as the engine runs it: no host launch cost) that rotate over enough copies of
the KV to defeat the L2, and timed with CUDA events (median of 5 replays). Reported: microseconds
per call and achieved KV bandwidth (K and V bytes read once / time), per shape the best candidate, the
dispatch's default (attention_dispatch.LAUNCH_TABLE) and the pre-split baseline (64 / 4 warps / 2 stages,
one pass). Then per N the config that is best across all its (L, R) (geometric mean of time / shape's best:
the dispatch cannot see L), and LAUNCH_TABLE rows to paste.

Search, pruned to fit ~4 minutes on an H200: stage A times every (BLOCK_N, warps, stages) at the dispatch's
split count (BLOCK_N 128 with 2 warps is left out: it spills at sm_90); stage B times N's 3 best of them at
every split count that keeps N * kv_heads * splits within 16 programs per SM. Every candidate's output is
checked against the baseline's.

    python benchmarks/attention_sweep.py --out $OUT/sweep                          # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/attention_sweep.py --smoke --out /tmp/sweep  # CPU, seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

import torch

from engine.attention_dispatch import LAUNCH_TABLE, LaunchConfig

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 16, 128, 16  # Ouro-1.4B
BLOCK_NS, WARPS, STAGES, SPLITS = (32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2, 4, 8, 16)
BASELINE = LaunchConfig(64, 4, 2, 1)
FLUSH_BYTES = 256 << 20  # rotate KV copies until one graph replay touches this much (L2 is ~50 MiB)
TARGET_REPLAY_S = 2e-3
FLOOR_TBPS = 4.3


def name(c: LaunchConfig) -> str:
    return f"n{c.block_n}/w{c.num_warps}/s{c.num_stages}/k{c.splits}"


def kernel_key(c: LaunchConfig) -> str:
    """What compiles (and fails to) as one kernel: the split count only picks one-pass or split-K."""
    return f"n{c.block_n}/w{c.num_warps}/s{c.num_stages}/{'split' if c.splits > 1 else 'one'}"


def kv_bytes(n: int, ctx: int, elem: int = 2) -> int:
    return 2 * n * ctx * KV_HEADS * HEAD_DIM * elem


class Problem:
    """N requests at context `ctx`, `copies` disjoint shuffled block sets of one KV pool, R new rows each."""

    def __init__(self, n: int, ctx: int, device: str, dtype: torch.dtype, copies: int, seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        nb = -(-ctx // PAGE)
        blocks = copies * n * nb + 1
        self.k = torch.randn(blocks, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        self.v = torch.randn_like(self.k)
        perm = torch.randperm(blocks, generator=g)[: copies * n * nb].view(copies, n, nb)
        self.tables = [perm[c].to(device=device, dtype=torch.int32).contiguous() for c in range(copies)]
        self.ctx = torch.full((n,), ctx, dtype=torch.int32, device=device)
        self.n, self.device, self.dtype = n, device, dtype

    def inputs(self, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device="cpu").manual_seed(seed)
        q = torch.randn(self.n * rows, HEADS, HEAD_DIM, generator=g).to(self.device, self.dtype)
        starts = torch.arange(self.n + 1, dtype=torch.int32, device=self.device) * rows
        return q, starts


def call(p: Problem, q, starts, rows: int, config: LaunchConfig | None, copy: int) -> torch.Tensor:
    from engine.triton_attention import launch_paged_attention, triton_paged_attention

    args = (q, p.k, p.v, p.tables[copy], p.ctx, starts, rows, HEAD_DIM**-0.5)
    return triton_paged_attention(*args) if config is None else launch_paged_attention(*args, config)


def time_call(fn, est_s: float, copies: int, cuda: bool) -> float:
    """Seconds per call of fn(copy) (already warm)."""
    if not cuda:
        t = time.perf_counter()
        fn(0)
        return time.perf_counter() - t
    reps = max(copies, min(200, math.ceil(TARGET_REPLAY_S / max(est_s, 1e-6))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % copies)
    graph.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    del graph
    return statistics.median(times)


def time_separated(fn, est_s: float, copies: int) -> float:
    """Seconds per fn(copy) call (CUDA, already warm) when no call overlaps the one before: each follows a one-element
    add launched without PDL (it starts when the call before has ended, and holds the next until it ends), whose
    own time is measured alone and subtracted. Back to back (time_call), PDL starts a call's programs on the SMs its
    predecessor's last programs leave, which hides a kernel's first and last rounds (docs/benchmarks.md, session 40)."""
    flag = torch.zeros(1, device="cuda")

    def separated(copy):
        flag.add_(1)
        return fn(copy)

    return time_call(separated, est_s, copies, True) - time_call(lambda copy: flag.add_(1), 1e-6, copies, True)


def meaningful_splits(n: int, sms: int, splits=SPLITS) -> list[int]:
    return [s for s in splits if s == 1 or n * KV_HEADS * s <= 16 * sms]


def geomean_pick(shapes: list[dict]) -> tuple[str, float] | None:
    """The candidate measured (and correct) in every shape with the smallest geomean of time / shape's best."""
    common = None
    shapes = [sh for sh in shapes if sh["best"]["config"]]
    for sh in shapes:
        ok = {c for c, r in sh["candidates"].items() if r.get("us") and r["ok"] and c != "default"}
        common = ok if common is None else common & ok
    if not common:
        return None
    score = {c: math.exp(statistics.fmean(math.log(sh["candidates"][c]["us"] / sh["best"]["us"]) for sh in shapes))
             for c in common}
    best = min(sorted(score), key=score.get)
    return best, score[best]


def parse(config_name: str) -> LaunchConfig:
    return LaunchConfig(*(int(x[1:]) for x in config_name.split("/")))


def suggest_table(picks: dict[int, str], sms: int, kv_heads: int = KV_HEADS,
                  table=LAUNCH_TABLE) -> list[tuple[float, float, LaunchConfig]]:
    """LAUNCH_TABLE rows for tiles of <= 16 rows from the per-N picks: N's row reaches up to the geometric middle
    of its per_sm and the next N's. Fewer requests than measured keep the current rows' split counts with the
    smallest N's kernel config; rows for bigger tiles stay as they are (not measured here)."""
    ns = sorted(picks)
    per_sm = [n * kv_heads / sms for n in ns]
    smallest = parse(picks[ns[0]])
    rows = [(m, t, replace(smallest, splits=max(c.splits, smallest.splits))) for m, t, c in table
            if t <= 16 and m < per_sm[0]]
    for i, n in enumerate(ns):
        bound = round(math.sqrt(per_sm[i] * per_sm[i + 1]), 3) if i + 1 < len(ns) else math.inf
        rows.append((bound, 16, parse(picks[n])))
    return rows + [r for r in table if r[1] > 16]


def format_table(rows) -> str:
    lines = ["LAUNCH_TABLE: tuple[tuple[float, float, LaunchConfig], ...] = ("]
    for max_per_sm, max_tile, c in rows:
        f = lambda v: "INF" if v == math.inf else repr(v)  # noqa: E731
        lines.append(f"    ({f(max_per_sm)}, {f(max_tile)}, LaunchConfig(block_n={c.block_n}, num_warps={c.num_warps}, "
                     f"num_stages={c.num_stages}, splits={c.splits})),")
    return "\n".join(lines + [")"])


def _compile_some(device: str, configs: list[tuple[int, int, int, int]]) -> dict[str, str]:
    # a worker process: compile by launching on a tiny problem with the sweep's specializations
    p = Problem(1, 256, device, torch.bfloat16 if device == "cuda" else torch.float32, 1, 0)
    q, starts = p.inputs(1, 0)
    errors = {}
    for c in configs:
        config = LaunchConfig(*c)
        try:
            call(p, q, starts, 1, config, 0)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - e.g. OutOfResources (shared memory): recorded, candidate dropped
            errors[kernel_key(config)] = f"{type(e).__name__}: {str(e)[:200]}"
    return errors


def precompile(kernel_configs: list[LaunchConfig], workers: int, device: str = "cuda") -> dict[str, str]:
    """Compile every candidate in parallel processes (Triton's disk cache then serves the main process)."""
    todo = [(c.block_n, c.num_warps, c.num_stages, c.splits) for c in kernel_configs]
    chunks = [todo[i::workers] for i in range(workers) if todo[i::workers]]
    try:
        with ProcessPoolExecutor(len(chunks), mp_context=get_context("spawn")) as ex:
            errors: dict[str, str] = {}
            for e in ex.map(_compile_some, [device] * len(chunks), chunks):
                errors.update(e)
            return errors
    except Exception as e:  # noqa: BLE001 - fall back to compiling on first use
        print(f"precompile failed ({type(e).__name__}: {e}); compiling serially", file=sys.stderr)
        return {}


def measure(sh: dict, prob: Problem, q: torch.Tensor, starts: torch.Tensor, cands: list, copies: int, cuda: bool,
            failed: dict) -> None:
    """Time every candidate (None: the dispatch's default) on one shape; check it against the baseline."""
    rows = sh["rows"]
    ref = call(prob, q, starts, rows, BASELINE, 0).float()
    nbytes = kv_bytes(prob.n, sh["ctx"])
    for c in cands:
        key = "default" if c is None else name(c)
        if key in sh["candidates"] or (c is not None and kernel_key(c) in failed):
            continue
        try:
            out = call(prob, q, starts, rows, c, 0).float()
            ok = bool(torch.isfinite(out).all()) and float((out - ref).norm() / ref.norm()) < 2e-2
            s = time_call(lambda copy, c=c: call(prob, q, starts, rows, c, copy), nbytes / 3e12, copies, cuda)
            sh["candidates"][key] = dict(us=s * 1e6, tbps=nbytes / s / 1e12, ok=ok)
        except Exception as e:  # noqa: BLE001 - a config that does not fit: recorded, skipped
            sh["candidates"][key] = dict(error=f"{type(e).__name__}: {str(e)[:200]}", ok=False)
    good = {k: r for k, r in sh["candidates"].items() if r.get("us") and r["ok"] and k != "default"}
    best = min(good, key=lambda k: good[k]["us"], default=None)
    sh["best"] = dict(config=best, **good[best]) if best else dict(config=None, us=math.nan, tbps=0.0)
    sh["default"] = sh["candidates"].get("default", {})
    sh["baseline"] = sh["candidates"].get(name(BASELINE), {})


def top_kernels(shapes: list[dict], grid: list[tuple[int, int, int]], k: int = 3) -> list[tuple[int, int, int]]:
    """The k (BLOCK_N, warps, stages) with the smallest geomean of time / shape's best over `shapes` (stage A)."""
    shapes = [sh for sh in shapes if sh["best"]["config"]]
    rank = {}
    for g in grid:
        prefix = "n%d/w%d/s%d/" % g
        times = [min((r["us"] for c, r in sh["candidates"].items()
                      if c.startswith(prefix) and r.get("us") and r["ok"]), default=None) for sh in shapes]
        if times and all(times):
            rank[g] = statistics.fmean(math.log(t / sh["best"]["us"]) for t, sh in zip(times, shapes))
    return sorted(rank, key=rank.get)[:k]


def sweep_space(smoke: bool) -> tuple[str, torch.dtype, list[tuple[int, int, int]], tuple[int, ...]]:
    """The device, dtype, (BLOCK_N, warps, stages) grid and split counts to sweep (--smoke: tiny heads on CPU)."""
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs on CPU tensors under Triton's interpreter: set TRITON_INTERPRET=1")
        global HEADS, KV_HEADS, HEAD_DIM
        HEADS, KV_HEADS, HEAD_DIM = 2, 1, 32  # GQA 2
        device, dtype = "cpu", torch.float32  # the interpreter's tl.dot is wrong for bf16
        return device, dtype, [(16, 4, 2), (32, 4, 2)], (1, 2)
    if not torch.cuda.is_available():
        raise SystemExit("the sweep times CUDA kernels: run it on a GPU (or --smoke under TRITON_INTERPRET=1)")
    grid = [g for g in itertools.product(BLOCK_NS, WARPS, STAGES) if not (g[0] == 128 and g[1] == 2)]
    return "cuda", torch.bfloat16, grid, SPLITS


def run(args) -> dict:
    cuda = not args.smoke
    device, dtype, grid, splits = sweep_space(args.smoke)
    from engine.triton_attention import default_config, num_sms

    sms = num_sms(torch.device(device))
    t0 = time.perf_counter()
    failed: dict[str, str] = {}
    if args.workers > 0:
        kc = [LaunchConfig(*g, s) for g in grid for s in (1, 2)] + [LaunchConfig(64, 4, 2, s) for s in splits[2:]]
        failed = precompile(kc, args.workers, device)
        print(f"precompiled {len(kc)} variants in {time.perf_counter() - t0:.0f}s; {len(failed)} failed", flush=True)
    shapes: list[dict] = []
    truncated = False
    for n in args.seqs:
        mine = [dict(n=n, ctx=ctx, rows=rows, per_sm=n * KV_HEADS / sms, candidates={})
                for ctx in args.contexts for rows in args.rows]
        shapes.extend(mine)
        for stage in ("A", "B"):
            if stage == "B":
                if time.perf_counter() - t0 > args.budget_s:
                    truncated = True
                    break
                top = top_kernels(mine, grid)
            for ctx in args.contexts:
                copies = 1 if not cuda else max(1, min(8, math.ceil(FLUSH_BYTES / kv_bytes(n, ctx))))
                prob = Problem(n, ctx, device, dtype, copies, seed=n * 7 + ctx)
                for sh in (sh for sh in mine if sh["ctx"] == ctx):
                    rows = sh["rows"]
                    q, starts = prob.inputs(rows, seed=rows)
                    default = default_config(q, prob.k, n, rows)
                    sh["default_config"] = name(default)
                    if stage == "A":  # every kernel config at the dispatch's split count
                        cands = [None, BASELINE] + [LaunchConfig(*g, default.splits) for g in grid]
                    else:  # the best few at every split count worth a look
                        cands = [LaunchConfig(*g, s) for g in top for s in meaningful_splits(n, sms, splits)]
                    measure(sh, prob, q, starts, cands, copies, cuda, failed)
                    print(f"N={n} L={ctx} R={rows} [{stage}] default {sh['default_config']} "
                          f"{sh['default'].get('us', math.nan):.1f}us  best {sh['best']['config']} "
                          f"{sh['best']['us']:.1f}us {sh['best']['tbps']:.2f}TB/s  ({time.perf_counter() - t0:.0f}s)",
                          flush=True)
                del prob
                if cuda:
                    torch.cuda.empty_cache()
    picks = {}
    for n in args.seqs:
        pick = geomean_pick([sh for sh in shapes if sh["n"] == n])
        if pick:
            picks[n] = dict(config=pick[0], geomean_vs_best=pick[1])
    table = suggest_table({n: pk["config"] for n, pk in picks.items()}, sms, KV_HEADS) if picks else []
    return dict(device=torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)", sms=sms,
                torch=torch.__version__, shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page=PAGE,
                                                    dtype=str(dtype)),
                seconds=time.perf_counter() - t0, truncated=truncated, failed_to_compile=failed, shapes=shapes,
                picks=picks, suggested_table=format_table(table) if table else None)


def markdown(res: dict) -> str:
    lines = [f"# Paged attention sweep: {res['device']} ({res['sms']} SMs), heads {res['shape']}",
             f"{res['seconds']:.0f}s{' (budget reached: stage B skipped for some N)' if res['truncated'] else ''}. "
             f"TB/s = K and V bytes read once / time; % = of {FLOOR_TBPS} TB/s.", "",
             "| N | L | rows | default | us | TB/s | best | us | TB/s | % | best/default | baseline us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sh in res["shapes"]:
        d, b, base = sh["default"], sh["best"], sh["baseline"]
        lines.append(f"| {sh['n']} | {sh['ctx']} | {sh['rows']} | {sh['default_config']} | "
                     f"{d.get('us', math.nan):.1f} | {d.get('tbps', 0):.2f} | {b['config']} | {b['us']:.1f} | "
                     f"{b['tbps']:.2f} | {100 * b['tbps'] / FLOOR_TBPS:.0f} | {d.get('us', math.nan) / b['us']:.2f}x | "
                     f"{base.get('us', math.nan):.1f} |")
    lines += ["", "Best config per N across its (L, rows) (geometric mean of time / each shape's best):", ""]
    lines += [f"- N={n}: {p['config']} ({p['geomean_vs_best']:.3f}x)" for n, p in res["picks"].items()]
    if res["suggested_table"]:
        lines += ["", "Suggested engine/attention_dispatch.py table (rows below the smallest N and for tiles past 16 "
                  "rows are the current ones):", "", "```python", res["suggested_table"], "```"]
    if res["failed_to_compile"]:
        lines += ["", "Did not compile / launch: " + ", ".join(sorted(res["failed_to_compile"]))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for sweep.json and sweep.md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--seqs", type=int, nargs="+", default=None, help="requests N (default 8 16 64 256)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="context L (default 768 2048 4096)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="rows per request (default 1 4 8)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip stage B for the N left after this long")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes that compile the candidates first (default: up to 16; --smoke: 0)")
    args = ap.parse_args(argv)
    small = args.smoke
    args.workers = args.workers if args.workers is not None else 0 if small else min(16, os.cpu_count() or 1)
    args.seqs = args.seqs or ([2] if small else [8, 16, 64, 256])
    args.contexts = args.contexts or ([21] if small else [768, 2048, 4096])
    args.rows = args.rows or ([1, 2] if small else [1, 4, 8])
    for field in ("seqs", "contexts", "rows"):
        if min(getattr(args, field)) < 1:
            raise SystemExit(f"--{field} must be positive integers, got {getattr(args, field)}")
    if min(args.contexts) < max(args.rows):
        raise SystemExit(f"--contexts must be at least the rows per request ({max(args.rows)}), got {args.contexts}")
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(res, indent=1))
    (out / "sweep.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
