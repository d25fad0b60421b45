"""Synchronous RL loop against continuous collection (ourobatch.rollout.Collector), one engine per config.

The GRPO workload of benchmarks/rollout.py, --batches times over: each batch is R prompts of P tokens x
n samples, each sample ending at a length drawn from a seeded lognormal (median, sigma; capped at
--max-tokens) the way an EOS would end it: the client aborts the request when its stream reaches the
drawn length, so the engine cannot know the lengths in advance. Every sample is its own n=1 request in
both loops (the collector submits them that way), and every run of every config consumes the same
R x batches tasks with the same lengths, hence the same tokens.

A simulated learner takes each batch, "trains" for --train-s seconds (``anyio.sleep``: the engine keeps
stepping meanwhile if it has work) and pushes a full set of same-shape weights (``update_weights``),
alternating two perturbed copies of the checkpoint built on the engine's device before anything is timed.

- sync: generate the whole batch, train, ``pause("keep")`` + ``update_weights`` + ``resume``; repeat.
- collector: ``Collector(max_staleness=eta, on_update=policy)`` over the same tasks, the same learner
  training on each batch it yields and pushing through ``collector.update_weights``.

Per run: consumed tokens/s over the whole run (tokens of the consumed batches / time from the first
submit to the end of the learner's last step, training and pushes included), the same over the steady
window (from the hand-over of batch 0 to the hand-over of batch K-2: batches 1..K-2, without the first
batch's ramp-up nor the last batch's drain), mean running samples and the share of time a step is in
flight (``engine.stats()`` sampled every --sample-interval s), the staleness histogram of consumed tokens
and the mixed-version share of samples. JSON, a markdown table and a plot of running samples over time.

    python benchmarks/rl_pipeline.py --out results/rl                    # H200: the issue's workload (long)
    python benchmarks/rl_pipeline.py --tiny --device cpu --out /tmp/rl    # CPU smoke test, small numbers
    bash benchmarks/gpu_suite.sh rl_pipeline                              # one 10-minute device call
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import anyio
import torch
from tqdm.auto import tqdm

from ourobatch import Engine, EngineConfig
from ourobatch.assembly import resolve_dtype
from engine.config import OuroConfig
from ourobatch.rollout import Collector

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import add_checkpoint_args, check_configs, ensure_checkpoint, parse_config  # noqa: E402
import provenance  # noqa: E402
from rl_pipeline_parts import CappedEngine, Learner, make_tasks, perturbed_copies, sample_params  # noqa: E402
from rl_pipeline_report import add_ratios, brief, headline, markdown, plot, summarize  # noqa: E402

POLICIES = ("continue", "recompute", "abort")
H200 = dict(prompts=32, n=8, prompt_len=512, max_tokens=2048, median=400.0, train_s=10.0, batches=5)
TINY = dict(prompts=2, n=2, prompt_len=8, max_tokens=16, median=6.0, train_s=0.05, batches=5)
STATS_DELTAS = ("tokens_generated", "preemptions", "prefill_tokens_computed", "prefill_tokens_requested",
                "engine_steps")


# ---------------------------------------------------------------------- one run

class Recorder:
    """Timestamps and contents of the consumed batches, and the sampled engine stats."""

    def __init__(self, engine: Engine, learner: Learner, interval: float) -> None:
        self.engine, self.learner, self.interval = engine, learner, interval
        self.t0 = time.perf_counter()
        self.batches: list[dict] = []
        # (t, num_running, step_in_flight, num_waiting, tokens generated since the run began)
        self.trace: list[tuple[float, int, int, int, int]] = []
        self.histogram: Counter[int] = Counter()  # consumed tokens by staleness, counted here
        self.mixed = 0
        self.before = engine.stats()
        self.finished = anyio.Event()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def monitor(self) -> None:
        while not self.finished.is_set():
            s = self.engine.stats()
            self.trace.append((self.now(), s["num_running"], int(s["step_in_flight"]), s["num_waiting"],
                               s["tokens_generated"] - self.before["tokens_generated"]))
            with anyio.move_on_after(self.interval):
                await self.finished.wait()

    def consumed(self, groups: list[list[Any]]) -> None:
        """groups: the samples (anything with token_ids and weight_versions) of each group of the batch."""
        tokens = 0
        for samples in groups:
            for s in samples:
                tokens += len(s.token_ids)
                self.mixed += len(set(s.weight_versions)) > 1
                for v in s.weight_versions:
                    self.histogram[self.learner.staleness(v)] += 1
        self.batches.append(dict(t_consumed=self.now(), tokens=tokens, group_sizes=[len(g) for g in groups],
                                 weight_version=self.learner.version))

    def trained(self) -> None:
        self.batches[-1]["t_trained"] = self.now()


async def sync_run(engine: Engine, tasks: list[dict], args, learner: Learner, rec: Recorder, tag: str) -> None:
    capped = CappedEngine(engine, tasks)
    params = sample_params(args)
    R, n = args.prompts, args.n

    async def push(named: list) -> int:
        await engine.pause("keep")
        try:
            return await engine.update_weights(named)
        finally:
            await engine.resume()

    bar = tqdm(total=args.batches, desc=f"{tag} sync", unit="batch", leave=False)
    for k in range(args.batches):
        outs: dict[tuple[int, int], Any] = {}

        async def one(j: int, i: int, task: dict) -> None:
            seed = 1_000_003 * (k * R + j) + i
            outs[j, i] = await capped.generate(task["prompt_token_ids"], params.with_seed(seed),
                                               f"{tag}-sync-{k}-{j}-{i}")

        async with anyio.create_task_group() as tg:
            for j, task in enumerate(tasks[k * R:(k + 1) * R]):
                for i in range(n):
                    tg.start_soon(one, j, i, task)
        rec.consumed([[outs[j, i].outputs[0] for i in range(n)] for j in range(R)])
        await learner.step(push)
        rec.trained()
        bar.update(1)
    bar.close()


async def collector_run(engine: Engine, tasks: list[dict], args, learner: Learner, rec: Recorder, tag: str,
                        eta: int, policy: str) -> dict:
    capped = CappedEngine(engine, tasks)
    bar = tqdm(total=args.batches, desc=f"{tag} eta={eta} {policy}", unit="batch", leave=False)
    async with Collector(capped, tasks, n=args.n, params=sample_params(args), groups_per_batch=args.prompts,
                         max_staleness=eta, on_update=policy, seed=args.seed,
                         occupancy_interval_s=args.sample_interval) as collector:
        async for batch in collector:
            rec.consumed([g.samples for g in batch.groups])
            await learner.step(lambda named: collector.update_weights(named))
            rec.trained()
            bar.update(1)
            if len(rec.batches) == args.batches:
                break
        stats = collector.stats()
    bar.close()
    stats["occupancy"] = collector.occupancy
    return stats


async def timed_run(engine: Engine, tasks: list[dict], args, learner: Learner, tag: str,
                    eta: int | None = None, policy: str | None = None) -> dict:
    await engine.reset_prefix_cache()
    learner.start(engine.stats()["weight_version"])
    rec = Recorder(engine, learner, args.sample_interval)
    collector_stats = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.monitor)
        if eta is None:
            await sync_run(engine, tasks, args, learner, rec, tag)
        else:
            collector_stats = await collector_run(engine, tasks, args, learner, rec, tag, eta, policy)
        rec.finished.set()
    after = engine.stats()
    row = summarize(rec, args, learner)
    row.update(loop="sync" if eta is None else "collector", eta=eta, policy=policy,
               **{k: after[k] - rec.before[k] for k in STATS_DELTAS})
    row["generated_over_consumed"] = row["tokens_generated"] / max(row["tokens"], 1)
    if collector_stats is not None:
        hist = {int(k): v for k, v in collector_stats["staleness_histogram"].items()}
        row["staleness_histogram"] = hist
        row["collector"] = {k: v for k, v in collector_stats.items()
                            if k not in ("staleness_histogram", "occupancy")}
        row["collector_occupancy"] = collector_stats["occupancy"]
        row["mixed_version_samples"] = collector_stats["mixed_version_samples"]
    else:
        row["staleness_histogram"] = row["staleness_histogram_check"]
        row["mixed_version_samples"] = rec.mixed
    total = sum(row["staleness_histogram"].values())
    row["share_tokens_1_old"] = row["staleness_histogram"].get(1, 0) / max(total, 1)
    row["mixed_sample_share"] = row["mixed_version_samples"] / max(row["samples"], 1)
    return row


# ---------------------------------------------------------------------- one engine per config

def plan_runs(args) -> list[tuple[int | None, str | None]]:
    """(eta, policy) per run, (None, None) for sync. The headline pair (collector at eta 1 / continue, then
    sync) runs first, so a --time-limit-s that cuts the plan short cuts the rest."""
    runs = [(e, p) for e in args.etas for p in args.policies]
    head = [(1, "continue")] if (1, "continue") in runs else []
    return head + ([(None, None)] if args.sync else []) + [r for r in runs if r not in head]


async def run_config(model_dir: str, args, name: str, copies, started: float, done_walls: list[float],
                     rows: list[dict], skipped: list[str], save: Callable[[], None]) -> None:
    mode, B, s = parse_config(name, args.shallow_loops)
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, mode=mode, deep_interval=B,
                       shallow_loops=s, max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.max_tokens,
                       gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
                       block_size=args.block_size)
    runs = plan_runs(args)
    if args.time_limit_s and time.perf_counter() - started + 1.1 * max(done_walls, default=0.0) > args.time_limit_s:
        skipped += [f"{name} " + ("sync" if eta is None else f"eta={eta} {policy}") for eta, policy in runs]
        return  # not even one run would fit: do not start the engine
    learner = Learner(copies, args.train_s)
    t_start = time.perf_counter()
    async with Engine(cfg) as engine:
        vocab = OuroConfig.from_checkpoint(model_dir).vocab_size
        warm = make_tasks(args, vocab, seed=99, median=max(2, args.median / 10))[:args.prompts]
        warm_args = argparse.Namespace(**{**vars(args), "batches": 1, "train_s": 0.0})
        await timed_run(engine, warm, warm_args, learner, f"{name}-warm")  # graphs and kernels, untimed
        startup_s = time.perf_counter() - t_start
        tasks = make_tasks(args, vocab, seed=args.seed, median=args.median)
        for eta, policy in runs:
            label = f"{name} " + ("sync" if eta is None else f"eta={eta} {policy}")
            estimate = max(done_walls, default=0.0) * 1.1
            if args.time_limit_s and time.perf_counter() - started + estimate > args.time_limit_s:
                skipped.append(label)
                print(f"skipped {label}: ~{estimate:.0f}s would pass --time-limit-s {args.time_limit_s}",
                      file=sys.stderr)
                continue
            tag = f"{name}-{len(rows)}"
            row = await timed_run(engine, tasks, args, learner, tag, eta, policy)
            row.update(config=name, mode=mode, deep_interval=B, shallow_loops=s, startup_s=startup_s)
            done_walls.append(row["wall_s"])
            rows.append(row)
            print(json.dumps(brief(row)), flush=True)
            save()


# ---------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, their defaults filled in (the H200 workload, or --tiny's), and the config names."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--out", required=True, help="folder for rl_pipeline.json, rl_pipeline.md, rl_pipeline_running.png")
    ap.add_argument("--configs", default="interval1,deferred4,deferred8")
    ap.add_argument("--etas", default="0,1,2", help="max_staleness values of the collector runs")
    ap.add_argument("--policies", default=",".join(POLICIES), help="on_update policies of the collector runs")
    ap.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True, help="run the synchronous loop")
    for name, kind in (("prompts", int), ("n", int), ("prompt-len", int), ("max-tokens", int), ("median", float),
                       ("train-s", float), ("batches", int)):
        key = name.replace("-", "_")
        ap.add_argument(f"--{name}", type=kind, default=None,
                        help=f"default {H200[key]} ({TINY[key]} with --tiny)")
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="pool size (default: sized from memory)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--shallow-loops", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--sample-interval", type=float, default=0.05, help="seconds between stats samples")
    ap.add_argument("--time-limit-s", type=float, default=None,
                    help="skip a run when (time so far + 1.1 x the longest run yet) would pass this")
    args = ap.parse_args(argv)
    for key, value in (TINY if args.tiny else H200).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batches < 3:
        ap.error(f"--batches must be >= 3 (the steady window is batches 1..K-2), got {args.batches}")
    if not args.train_s >= 0:
        ap.error(f"--train-s must be >= 0, got {args.train_s}")
    names = check_configs(ap, args.configs, args.shallow_loops)
    try:
        args.etas = [int(e) for e in args.etas.split(",") if e != ""]
    except ValueError:
        ap.error(f"--etas takes comma-separated ints >= 0, got {args.etas!r}")
    if any(e < 0 for e in args.etas):
        ap.error(f"--etas takes ints >= 0, got {args.etas}")
    args.policies = [p for p in args.policies.split(",") if p != ""]
    for p in args.policies:
        if p not in POLICIES:
            ap.error(f"--policies takes {', '.join(POLICIES)}, got {p!r}")
    return args, names


def main(argv: list[str] | None = None) -> int:
    args, names = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model_dir = ensure_checkpoint(args)
    dtype = resolve_dtype(EngineConfig(model=model_dir, device=args.device, dtype=args.dtype))
    copies = perturbed_copies(model_dir, dtype, args.device)  # built once, before any engine or clock
    meta = dict(date=datetime.date.today().isoformat(), device=args.device, dtype=str(dtype).removeprefix("torch."),
                device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
                torch=torch.__version__, prompts=args.prompts, n=args.n, prompt_len=args.prompt_len,
                max_tokens=args.max_tokens, median=args.median, sigma=args.sigma, seed=args.seed,
                train_s=args.train_s, batches=args.batches, max_num_seqs=args.max_num_seqs,
                sample_interval=args.sample_interval, etas=args.etas, policies=args.policies, skipped=[],
                steady_window="from the hand-over of batch 0 to the hand-over of batch K-2 (batches 1..K-2)",
                commit=provenance.commit())
    rows: list[dict] = []
    walls: list[float] = []

    def save() -> None:
        add_ratios(rows)
        (out / "rl_pipeline.json").write_text(json.dumps(dict(meta=meta, rows=rows)))

    for name in names:
        anyio.run(run_config, model_dir, args, name, copies, started, walls, rows, meta["skipped"], save)
    save()
    (out / "rl_pipeline.md").write_text(markdown(rows, meta))
    plot(rows, out / "rl_pipeline_running.png")
    print(markdown(rows, meta))
    print(headline(rows, args.max_num_seqs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
