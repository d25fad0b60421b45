"""The cost of a step that prefills while requests decode: is it the chunk, a fixed per-step cost, or eager launches?

benchmarks/serving.py's step log shows steps that prefill costing far more than their tokens; here such a
step is isolated. Per config (interval1, deferred8) one engine core over one loaded model, async scheduling
off, so each step runs alone: schedule -> launch -> result -> update, the device synchronized before it
(the executor's CUDA events give its GPU time). With N requests decoding (--ns; prompts of --decode-prompt
tokens, ignore_eos, temperature 1), for each k of --ks, --reps times:

- fresh: a request with a prompt of k new tokens (max_tokens 1: it ends in that step's update) is added,
  and the step that prefills it beside the N decode rows is timed;
- history: a request with a prompt of --history tokens (max_tokens 1) leaves its blocks in the prefix
  cache, then one with that prefix + k new tokens computes a chunk of k tokens from position --history:
  the prefill-with-history path (the paged kernel up to 64 rows, a gather of the history + SDPA past that);
- decode: --between pure decode steps after each mixed one (and --reps x 3 first): the baseline.

Every timed step's plan is checked (N decode rows; one chunk of exactly k tokens at the expected start).
A mixed step's ratio divides it by the median decode step of the same kind (with or without a deep call);
`extra_ms` fits mixed - decode = fixed + per_token x k over the fresh steps. Then one fresh and one history
step of --profile-k tokens and one decode step (first config, largest N) run under torch.profiler: kernels
and their GPU time, the top CUDA kernels and CPU ops, GPU busy vs wall; on CUDA the same three also run
under torch.cuda.set_sync_debug_mode("warn"): every call that synchronizes, with its source lines.

    python benchmarks/mixed_step.py --out results/mixed                      # H200 (< 4 min)
    python benchmarks/mixed_step.py --device cpu --dtype float32 --tiny --ns 2,3 --ks 0,4,8,16 \\
        --history 8 --block-size 4 --reps 2 --profile-k 8 --out /tmp/m        # CPU smoke test

Output: mixed_step.json (meta, every sample, the summaries, the profile), mixed_step.md, and per (config,
N, kind) the line: the largest k whose mixed step stays <= --threshold (1.5) x the decode step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ourobatch import EngineConfig, SamplingParams
from ourobatch.assembly import build_engine_core, resolve_dtype
from engine.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed_step_report import markdown, summarize  # noqa: E402
from step_trace import allocator_counts, counts_since, profile_steps, sync_sites  # noqa: E402
from throughput import add_checkpoint_args, check_configs, ensure_checkpoint, parse_config  # noqa: E402
import provenance  # noqa: E402


def parse_ints(text: str, flag: str, low: int) -> list[int]:
    """'0,64,128' -> [0, 64, 128] (sorted, distinct, each >= low); ValueError naming the flag."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if any(v < low for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{flag} takes distinct integers >= {low}, got {text!r}")
    return sorted(values)


class Bench:
    """One engine core of one config, and the requests it decodes."""

    def __init__(self, model_dir: str, model: Any, args: Any, name: str) -> None:
        mode, B, s = parse_config(name, args.shallow_loops)
        self.name, self.args, self.B = name, args, B
        self.max_model_len = max(args.history + max(args.ks), args.decode_prompt + 4096) + args.block_size
        cfg = EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, mode=mode, deep_interval=B,
                           shallow_loops=s, max_num_seqs=max(args.ns) + 2, max_model_len=self.max_model_len,
                           block_size=args.block_size, max_num_batched_tokens=max(args.ks) + max(args.ns) +
                           args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                           async_scheduling=False)
        t = time.perf_counter()
        self.core = build_engine_core(cfg, model=model)
        self.startup_s = time.perf_counter() - t
        self.cuda = args.device.startswith("cuda")
        if self.cuda:
            self.core.executor.timing = []  # the executor's CUDA events: GPU ms per step
        self.vocab = self.core.scheduler.config.vocab_size
        self.max_model_len = self.core.scheduler.config.max_model_len  # capped by the checkpoint's positions
        self.rng = random.Random(args.seed)
        self.num_added = 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def add(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"r{self.num_added}"
        self.core.add(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=self.num_added,
                                             ignore_eos=True), request_id=rid)
        self.num_added += 1
        return rid

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(n)]

    def step(self) -> tuple[Any, dict]:
        """One step alone, timed in its parts (ms); returns its plan and the sample."""
        core = self.core
        self.sync()
        allocator = allocator_counts(self.cuda)
        t0 = time.perf_counter()
        plan = core.schedule()
        t1 = time.perf_counter()
        pending = core.executor.launch(plan)
        t2 = time.perf_counter()
        result = pending.result()  # with the executor's timing on, it waits for the step's last kernel
        t3 = time.perf_counter()
        core.update(plan, result)
        t4 = time.perf_counter()
        allocator = counts_since(allocator, allocator_counts(self.cuda))  # cudaMalloc / cudaFree in the step
        if result.failures:
            raise RuntimeError(f"step {plan.step_id} failed: {result.failures}")
        timing = core.executor.timing
        chunks = [p for p in plan.prefills if p.token_ids]
        return plan, dict(step_ms=1e3 * (t4 - t0), schedule_ms=1e3 * (t1 - t0), launch_ms=1e3 * (t2 - t1),
                          result_ms=1e3 * (t3 - t2), update_ms=1e3 * (t4 - t3), execute_ms=1e3 * (t3 - t1),
                          gpu_ms=timing.pop() if timing else None, decode_rows=len(plan.shallow),
                          deep=bool(plan.deep), prefill_tokens=sum(len(p.token_ids) for p in chunks),
                          starts=[p.start_position for p in chunks], allocator=allocator)

    def decode_to(self, N: int) -> None:
        """Add requests until N decode, then step until a plan feeds all N and no prefill (plus 2 B steps)."""
        live = len(self.core.scheduler.requests)
        for _ in range(N - live):
            self.add(self.tokens(self.args.decode_prompt), self.max_model_len - self.args.decode_prompt)
        steady = 0
        for _ in range(1000):
            plan, _ = self.step()
            steady = steady + 1 if len(plan.shallow) == N and not plan.prefills else 0
            if steady > 2 * self.B:
                return
        raise RuntimeError(f"{self.name}: {N} requests never all decoded")

    def sample(self, kind: str, k: int, N: int, around: Any = None) -> dict:
        """One timed step of `kind` (fresh / history / decode) with a chunk of k tokens beside N decode rows;
        `around`: a context manager entered for that step only (the profiler, the sync check)."""
        start = 0
        if kind == "history":
            prefix = self.tokens(self.args.history)
            self.add(prefix, 1)
            self.step()  # the prefix's own prefill: its blocks stay in the prefix cache
            self.add(prefix + self.tokens(k), 1)
            start = self.args.history
        elif kind == "fresh":
            self.add(self.tokens(k), 1)
        with around if around is not None else contextlib.nullcontext():
            plan, s = self.step()
        expected = (N, k, [start] if k else [])
        if (s["decode_rows"], s["prefill_tokens"], s["starts"]) != expected:
            raise RuntimeError(f"{self.name} {kind} k={k}: the step ran (decode rows, prefill tokens, chunk "
                               f"starts) = {(s['decode_rows'], s['prefill_tokens'], s['starts'])}, expected "
                               f"{expected} (max_num_batched_tokens, or the prefix cache did not share)")
        return dict(config=self.name, N=N, kind=kind, k=k, **s)

    def close(self) -> None:
        self.core.close()
        del self.core
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def measure(bench: Bench, N: int) -> list[dict]:
    args = bench.args
    bench.decode_to(N)
    samples = [bench.sample("decode", 0, N) for _ in range(3 * args.reps)]
    for k in (k for k in args.ks if k > 0):
        for kind in ("fresh", "history"):
            for _ in range(args.reps):
                samples.append(bench.sample(kind, k, N))
                samples += [bench.sample("decode", 0, N) for _ in range(args.between)]
    return samples


def traced(bench: Bench, N: int, k: int) -> dict[str, Callable[[Any], dict]]:
    """The steps the profile and the sync check run (each given the context manager to run its step in): a
    decode step, a fresh and a history chunk of k tokens."""
    return {"decode": lambda around: bench.sample("decode", 0, N, around),
            "fresh": lambda around: bench.sample("fresh", k, N, around),
            "history": lambda around: bench.sample("history", k, N, around)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--out", required=True, help="folder for mixed_step.json and mixed_step.md")
    ap.add_argument("--configs", default="interval1,deferred8")
    ap.add_argument("--ns", default="32,64", help="requests decoding beside the chunk")
    ap.add_argument("--ks", default="0,64,128,256,512,1024,2048,4096,8192", help="prompt tokens of the chunk")
    ap.add_argument("--history", type=int, default=1024, help="tokens before a history chunk (block-aligned)")
    ap.add_argument("--decode-prompt", type=int, default=256, help="prompt tokens of the decoding requests")
    ap.add_argument("--reps", type=int, default=3, help="mixed steps per (k, kind)")
    ap.add_argument("--between", type=int, default=2, help="decode steps timed after each mixed step")
    ap.add_argument("--threshold", type=float, default=1.5, help="the summary line's bound on mixed / decode")
    ap.add_argument("--profile-k", type=int, default=512, help="chunk tokens of the profiled steps (0: none)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shallow-loops", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def check_args(ap: argparse.ArgumentParser, args: Any) -> list[str]:
    names = check_configs(ap, args.configs, args.shallow_loops)
    try:
        args.ns, args.ks = parse_ints(args.ns, "--ns", 1), parse_ints(args.ks, "--ks", 0)
    except ValueError as exc:
        ap.error(str(exc))
    for flag, low in (("reps", 1), ("between", 0), ("decode_prompt", 1), ("history", args.block_size),
                      ("profile_k", 0)):
        if getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    if args.profile_k > max(args.ks):
        ap.error(f"--profile-k must be <= the largest of --ks ({max(args.ks)}: the step budget), got {args.profile_k}")
    if args.history % args.block_size:
        ap.error(f"--history must be a multiple of --block-size ({args.block_size}), got {args.history}")
    if not args.threshold > 1:
        ap.error(f"--threshold must be > 1, got {args.threshold}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    names = check_args(ap, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_checkpoint(args)
    t = time.perf_counter()
    model = load_model(model_dir, resolve_dtype(EngineConfig(model=model_dir, device=args.device, dtype=args.dtype)),
                       args.device)
    model.fuse_projections()
    cuda = args.device.startswith("cuda")
    meta = dict(date=datetime.date.today().isoformat(), device=args.device, dtype=args.dtype, torch=torch.__version__,
                device_name=torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
                commit=provenance.commit(), load_s=time.perf_counter() - t,
                model_config={k: v for k, v in dataclasses.asdict(model.config).items() if k != "eos_token_ids"},
                **{k: getattr(args, k) for k in ("configs", "ns", "ks", "history", "decode_prompt", "reps",
                                                 "between", "threshold", "profile_k", "block_size", "seed")})
    samples: list[dict] = []
    result: dict[str, Any] = dict(meta=meta, samples=samples, startup_s={}, profile=None, syncs=None)
    for i, name in enumerate(names):
        bench = Bench(model_dir, model, args, name)
        result["startup_s"][name] = bench.startup_s
        for N in args.ns:
            samples += measure(bench, N)
            result.update(summarize(samples, model.config, args.threshold))
            (out / "mixed_step.json").write_text(json.dumps(result, indent=1))
            for line in result["lines"][-2:]:
                print(line, flush=True)
        if i == 0 and args.profile_k:
            steps = traced(bench, max(args.ns), args.profile_k)
            result["profile"] = dict(config=name, N=max(args.ns), k=args.profile_k, **profile_steps(steps, cuda))
            result["syncs"] = sync_sites(steps) if cuda else None
        bench.close()
    (out / "mixed_step.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "mixed_step.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
