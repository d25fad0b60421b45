"""An RL rollout batch through the public async Engine: R prompts x n samples with long-tailed lengths.

The workload of a GRPO step: R prompts of P tokens, `n` samples each (SamplingParams.n), max_tokens a
cap, and each sample ending at a length drawn from a seeded lognormal (median, sigma), as an EOS would
end it: the client aborts that one completion (``engine.abort("{request_id}:{index}")``) when its stream
reaches the drawn length, so the engine cannot know the lengths in advance. Every config runs the same
workload in one process, one after another: interval 1 (full depth), deferred B=4 and B=8 by default,
each with the lazy KV policy (default) and the reserve-everything policy (`kv_allocation="reserve"`,
the control). A smaller round first warms each engine's CUDA graphs.

Per run: makespan, tokens/s, mean and peak running requests, preemptions, prefill tokens computed vs
requested, prefix-cache hits, and KV utilisation / running requests over time (PNG).

    python benchmarks/rollout.py --out results/rollout                      # H200: the issue's workload
    python benchmarks/rollout.py --device cpu --tiny --prompts 3 --n 2 --prompt-len 8 --max-tokens 24 \\
        --median 8 --out /tmp/r                                               # CPU smoke test
    python benchmarks/rollout.py --out results/rollout_r2 --replicas 2        # 2 replicas, ourobatch.ray
                                                                              # (docs/scaling.md)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import anyio
import torch

from ourobatch import Engine, EngineConfig, SamplingParams
from engine.config import OuroConfig
from scheduler.params import RequestOutputKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import add_checkpoint_args, check_configs, ensure_checkpoint, parse_config  # noqa: E402
import provenance  # noqa: E402
from public_path import budget_kwargs  # noqa: E402
from bench_plot import pyplot  # noqa: E402


def draw_lengths(rng: random.Random, count: int, median: float, sigma: float, cap: int) -> list[int]:
    return [max(1, min(cap, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))) for _ in range(count)]


def workload(args, vocab: int, seed: int, median: float) -> tuple[list[list[int]], list[list[int]]]:
    """R prompts and, for each, n target lengths (seeded: every config sees the same workload)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    lengths = [draw_lengths(rng, args.n, median, args.sigma, args.max_tokens) for _ in range(args.prompts)]
    return prompts, lengths


async def one_request(engine: Engine, rid: str, prompt: list[int], targets: list[int], args, seed: int,
                      produced: list[int]) -> None:
    params = SamplingParams(n=len(targets), max_tokens=args.max_tokens, temperature=1.0, seed=seed,
                            ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    counts = [0] * len(targets)
    done = [False] * len(targets)
    async with engine.stream(prompt, params, request_id=rid) as stream:
        async for delta in stream:
            for c in delta.outputs:
                counts[c.index] += len(c.token_ids)
                if not done[c.index] and counts[c.index] >= targets[c.index]:
                    done[c.index] = True  # the sample's "EOS": end this completion only
                    await engine.abort(f"{rid}:{c.index}" if len(targets) > 1 else rid)
    produced.append(sum(min(n, t) for n, t in zip(counts, targets)))


async def run_round(engine: Engine, prompts, lengths, args, tag: str, trace: list | None) -> dict:
    produced: list[int] = []
    before = engine.stats()
    t0 = time.perf_counter()
    finished = anyio.Event()

    async def monitor() -> None:
        while not finished.is_set():
            s = engine.stats()
            trace.append((time.perf_counter() - t0, s["num_running"], s["kv_usage"], s["num_waiting"]))
            with anyio.move_on_after(args.sample_interval):
                await finished.wait()

    async with anyio.create_task_group() as tg:
        if trace is not None:
            tg.start_soon(monitor)
        async with anyio.create_task_group() as requests:
            for i, (prompt, targets) in enumerate(zip(prompts, lengths)):
                requests.start_soon(one_request, engine, f"{tag}-{i}", prompt, targets, args, 1000 * i, produced)
        finished.set()
    makespan = time.perf_counter() - t0
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("tokens_generated", "preemptions", "recomputed_tokens",
                                               "prefill_tokens_computed", "prefill_tokens_requested",
                                               "prefix_cache_hits", "deep_calls", "deep_rows")}
    return dict(makespan_s=makespan, tokens=sum(produced), tokens_per_s=sum(produced) / makespan, **delta)


async def run_config(model_dir: str, args, name: str, allocation: str) -> dict:
    mode, B, s = parse_config(name, args.shallow_loops)
    cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, mode=mode, deep_interval=B,
                       shallow_loops=s, max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + args.max_tokens,
                       gpu_memory_utilization=args.gpu_memory_utilization, kv_allocation=allocation,
                       num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, **budget_kwargs(args))
    async with (Engine(cfg) if not args.replicas else _pool(cfg, args.replicas, args.gpus_per_replica)) as engine:
        vocab = OuroConfig.from_checkpoint(model_dir).vocab_size
        warm_prompts, warm_lengths = workload(args, vocab, seed=99, median=max(2, args.median / 10))
        await run_round(engine, warm_prompts, warm_lengths, args, "warm", None)  # graphs for every batch size
        await engine.reset_prefix_cache()
        prompts, lengths = workload(args, vocab, seed=args.seed, median=args.median)
        trace: list = []
        row = await run_round(engine, prompts, lengths, args, "run", trace)
        stats = engine.stats()
    running = [r for _, r, _, _ in trace]
    row.update(config=name, mode=mode, deep_interval=B, shallow_loops=s, kv_allocation=allocation,
               samples=args.prompts * args.n, peak_running=max(running, default=0),
               mean_running=_time_mean(trace, 1), mean_kv_usage=_time_mean(trace, 2),
               peak_kv_usage=max((u for _, _, u, _ in trace), default=0.0),
               kv_blocks_total=stats["kv_blocks_total"], block_size=cfg.block_size,
               prefill_computed_over_RP=row["prefill_tokens_computed"] / (args.prompts * args.prompt_len),
               trace=trace)
    return row


def _pool(cfg: EngineConfig, replicas: int, gpus_per_replica: float | None = None):
    """--replicas N: the same engine config on N Ray actors (one GPU each on CUDA unless
    --gpus-per-replica says otherwise) behind the Engine API."""
    from ourobatch.ray import EnginePool

    return EnginePool(cfg, num_replicas=replicas, num_gpus_per_replica=gpus_per_replica)


def _time_mean(trace: list, col: int) -> float:
    if len(trace) < 2:
        return float(trace[0][col]) if trace else 0.0
    total = sum((b[0] - a[0]) * a[col] for a, b in zip(trace, trace[1:]))
    return total / (trace[-1][0] - trace[0][0])


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Measured {meta['date']} on {meta['device_name']}, commit {meta['commit']}, torch {meta['torch']}, "
             f"{meta['dtype']}: {meta['prompts']} prompts x n={meta['n']}, prompt {meta['prompt_len']}, cap "
             f"{meta['max_tokens']}, lengths lognormal(median {meta['median']}, sigma {meta['sigma']}), seed "
             f"{meta['seed']}.", "",
             "| config | KV policy | makespan s | tok/s | x interval 1 (same policy) | peak running | mean running | "
             "mean KV use | preemptions | prefill computed / requested | computed / (R x P) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['kv_allocation']} | {r['makespan_s']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r.get('ratio', float('nan')):.2f} | {r['peak_running']} | {r['mean_running']:.1f} | "
                     f"{r['mean_kv_usage']:.0%} | {r['preemptions']} | {r['prefill_tokens_computed']:,} / "
                     f"{r['prefill_tokens_requested']:,} | {r['prefill_computed_over_RP']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot(path.name)
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for r in rows:
        t = [x[0] for x in r["trace"]]
        style = "-" if r["kv_allocation"] == "lazy" else ":"
        label = f"{r['config']} ({r['kv_allocation']})"
        ax1.plot(t, [x[2] for x in r["trace"]], style, label=label)
        ax2.plot(t, [x[1] for x in r["trace"]], style, label=label)
    ax1.set_ylabel("KV blocks in use (share of pool)")
    ax2.set_ylabel("running requests")
    ax2.set_xlabel("seconds since the batch was submitted")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The parsed, checked command line, its KV allocation policies and its config names."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--out", required=True, help="folder for rollout.json, rollout.md, rollout_kv.png")
    ap.add_argument("--configs", default="interval1,deferred4,deferred8")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engine's step budget (default: EngineConfig's)")
    ap.add_argument("--allocations", default="lazy,reserve", help="KV policies to run each config with")
    ap.add_argument("--prompts", type=int, default=32, help="R")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (SamplingParams.n)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=2048, help="the cap; lengths are drawn below it")
    ap.add_argument("--median", type=float, default=400)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="pool size (default: sized from memory)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shallow-loops", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--sample-interval", type=float, default=0.05, help="seconds between stats samples")
    ap.add_argument("--replicas", type=int, default=0, help="0: one Engine in this process; N >= 1: an "
                    "ourobatch.ray.EnginePool of N replicas (Ray actors, one GPU each; docs/scaling.md)")
    ap.add_argument("--gpus-per-replica", type=float, default=None, help="GPUs per replica (default 1 on CUDA); "
                    "0.5 with --gpu-memory-utilization 0.45 puts two replicas on one GPU (the pool's mechanics only)")
    args = ap.parse_args(argv)
    if args.gpus_per_replica is not None and not args.gpus_per_replica > 0:
        ap.error(f"--gpus-per-replica must be > 0, got {args.gpus_per_replica}")
    allocations = args.allocations.split(",")
    for a in allocations:
        if a not in ("lazy", "reserve"):
            ap.error(f"--allocations takes lazy and/or reserve, got {a!r}")
    names = check_configs(ap, args.configs, args.shallow_loops)
    return args, allocations, names


def main(argv: list[str] | None = None) -> int:
    args, allocations, names = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_checkpoint(args)
    meta = dict(date=datetime.date.today().isoformat(), device=args.device, dtype=args.dtype,
                device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
                torch=torch.__version__, prompts=args.prompts, n=args.n, prompt_len=args.prompt_len,
                max_tokens=args.max_tokens, median=args.median, sigma=args.sigma, seed=args.seed,
                replicas=args.replicas, gpus_per_replica=args.gpus_per_replica,
                commit=provenance.commit())
    rows = []
    for allocation in allocations:
        base = None
        for name in names:
            row = anyio.run(run_config, model_dir, args, name, allocation)
            if name == "interval1":
                base = row["tokens_per_s"]
            if base:
                row["ratio"] = row["tokens_per_s"] / base
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            (out / "rollout.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    lazy = {r["config"]: r for r in rows if r["kv_allocation"] == "lazy"}
    for r in rows:
        if r["kv_allocation"] == "reserve" and r["config"] in lazy:
            lazy[r["config"]]["mean_running_over_reserve"] = (lazy[r["config"]]["mean_running"]
                                                              / max(r["mean_running"], 1e-9))
    (out / "rollout.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    (out / "rollout.md").write_text(markdown(rows, meta))
    plot(rows, out / "rollout_kv.png")
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
