"""What each kernel of the *graphed* decode step adds to its time, overlap included.

step_profile.py times kernels eagerly, one after another; in the engine's CUDA graph with programmatic
dependent launch a kernel starts while the one before still runs, so its eager time is not what it costs the
step. Here one engine core is driven to a pure-decode state with graphs on (step_profile.decoding_core), a
few steps run under torch.profiler (CUPTI reports every kernel a graph replay runs, with its start and end),
and the kernels, in start order, are read against the running frontier (the latest end so far):
- ``advance``: how far the kernel moves the frontier, max(0, end - max(start, frontier)). The advances and
  the idle stretches sum to the steps' span, so they say where the graphed step's time goes;
- ``idle``: frontier to start, where nothing ran (host gaps between steps, launch gaps);
- ``early``: how long before the frontier it started (PDL: resident and waiting, or streaming ahead);
- ``dur``: its own start to end.

    python benchmarks/graph_timeline.py --out DIR [--ns 8,64] [--configs interval1] [--steps 4]

Environment switches (OUROBATCH_DECODE_RING, OUROBATCH_DECODE_FOLD_O, ...) act on the whole process, so a
comparison runs one process per value (gpu_suite.sh timeline); the JSON records them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FIELDS = ("dur", "advance", "idle", "early")


def timeline(spans: list[tuple[str, float, float]]) -> tuple[dict[str, dict[str, float]], float]:
    """spans: (name, start, end) of every device activity -> per name {calls, dur, advance, idle, early}
    (sums) and the span from the first start to the last end. advances + idles == span."""
    per: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(("calls",) + FIELDS, 0.0))
    frontier = None
    first = None
    for name, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        if end < start:
            raise ValueError(f"span {name!r} ends ({end}) before it starts ({start})")
        row = per[name]
        row["calls"] += 1
        row["dur"] += end - start
        if frontier is None:
            first, frontier = start, start
        row["idle"] += max(0.0, start - frontier)
        row["early"] += max(0.0, frontier - start)
        row["advance"] += max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
    return dict(per), (frontier - first) if first is not None else 0.0


def after_predecessor(spans: list[tuple[str, float, float]], depth: int = 1) -> list[tuple[str, float, float]]:
    """Each span renamed "name < the span started before it < the one before that ..." (`depth` of them, start
    order): one kernel name that serves two places in a layer (o_proj's and down_proj's split-K partials; at depth
    2 the two add + norms) splits into one row per place."""
    ordered = sorted(spans, key=lambda s: (s[1], s[2]))
    names = [name[:40] for name, _, _ in ordered]
    return [(" < ".join([name[:60]] + [names[j] if j >= 0 else "-" for j in range(i - 1, i - 1 - depth, -1)]),
             start, end) for i, (name, start, end) in enumerate(ordered)]


def table(per: dict[str, dict[str, float]], steps: int, top: int = 16) -> list[dict]:
    """Per name, sorted by advance: calls per step and each field per call (us) and per step (ms)."""
    rows = []
    for name, r in sorted(per.items(), key=lambda kv: -kv[1]["advance"]):
        calls = r["calls"]
        rows.append(dict(name=name[:120], calls_per_step=calls / steps,
                         **{f"{f}_us": r[f] / calls for f in FIELDS},
                         advance_ms_per_step=r["advance"] / steps / 1e3, idle_ms_per_step=r["idle"] / steps / 1e3))
    return rows[:top]


def markdown(label: str, rows: list[dict], span_ms: float) -> str:
    lines = [f"### {label}: {span_ms:.3f} ms per step (span)", "",
             "| kernel | calls / step | dur us | advance us | early us | idle us | advance ms / step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name'][:104]} | {r['calls_per_step']:.0f} | {r['dur_us']:.2f} | {r['advance_us']:.2f} | "
                     f"{r['early_us']:.2f} | {r['idle_us']:.2f} | {r['advance_ms_per_step']:.3f} |")
    return "\n".join(lines) + "\n"


def device_spans(prof) -> list[tuple[str, float, float]]:
    import torch

    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def profile_graphed(model_dir, model, args, config: str, N: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from step_profile import decoding_core, step

    core = decoding_core(model_dir, model, args, config, N, graphs=True)
    try:
        for _ in range(3):
            step(core)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step(core)
            torch.cuda.synchronize()
    finally:
        core.close()
    spans = device_spans(prof)
    per, span = timeline(after_predecessor(spans, args.after) if args.after else spans)
    rows = table(per, args.steps, args.top)
    return dict(N=N, config=config, steps=args.steps, span_ms_per_step=span / args.steps / 1e3,
                kernels_per_step=sum(r["calls"] for r in per.values()) / args.steps,
                idle_ms_per_step=sum(r["idle"] for r in per.values()) / args.steps / 1e3, rows=rows)


def main(argv=None) -> int:
    import torch

    from engine.loader import load_model
    from throughput import add_checkpoint_args, ensure_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ns", default="8,64")
    ap.add_argument("--configs", default="interval1")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="graphed steps under the profiler")
    ap.add_argument("--top", type=int, default=16, help="kernels listed per run")
    ap.add_argument("--after", type=int, default=0, metavar="DEPTH",
                    help="one row per kernel and the DEPTH kernels started before it (1: o_proj's and down_proj's "
                         "partials apart; 2: the two add + norms too)")
    add_checkpoint_args(ap)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.after < 0:
        ap.error(f"--steps must be >= 1 and --after >= 0, got {args.steps} and {args.after}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_checkpoint(args)
    model = load_model(model_dir, torch.bfloat16, "cuda")
    model.fuse_projections()
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OUROBATCH_")}
    result = dict(env=env, runs=[])
    md = [f"# Graphed decode step timeline (env: {env or 'defaults'})", ""]
    for N in (int(n) for n in args.ns.split(",")):
        for config in args.configs.split(","):
            run = profile_graphed(model_dir, model, args, config, N)
            result["runs"].append(run)
            md.append(markdown(f"N={N} {config}", run["rows"], run["span_ms_per_step"]))
            print(md[-1], flush=True)
            (out / "graph_timeline.json").write_text(json.dumps(result, indent=1))
            torch.cuda.empty_cache()
    (out / "graph_timeline.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
