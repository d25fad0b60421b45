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
import dataclasses
import datetime
import json
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
import torch
from tqdm.auto import tqdm

from ourobatch import Engine, EngineConfig, SamplingParams
from ourobatch.assembly import resolve_dtype
from engine.config import OuroConfig
from engine.loader import load_state_dict
from ourobatch.rollout import Collector
from scheduler.params import RequestOutputKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import draw_lengths  # noqa: E402
from throughput import add_checkpoint_args, check_configs, ensure_checkpoint, parse_config  # noqa: E402
import provenance  # noqa: E402

POLICIES = ("continue", "recompute", "abort")
H200 = dict(prompts=32, n=8, prompt_len=512, max_tokens=2048, median=400.0, train_s=10.0, batches=5)
TINY = dict(prompts=2, n=2, prompt_len=8, max_tokens=16, median=6.0, train_s=0.05, batches=5)
STATS_DELTAS = ("tokens_generated", "preemptions", "prefill_tokens_computed", "prefill_tokens_requested",
                "engine_steps")


# ---------------------------------------------------------------------- the workload

def make_tasks(args, vocab: int, seed: int, median: float) -> list[dict]:
    """batches x R tasks: a prompt (unique) and the n drawn lengths of its samples."""
    rng = random.Random(seed)
    tasks, seen = [], set()
    while len(tasks) < args.batches * args.prompts:
        prompt = tuple(rng.randrange(1, vocab) for _ in range(args.prompt_len))
        if prompt in seen:  # the length cap finds a sample's target by its prompt
            continue
        seen.add(prompt)
        tasks.append(dict(prompt_token_ids=list(prompt),
                          targets=draw_lengths(rng, args.n, median, args.sigma, args.max_tokens)))
    return tasks


class CappedEngine:
    """The engine as both loops see it, where each sample ends at its drawn length.

    generate() streams the request and aborts it once it holds its target tokens, then reports the
    first `target` tokens with finish_reason "stop" (rollout.py's per-completion abort, seen as an
    EOS). A sample's target is found by (prompt, seed): the k-th distinct seed of a prompt gets its k-th
    length, and the same seed always the same one, so a restarted or regenerated sample keeps its
    length. Everything else is the engine's own call."""

    def __init__(self, engine: Engine, tasks: list[dict]) -> None:
        self._engine = engine
        self._free = {tuple(t["prompt_token_ids"]): list(t["targets"]) for t in tasks}
        self._targets: dict[tuple, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def target(self, prompt: list[int], seed: int | None) -> int:
        key = (tuple(prompt), seed)
        if key not in self._targets:
            free = self._free[key[0]]
            if not free:
                raise RuntimeError(f"more distinct seeds than samples for one prompt (seed {seed}): a task's "
                                   f"samples must keep one seed each")
            self._targets[key] = free.pop(0)
        return self._targets[key]

    async def generate(self, prompt_token_ids, params=None, request_id: str | None = None):
        params = SamplingParams.coerce(params)
        target = self.target(prompt_token_ids, params.seed)
        tokens: list[int] = []
        logprobs: list[float] = []
        loops: list[int] = []
        versions: list[int] = []
        last = None
        cut = False
        delta = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        async with self._engine.stream(prompt_token_ids, delta, request_id=request_id) as stream:
            async for out in stream:
                c = out.outputs[0]
                last = out
                tokens += c.token_ids
                logprobs += c.logprobs
                loops += c.readout_loops
                versions += c.weight_versions
                if not cut and len(tokens) >= target:
                    cut = True  # the sample's "EOS": later tokens of this step and the next are dropped
                    await self._engine.abort(out.request_id)
        assert last is not None, "a stream ends with a final output"
        c = last.outputs[0]
        finish = ("length" if target >= params.max_tokens else "stop") if cut else c.finish_reason
        t = target if cut else len(tokens)
        done = dataclasses.replace(c, token_ids=tokens[:t], logprobs=logprobs[:t], readout_loops=loops[:t],
                                   weight_versions=versions[:t], cumulative_logprob=sum(logprobs[:t]),
                                   finish_reason=finish)
        return dataclasses.replace(last, outputs=[done], finished=True)


def sample_params(args) -> SamplingParams:
    return SamplingParams(n=1, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)


# ---------------------------------------------------------------------- the learner

def perturbed_copies(model_dir: str, dtype: torch.dtype, device: str, count: int = 2,
                     scale: float = 0.01) -> list[list[tuple[str, torch.Tensor]]]:
    """`count` full sets of (HF name, tensor): the checkpoint's tensors x (1 + scale x noise), on `device`."""
    base = load_state_dict(model_dir, OuroConfig.from_checkpoint(model_dir), dtype, device)
    gen = torch.Generator(device=device).manual_seed(1234)
    copies: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(count)]
    for name, t in base.items():
        for copy in copies:
            noise = torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32)
            copy.append((name, (t.float() * (1 + scale * noise)).to(dtype)))
    del base
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return copies


class Learner:
    """Trains on a batch for train_s seconds (a sleep), then pushes the next weight copy."""

    def __init__(self, copies: list[list[tuple[str, torch.Tensor]]], train_s: float) -> None:
        self.copies, self.train_s = copies, train_s
        self.num_steps = 0
        self.push_s: list[float] = []
        self.ordinals: dict[int, int] = {}  # weight version -> updates before it, in this run
        self.version = 0

    def start(self, version: int) -> None:
        self.ordinals = {version: 0}
        self.version = version
        self.push_s = []

    async def step(self, push: Callable[[list], Awaitable[int]]) -> None:
        await anyio.sleep(self.train_s)
        named = self.copies[self.num_steps % len(self.copies)]
        self.num_steps += 1
        t = time.perf_counter()
        self.version = await push(named)
        self.push_s.append(time.perf_counter() - t)
        self.ordinals[self.version] = len(self.ordinals)

    def staleness(self, version: int) -> int:
        return self.ordinals[self.version] - self.ordinals[version]  # KeyError: a token from outside the run


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


def summarize(rec: Recorder, args, learner: Learner) -> dict:
    b = rec.batches
    tokens = sum(x["tokens"] for x in b)
    wall = b[-1].get("t_trained", rec.now()) if b else rec.now()
    row = dict(batches=len(b), tokens=tokens, samples=sum(sum(x["group_sizes"]) for x in b), wall_s=wall,
               tokens_per_s=tokens / wall, batch_records=b, trace=rec.trace,
               mean_running=_window_mean(rec.trace, 1, 0.0, wall),
               peak_running=max((p[1] for p in rec.trace), default=0),
               busy_share=_window_mean(rec.trace, 2, 0.0, wall), push_s_mean=sum(learner.push_s) / max(len(learner.push_s), 1),
               staleness_histogram_check=dict(sorted(rec.histogram.items())), mixed_version_samples_check=rec.mixed)
    if len(b) >= 3:  # the steady window: from batch 0's hand-over to batch K-2's (batches 1..K-2)
        a, z = b[0]["t_consumed"], b[-2]["t_consumed"]
        row.update(steady_window_s=[a, z], steady_tokens_per_s=sum(x["tokens"] for x in b[1:-1]) / (z - a),
                   steady_mean_running=_window_mean(rec.trace, 1, a, z), steady_busy_share=_window_mean(rec.trace, 2, a, z),
                   # what the engine generated in the window (consumed tokens there may come from before it)
                   steady_generated_tokens_per_s=(_generated_at(rec.trace, z) - _generated_at(rec.trace, a)) / (z - a))
    return row


def _generated_at(trace: list, t: float) -> int:
    """Tokens generated by time t: the last trace sample at or before t."""
    return max((p[4] for p in trace if p[0] <= t), default=0)


def _window_mean(trace: list, col: int, a: float, z: float) -> float:
    """Time mean of trace[col] over [a, z], each sample holding until the next."""
    total = 0.0
    for p, q in zip(trace, trace[1:] + [(float("inf"),)]):
        lo, hi = max(p[0], a), min(q[0], z)
        if hi > lo:
            total += (hi - lo) * p[col]
    return total / (z - a) if z > a else 0.0


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


def brief(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("trace", "batch_records", "collector_occupancy")}


def add_ratios(rows: list[dict]) -> None:
    sync = {r["config"]: r for r in rows if r["loop"] == "sync"}
    for r in rows:
        base = sync.get(r["config"])
        if base is not None:
            r["x_sync"] = r["tokens_per_s"] / base["tokens_per_s"]
            if "steady_tokens_per_s" in r and "steady_tokens_per_s" in base:
                r["steady_x_sync"] = r["steady_tokens_per_s"] / base["steady_tokens_per_s"]


# ---------------------------------------------------------------------- report

def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['device_name']}, commit {meta['commit']}, torch {meta['torch']}, "
             f"{meta['dtype']}: {meta['batches']} batches of {meta['prompts']} prompts x n={meta['n']}, prompt "
             f"{meta['prompt_len']}, cap {meta['max_tokens']}, lengths lognormal(median {meta['median']}, sigma "
             f"{meta['sigma']}), train {meta['train_s']} s per batch, seed {meta['seed']}. Steady: batches 1..K-2, "
             f"from batch 0's hand-over to batch K-2's.", "",
             "| config | loop | eta | on_update | wall s | tok/s | steady tok/s | x sync | steady x sync | "
             "mean running | steady mean running | busy | steady busy | tokens by staleness 0/1/2 | 1-old share | "
             "mixed samples | generated / consumed | push s | steady generated tok/s | busy ms / generated token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hist = r["staleness_histogram"]
        stale = "/".join(str(hist.get(k, 0)) for k in range(max(3, max(hist, default=0) + 1)))
        lines.append(
            f"| {r['config']} | {r['loop']} | {'-' if r['eta'] is None else r['eta']} | {r['policy'] or '-'} | "
            f"{r['wall_s']:.1f} | {r['tokens_per_s']:.0f} | {r.get('steady_tokens_per_s', float('nan')):.0f} | "
            f"{r.get('x_sync', float('nan')):.2f} | {r.get('steady_x_sync', float('nan')):.2f} | "
            f"{r['mean_running']:.1f} | {r.get('steady_mean_running', float('nan')):.1f} | {r['busy_share']:.0%} | "
            f"{r.get('steady_busy_share', float('nan')):.0%} | {stale} | {r['share_tokens_1_old']:.0%} | "
            f"{r['mixed_version_samples']} / {r['samples']} | {r['generated_over_consumed']:.2f} | "
            f"{r['push_s_mean']:.3f} | {r.get('steady_generated_tokens_per_s', float('nan')):.0f} | "
            f"{1e3 * r['wall_s'] * r['busy_share'] / max(r['tokens_generated'], 1):.3f} |")
    if meta.get("skipped"):
        lines += ["", "Not run (--time-limit-s): " + ", ".join(meta["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def headline(rows: list[dict], max_num_seqs: int) -> str:
    lines = []
    for config in dict.fromkeys(r["config"] for r in rows):
        for r in rows:
            if r["config"] == config and r["loop"] == "collector" and r["eta"] in (0, 1) and "x_sync" in r:
                lines.append(f"{config}: collector(eta={r['eta']}, {r['policy']}) / sync = {r['x_sync']:.2f}x "
                             f"consumed tok/s, {r.get('steady_x_sync', float('nan')):.2f}x steady; steady mean "
                             f"running {r.get('steady_mean_running', float('nan')):.0f} of {max_num_seqs}")
    lines.append("(target on the H200: eta=1 >= 1.5x for interval1 and deferred8 with steady mean running >= 200 "
                 "of 256; eta=0 >= 1.0x)")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(len(configs), 1, figsize=(9, 3.2 * max(len(configs), 1)), squeeze=False)
    for ax, config in zip(axes[:, 0], configs):
        for r in rows:
            if r["config"] != config or not (r["loop"] == "sync" or (r["eta"], r["policy"]) == (1, "continue")):
                continue
            label = "sync" if r["loop"] == "sync" else "collector, eta=1, continue"
            line, = ax.plot([x[0] for x in r["trace"]], [x[1] for x in r["trace"]], label=label, lw=1)
            for b in r["batch_records"]:
                ax.axvline(b["t_consumed"], color=line.get_color(), ls=":", lw=0.6)
        ax.set_title(f"{config} (dotted: a batch handed to the learner)", fontsize=9)
        ax.set_ylabel("running samples")
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the first submit")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ---------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
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
