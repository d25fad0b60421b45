"""The public paths side by side, with a profile of where the async Engine's wall time goes.

For each config (interval 1, deferred B=4 / B=8 by default), one workload of N prompts of P tokens, M
output tokens each (ignore_eos, temperature 1, prefill included; the warm-up round runs the same prompts,
so the timed rounds find their full prompt blocks in the prefix cache unless --fresh-prompts; each timed
row records its prefix-cache hits and computed prefill tokens), run three ways in one process:

- ``sync``: ``SyncEngine.generate_batch`` (the blocking path),
- ``async``: N concurrent ``Engine.generate`` calls (the public async path),
- ``profiled``: the async run again with probes: CUDA events around every executor phase (prefill,
  shallow call, deep call, sampling; no extra synchronisation), host clocks around ``schedule`` (and
  ``schedule_ahead`` with async scheduling), ``update``, the worker thread's ``execute`` and the
  event-loop turn between steps (output delivery, other tasks), the requests that waited aligned to a
  cohort each step, and the CUDA graphs captured during the run (``--no-profile``: not run).

The timed sync and async runs also measure ``gpu_idle_share`` (benchmarks/gpu_idle.py): CUDA events on
the stream at the start and end of every step's GPU work (around ``executor.launch``), so pipelined steps
count; the idle time between one step's end and the next one's start, as a share of the step phase's
span on the device (host clocks on the CPU). With async scheduling on, this, not the probe's host
columns, says how much of the host's work is still on the critical path.

Each engine first runs a short warm-up round (CUDA graphs are captured at startup; this compiles the
prefill kernels). Output: public_path.json and public_path.md (tok/s per path and the profile table).

    python benchmarks/public_path.py --out results/public                       # H200
    python benchmarks/public_path.py --device cpu --tiny -N 4 -P 8 -M 12 --out /tmp/p   # CPU smoke test
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

import anyio
import torch

from ourobatch import Engine, EngineConfig, SamplingParams, SyncEngine
from engine.config import OuroConfig
from scheduler.request import RequestStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_idle import StepGaps  # noqa: E402
from throughput import add_checkpoint_args, check_configs, ensure_checkpoint, parse_config  # noqa: E402

PHASES = ("_prefill", "_shallow", "_deep", "_deep_verify", "_sample")


class Probe:
    """Timers installed on one running engine's core, executor and (async) driver loop."""

    def __init__(self, core, cuda: bool) -> None:
        self.core, self.cuda = core, cuda
        self.events: list[tuple[str, object, object]] = []  # (phase, start event, end event)
        self.host = collections.Counter()  # seconds per host part
        self.steps = self.aligning = self.running = 0
        self._last_update_end: float | None = None
        self._schedule_end: float | None = None  # None: the step in flight was planned before install()
        self._saved: list[tuple[object, str]] = []
        graphs = core.executor.graphs
        self.captures_before = graphs.num_captures if graphs is not None else 0

    def _wrap(self, obj, name: str, wrapper) -> None:
        orig = getattr(obj, name)
        self._saved.append((obj, name))
        setattr(obj, name, wrapper(orig))

    def install(self) -> None:
        ex, core = self.core.executor, self.core

        def phase(name):
            def wrapper(orig):
                def run(*args):
                    if not self.cuda:
                        t = time.perf_counter()
                        out = orig(*args)
                        self.host[name] += time.perf_counter() - t
                        return out
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = orig(*args)
                    end.record()
                    self.events.append((name, start, end))
                    return out
                return run
            return wrapper

        for name in PHASES:
            if hasattr(ex, name):
                self._wrap(ex, name, phase(name))

        def timed(key):
            def wrapper(orig):
                def run(*args):
                    t = time.perf_counter()
                    if key == "schedule" and self._last_update_end is not None:
                        self.host["between_steps"] += t - self._last_update_end
                    out = orig(*args)
                    now = time.perf_counter()
                    self.host[key] += now - t
                    if key == "schedule" and out is not None:  # schedule_ahead: None when not planned ahead
                        self.steps += bool(out.prefills or out.shallow or out.deep)  # not release-only plans
                        self._schedule_end = now
                        reqs = core.scheduler.requests.values()
                        self.aligning += sum(r.status == RequestStatus.ALIGNING for r in reqs)
                        self.running += core.scheduler.num_running
                    elif key == "update" and self._schedule_end is not None:
                        self.host["await_step"] += t - self._schedule_end
                        self._last_update_end = now
                    return out
                return run
            return wrapper

        self._wrap(core, "schedule", timed("schedule"))
        self._wrap(core.scheduler, "schedule_ahead", timed("schedule"))  # async scheduling's planned-ahead steps
        self._wrap(core, "update", timed("update"))
        self._wrap(ex, "execute", timed("execute"))

    def remove(self) -> None:
        for obj, name in reversed(self._saved):
            delattr(obj, name)  # instance attributes shadowing the class's methods
        self._saved.clear()

    def summary(self, wall: float) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        gpu = collections.Counter()
        for name, start, end in self.events:
            gpu[name.strip("_")] += start.elapsed_time(end) / 1e3
        for name in PHASES:  # CPU: host clocks stand in for device time
            if name in self.host:
                gpu[name.strip("_")] += self.host.pop(name)
        graphs = self.core.executor.graphs
        host = dict(self.host)
        return dict(
            wall_s=wall, steps=self.steps, device_s=dict(gpu),
            host_s=dict(schedule=host.get("schedule", 0.0), update=host.get("update", 0.0),
                        execute_wall=host.get("execute", 0.0),
                        thread_hop=max(0.0, host.get("await_step", 0.0) - host.get("execute", 0.0)),
                        between_steps=host.get("between_steps", 0.0)),
            aligning_share=self.aligning / max(self.running, 1),
            graph_captures_in_run=(graphs.num_captures if graphs is not None else 0) - self.captures_before,
        )


STEP_BUDGET_FIELDS = ("max_num_batched_tokens", "max_prefill_tokens_while_decoding")


def budget_kwargs(args) -> dict:
    """The step budget's EngineConfig fields that `args` gives (--max-num-batched-tokens,
    --max-prefill-tokens-while-decoding); the others keep EngineConfig's (or serve's) defaults."""
    return {name: value for name in STEP_BUDGET_FIELDS if (value := getattr(args, name, None)) is not None}


def engine_config(args, model_dir: str, name: str) -> EngineConfig:
    mode, B, s = parse_config(name, args.shallow_loops)
    return EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, mode=mode, deep_interval=B,
                        shallow_loops=s, max_num_seqs=args.N, max_model_len=args.P + args.M,
                        gpu_memory_utilization=args.gpu_memory_utilization, **budget_kwargs(args),
                        async_scheduling={"auto": None, "on": True,
                                          "off": False}[getattr(args, "async_scheduling", "auto")])


def workload(args, vocab: int, count: int | None = None,
             seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """`count` (default N) random prompts of P tokens from Random(seed), M tokens each; another seed gives
    other prompts (no shared prefix blocks: benchmarks/cold_start.py's rounds) and other sampling seeds."""
    count = args.N if count is None else count
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.P)] for _ in range(count)]
    params = [SamplingParams(max_tokens=args.M, temperature=1.0, seed=seed * 1_000_003 + i, ignore_eos=True)
              for i in range(count)]
    return prompts, params


def warm_params(args, count: int | None = None) -> list[SamplingParams]:
    count = args.N if count is None else count
    return [SamplingParams(max_tokens=min(args.M, 24), seed=10_000 + i, ignore_eos=True) for i in range(count)]


def round_prompts(args, vocab: int, round_seed: int) -> list[list[int]]:
    """A warm-up or profiled round's prompts: the timed round's own (seed 0) by default, so the rounds after
    the first find their full blocks in the prefix cache (as in every H200 run before this flag); with
    --fresh-prompts each round its own (seed `round_seed`), and the timed round prefills all of N x P."""
    return workload(args, vocab, seed=round_seed if getattr(args, "fresh_prompts", False) else 0)[0]


def prefill_counts(core, before: dict | None = None) -> dict:
    """The prefix-cache hits and computed prefill tokens so far (less `before`'s)."""
    stats = core.stats()
    return {k: stats[k] - (before or {}).get(k, 0) for k in ("prefix_cache_hits", "prefill_tokens_computed")}


def run_sync(args, model_dir: str, name: str) -> dict:
    with SyncEngine(engine_config(args, model_dir, name)) as engine:
        prompts, params = workload(args, engine.core.scheduler.config.vocab_size)
        engine.generate_batch(round_prompts(args, engine.core.scheduler.config.vocab_size, 1), warm_params(args))
        gaps = StepGaps(engine.core.executor, args.device.startswith("cuda"))
        before = prefill_counts(engine.core)
        gaps.install()
        try:
            t = time.perf_counter()
            outs = engine.generate_batch(prompts, params)
            wall = time.perf_counter() - t
        finally:
            gaps.remove()
        prefill = prefill_counts(engine.core, before)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return dict(path="sync", wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, gpu_idle=gaps.summary(),
                **prefill)


async def timed_round(engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """One concurrent generate() per prompt through `engine` (an Engine or an EnginePool): wall seconds and
    tokens generated."""
    counts = [0] * len(prompts)

    async def one(i: int) -> None:
        out = await engine.generate(prompts[i], params[i])
        counts[i] = len(out.outputs[0].token_ids)

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - t, sum(counts)


async def run_pool(args, model_dir: str, name: str) -> dict:
    """--replicas R: the async path through an ourobatch.ray.EnginePool of R replicas (one GPU each) with
    N requests per replica, so each replica runs the single-engine workload."""
    from ourobatch.ray import EnginePool

    async with EnginePool(engine_config(args, model_dir, name), num_replicas=args.replicas) as pool:
        vocab = OuroConfig.from_checkpoint(model_dir).vocab_size
        prompts, params = workload(args, vocab, args.N * args.replicas)

        await timed_round(pool, prompts, warm_params(args, len(prompts)))
        wall, tokens = await timed_round(pool, prompts, params)
    return dict(path=f"pool{args.replicas}", wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall)


async def run_async(args, model_dir: str, name: str) -> tuple[dict, dict | None]:
    async with Engine(engine_config(args, model_dir, name)) as engine:
        vocab = engine.core.scheduler.config.vocab_size
        prompts, params = workload(args, vocab)

        await timed_round(engine, round_prompts(args, vocab, 1), warm_params(args))
        gaps = StepGaps(engine.core.executor, args.device.startswith("cuda"))
        before = prefill_counts(engine.core)
        gaps.install()  # the stepping thread is idle between rounds: no step is launched while this runs
        try:
            wall, tokens = await timed_round(engine, prompts, params)
        finally:
            gaps.remove()
        plain = dict(path="async", wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, gpu_idle=gaps.summary(),
                     **prefill_counts(engine.core, before))
        if getattr(args, "no_profile", False):
            return plain, None
        probe = Probe(engine.core, args.device.startswith("cuda"))
        probe.install()
        try:
            wall_p, tokens_p = await timed_round(engine, round_prompts(args, vocab, 2), params)
        finally:
            probe.remove()
        profiled = dict(path="profiled", tokens=tokens_p, tokens_per_s=tokens_p / wall_p, **probe.summary(wall_p))
    return plain, profiled


def idle_pct(row: dict) -> str:
    share = (row.get("gpu_idle") or {}).get("gpu_idle_share")
    return "-" if share is None else f"{100 * share:.1f}%"


def markdown(rows: list[dict], profiles: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['device_name']}, torch {meta['torch']}, {meta['dtype']}: "
             f"N = {meta['N']} requests, prompt {meta['P']}, {meta['M']} tokens each, prefill included ("
             + ("each round its own prompts" if meta.get("fresh_prompts") else "the warm-up's prompts: the timed "
                "rounds find their full blocks in the prefix cache") + ").", "",
             "| config | SyncEngine tok/s | async Engine tok/s | async / sync | sync x interval 1 | "
             "async x interval 1 | GPU idle between steps: sync / async |", "|---|---|---|---|---|---|---|"]
    by = {(r["config"], r["path"]): r for r in rows}
    configs = list(dict.fromkeys(r["config"] for r in rows))
    base = {p: by.get(("interval1", p), {}).get("tokens_per_s") for p in ("sync", "async")}
    for c in configs:
        s, a = by[(c, "sync")]["tokens_per_s"], by[(c, "async")]["tokens_per_s"]
        rs = f"{s / base['sync']:.2f}" if base["sync"] else "-"
        ra = f"{a / base['async']:.2f}" if base["async"] else "-"
        idle = " / ".join(idle_pct(by[(c, p)]) for p in ("sync", "async"))
        lines.append(f"| {c} | {s:,.0f} | {a:,.0f} | {a / s:.3f} | {rs} | {ra} | {idle} |")
    lines += ["", "GPU idle between steps: the sum of the gaps between one step's last GPU work and the next "
              "one's first (CUDA events around executor.launch; host clocks on the CPU), as a share of the "
              "timed round's step phase (benchmarks/gpu_idle.py).", ""]
    if not profiles:
        return "\n".join(lines) + "\n"
    lines += ["Where the profiled async run's wall time goes (ms per step; device parts from CUDA events, "
              "host parts from clocks; the device and host parts overlap only inside execute; with async "
              "scheduling the steps run through launch, so execute is 0 and schedule / update overlap the "
              "device):", "",
              "| config | steps | wall | prefill | shallow | deep | sample | execute (worker) | schedule | update | "
              "thread hop | between steps | aligning share | captures in run |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        n = max(p["steps"], 1)
        d, h = p["device_s"], p["host_s"]

        def ms(x: float) -> str:
            return f"{1e3 * x / n:.2f}"
        deep = d.get("deep", 0.0) + d.get("deep_verify", 0.0)
        lines.append(f"| {p['config']} | {p['steps']} | {ms(p['wall_s'])} | {ms(d.get('prefill', 0.0))} | "
                     f"{ms(d.get('shallow', 0.0))} | {ms(deep)} | {ms(d.get('sample', 0.0))} | "
                     f"{ms(h['execute_wall'])} | {ms(h['schedule'])} | {ms(h['update'])} | {ms(h['thread_hop'])} | "
                     f"{ms(h['between_steps'])} | {p['aligning_share']:.3f} | {p['graph_captures_in_run']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--out", required=True, help="folder for public_path.json and public_path.md")
    ap.add_argument("--configs", default="interval1,deferred4,deferred8")
    ap.add_argument("-N", type=int, default=64, help="concurrent requests")
    ap.add_argument("-P", type=int, default=512, help="prompt tokens")
    ap.add_argument("-M", type=int, default=256, help="output tokens per request")
    ap.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                    help="EngineConfig.async_scheduling: auto (None: on for CUDA), on, off")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engines' step budget (default: EngineConfig's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shallow-loops", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--fresh-prompts", action="store_true", help="each round (warm-up, timed, profiled) its "
                    "own prompts: the timed round prefills all N x P tokens (default: the warm-up's prompts, whose "
                    "full blocks the timed round finds in the prefix cache, as in the earlier H200 runs)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled async run (time: the "
                    "timed runs and their gpu_idle_share only)")
    ap.add_argument("--replicas", type=int, default=0, help="R >= 1: only the async path, through an "
                    "ourobatch.ray.EnginePool of R replicas (one GPU each), N requests per replica")
    args = ap.parse_args(argv)
    if args.replicas < 0:
        ap.error(f"--replicas must be >= 0, got {args.replicas}")
    names = check_configs(ap, args.configs, args.shallow_loops)
    for field in ("N", "P", "M"):
        if getattr(args, field) < 1:
            ap.error(f"-{field} must be >= 1, got {getattr(args, field)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_checkpoint(args)
    meta = dict(date=datetime.date.today().isoformat(), device=args.device, dtype=args.dtype, N=args.N, P=args.P,
                M=args.M, torch=torch.__version__, async_scheduling=args.async_scheduling,
                fresh_prompts=args.fresh_prompts,
                device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor())
    rows, profiles = [], []
    if args.replicas:
        meta["replicas"] = args.replicas
        for name in names:
            rows.append(dict(config=name, **anyio.run(run_pool, args, model_dir, name)))
            print(json.dumps(rows[-1]), flush=True)
        (out / "public_path.json").write_text(json.dumps(dict(meta=meta, rows=rows, profiles=[])))
        return 0
    for name in names:
        rows.append(dict(config=name, **run_sync(args, model_dir, name)))
        plain, profiled = anyio.run(run_async, args, model_dir, name)
        rows.append(dict(config=name, **plain))
        if profiled is not None:
            profiles.append(dict(config=name, **profiled))
        print(json.dumps(rows[-2:] + (profiles[-1:] if profiled is not None else [])), flush=True)
        (out / "public_path.json").write_text(json.dumps(dict(meta=meta, rows=rows, profiles=profiles)))
    md = markdown(rows, profiles, meta)
    (out / "public_path.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
