"""The host's share of a decode step: schedule() and update() per step, with and without async scheduling.

Torch-free: the engine is a stand-in executor that returns every sampled token at once (never an eos),
so what is timed is the scheduler alone, the part that sits between two GPU steps without async
scheduling and beside the running step with it. N requests of P prompt tokens decode M tokens each
(interval 1 = full depth, and deferred B = 8); only pure decode steps are timed (no prefill in the plan).
With async scheduling "schedule" is ``Scheduler.schedule_ahead`` (the pending tokens, the rules of
lookahead.py, the plan). A shared host's load moves CPU times a lot: ``--repeat`` keeps each row's fastest
run, and ``--profile`` adds each row's Python function calls per decode step (counted under cProfile, which
no load changes; ``--verbose`` prints the top functions too).

    python benchmarks/host_step.py --out results/host_step --repeat 3 --profile   # N = 64, 256: JSON + table
    python benchmarks/host_step.py --ns 256 --configs interval1 --profile --verbose
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.config import SchedulerConfig  # noqa: E402
from ourobatch.runtime.engine_core import EngineCore  # noqa: E402
from scheduler.params import SamplingParams  # noqa: E402
from scheduler.plan import SampledToken, StepPlan, StepResult  # noqa: E402

CONFIGS = {"interval1": ("deferred", 1), "deferred8": ("deferred", 8)}


class InstantExecutor:
    """Every sampled token at once: the token index as the token (never the eos 0), log-prob -1."""

    def execute(self, plan: StepPlan) -> StepResult:
        sampled = [SampledToken(w.request_id, 1 + w.sample.token_index % 1000, -1.0, w.sample.loop)
                   for w in (*plan.prefills, *plan.shallow, *plan.deep) if w.sample is not None]
        return StepResult(plan.step_id, tuple(sampled))


class Timed:
    """CPU time of the calling thread in each call of a method (not the time other processes of a shared
    host take meanwhile), for the steps `active()` says to count."""

    def __init__(self, obj, name: str, active) -> None:
        self.calls: list[float] = []
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            out = inner(*args, **kwargs)
            if active(out if name != "update" else args[0]):
                self.calls.append(time.thread_time() - start)
            return out

        setattr(obj, name, timed)


def is_decode(plan) -> bool:
    return plan is not None and not plan.prefills and bool(plan.shallow or plan.deep)


def run(config: str, N: int, P: int, M: int, lookahead: bool, profile: bool) -> dict:
    mode, B = CONFIGS[config]
    blocks = N * -(-(P + M) // 16) + 8
    sched_config = SchedulerConfig(num_kv_blocks=blocks, block_size=16, max_num_seqs=N, max_model_len=P + M,
                                   max_num_batched_tokens=max(8192, N * P), total_ut_steps=4, shallow_loops=2,
                                   deep_interval=B, mode=mode, vocab_size=50_000, eos_token_ids=frozenset({0}))
    kwargs = {"async_scheduling": True} if lookahead else {}  # (without it also on a tree before async scheduling)
    core = EngineCore(sched_config, InstantExecutor(), **kwargs)
    sched = core.scheduler
    planned = Timed(sched, "schedule_ahead" if lookahead else "schedule", is_decode)
    updated = Timed(sched, "update", is_decode)
    for i in range(N):
        core.add([1 + (i * 7 + t) % 999 for t in range(P)], SamplingParams(max_tokens=M, seed=i, ignore_eos=True))
    while sched.counters.prefills < N:  # every prompt prefilled: from here on, pure decode
        core.step()
    profiler = cProfile.Profile() if profile else None
    start = time.thread_time()
    if profiler:
        profiler.enable()
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
    if profiler:
        profiler.disable()
    wall = time.thread_time() - start
    sched_us = [1e6 * t for t in planned.calls]
    upd_us = [1e6 * t for t in updated.calls]
    row = dict(config=config, N=N, prompt=P, tokens=M, async_scheduling=lookahead, decode_steps=len(upd_us),
               schedule_us=statistics.mean(sched_us), update_us=statistics.mean(upd_us),
               schedule_p90_us=sorted(sched_us)[int(0.9 * len(sched_us))],
               update_p90_us=sorted(upd_us)[int(0.9 * len(upd_us))],
               host_us_per_step=1e6 * wall / max(steps, 1),
               lookahead_steps=getattr(sched.counters, "lookahead_steps", 0),
               lookahead_drains=dict(getattr(sched, "drain_reasons", {})))
    if profiler:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        row["python_calls_per_step"] = round(stats.total_calls / max(steps, 1))  # deterministic, unlike the times
        stats.sort_stats("tottime").print_stats(18)
        row["profile"] = out.getvalue()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| config | N | async scheduling | schedule us | update us | host CPU us / step (whole loop) | "
             "Python calls / step | steps planned ahead |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['N']} | {'on' if r['async_scheduling'] else 'off'} | "
                     f"{r['schedule_us']:.0f} | {r['update_us']:.0f} | {r['host_us_per_step']:.0f} | "
                     f"{r.get('python_calls_per_step', '-')} | {r['lookahead_steps']} / {r['decode_steps']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="64,256", help="requests decoding at once (comma-separated)")
    ap.add_argument("--configs", default="interval1,deferred8", help=f"of {sorted(CONFIGS)}")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    ap.add_argument("--profile", action="store_true", help="one more run of each row under cProfile: its Python "
                    "calls per step (a measure the host's load does not move) and, --verbose, its top functions")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each row; the fastest is kept (a noisy host)")
    ap.add_argument("--sync-only", action="store_true", help="only async_scheduling off (a tree without it)")
    ap.add_argument("--out", type=Path, default=None, help="folder for host_step.json and host_step.md")
    args = ap.parse_args(argv)
    rows = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            ap.error(f"--configs: {config!r} is not one of {sorted(CONFIGS)}")
        for N in (int(n) for n in args.ns.split(",")):
            for lookahead in (False,) if args.sync_only else (False, True):
                runs = [run(config, N, args.prompt, args.tokens, lookahead, False) for _ in range(args.repeat)]
                row = min(runs, key=lambda r: r["host_us_per_step"])
                if args.profile:
                    profiled = run(config, N, args.prompt, args.tokens, lookahead, True)
                    row["python_calls_per_step"] = profiled["python_calls_per_step"]
                    if args.verbose:
                        print(profiled["profile"])
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_step.json").write_text(json.dumps(rows, indent=1))
        (args.out / "host_step.md").write_text(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
