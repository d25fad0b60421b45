"""Serving latency under Poisson arrivals, through the public async Engine (or, --server, the HTTP server).

Per config (default interval1, eager4, deferred4, deferred8, verify4), one engine serves every rate of
--rates in turn: --num-requests requests arrive as a Poisson process (one seeded unit-rate pattern of
exponential gaps scaled by 1/rate; "inf" = all at once), prompt and output lengths are seeded lognormals
(medians, sigmas, caps), ignore_eos and temperature 1, so every request makes exactly its drawn length.
One client task per request streams it (`engine.stream`; with --server the openai AsyncOpenAI client,
stream=True, on /v1/completions of `python -m ourobatch serve` on 127.0.0.1, prompt as token ids) and
records each delivery's time (time.perf_counter). The prefix cache is dropped before each rate; a staircase
warm-up first walks the running count down through every CUDA-graph bucket, so no capture is measured.

Per (config, rate): TTFT (scheduled arrival -> first token), end-to-end (-> last token), requests/s and
output tokens/s (first arrival -> last token), running requests sampled from the engine, and gaps. A
delivery can carry several tokens (a stream coalesces what its consumer missed; verify releases a block),
so `itl` is the gap between consecutive deliveries of a request (what a streaming user waits), `itl_token`
gives each token the gap to the token before it (0 inside a delivery), `tpot` = (last - first token) /
(tokens - 1) per request. Deferred modes make gaps uneven (every B-th step carries the deep call):
`itl_p99_over_p50` and `itl_hist` (log bins) show it. serving_report.py: the summary (the highest finite
rate where interval1 keeps p99 TTFT < --ttft-slo, and there every config against it), table, plots.

Why a gap is long (engine transport): the step log (step_log.py, a wrapper around the engine's executor)
records every step's time, its composition (decode rows, prefill tokens and chunks, chunks after a
history, deep rows), whether it was launched ahead (async scheduling) or the pipeline drained, its graph
replays and captures and the Triton kernels compiled during it; per rate, `steps` summarises pure-decode
steps against steps that prefill and by prefill-token bucket, with the slowest steps whole. Per rate also
`kernels_compiled_during_round` (ourobatch.compile_cache's counter: compiled / loaded from the disk
cache), `graph_captures_during_round`, `drain_reasons` (why steps were not planned ahead) and
`allocator_during_round` (the CUDA caching allocator's cudaMalloc / cudaFree calls and flush-and-retries).

    python benchmarks/serving.py --out results/serving                  # H200 (docs/benchmarks.md)
    python benchmarks/serving.py --out results/serving_http --server    # the same through HTTP/SSE
    python benchmarks/serving.py --device cpu --dtype float32 --tiny --configs interval1,deferred4 \\
        --rates 50,inf --num-requests 8 --prompt-median 8 --max-prompt-len 16 --output-median 6 \\
        --max-tokens 12 --out /tmp/s                                      # CPU smoke test

--out gets serving.json (meta, rows, summary) and serving.md, both rewritten after each config,
serving_requests.jsonl.gz (a line per round: every request's arrival, delivery times and token counts),
serving_steps.jsonl.gz (a line per round: every step of the step log, `t` in s since the round started),
and with matplotlib serving_latency.png, serving_running.png, serving_gaps.png (--no-plots: none).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from engine.config import OuroConfig
from engine.cuda_graphs import BUCKETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import draw_lengths  # noqa: E402
from serving_clients import open_client  # noqa: E402
from serving_report import markdown, measure, plot, progress_line, summarize  # noqa: E402
from step_log import steps_line, summarize_steps  # noqa: E402
from step_trace import counts_since  # noqa: E402
from throughput import CONFIG_HELP, add_checkpoint_args, ensure_checkpoint, parse_config  # noqa: E402
import provenance  # noqa: E402

SEED_BASE = 1000  # request i samples with seed SEED_BASE + i
COUNTERS = ("tokens_generated", "deep_calls", "steps", "preemptions", "lookahead_steps", "lookahead_drains")


def parse_rates(text: str) -> list[float]:
    """'8,2,inf' -> [2.0, 8.0, inf]: requests per second (> 0), "inf" = every request at once."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = math.nan
        if not rate > 0 or (math.isinf(rate) and part.strip().lower() != "inf"):
            raise ValueError(f"--rates takes comma-separated requests/s (numbers > 0) or 'inf' (all at once), "
                             f"got {part!r} in {text!r}")
        if rate in rates:
            raise ValueError(f"--rates lists {part!r} twice")
        rates.append(rate)
    return sorted(rates)


def rate_label(rate: float) -> str | float:
    return "inf" if math.isinf(rate) else rate


def workload(args: Any, vocab: int, seed: int, n: int) -> tuple[list[list[int]], list[int], list[float]]:
    """n prompts, their output lengths and n - 1 unit-rate exponential gaps, all from one seeded stream."""
    rng = random.Random(seed)
    prompt_lens = draw_lengths(rng, n, args.prompt_median, args.prompt_sigma, args.max_prompt_len)
    output_lens = draw_lengths(rng, n, args.output_median, args.output_sigma, args.max_tokens)
    prompts = [[rng.randrange(1, vocab) for _ in range(p)] for p in prompt_lens]
    return prompts, output_lens, [rng.expovariate(1.0) for _ in range(n - 1)]


def arrivals(unit_gaps: list[float], rate: float) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate`: the first at 0, then the unit gaps / rate."""
    times = [0.0]
    for gap in unit_gaps:
        times.append(times[-1] + (0.0 if math.isinf(rate) else gap / rate))
    return times


def warmup_lengths(width: int, plateau: int) -> list[int]:
    """Output lengths for `width` requests sent at once such that the number still decoding steps down
    through every CUDA-graph bucket <= width, for `plateau` tokens each: request r lives while r < bucket."""
    steps = sorted({b for b in BUCKETS if b < width} | {width})
    return [plateau * sum(1 for b in steps if b > r) for r in range(width)]


# ---------------------------------------------------------------------- one round: requests at their arrivals


async def run_round(client: Any, prompts: list[list[int]], lengths: list[int], times: list[float], tag: str,
                    sample_interval: float | None) -> tuple[list[dict], list]:
    """Send request i at t0 + times[i] (sorted); returns its record (times in s since t0) and the stats trace."""
    records: list[dict] = [{} for _ in prompts]
    trace: list = []
    done = anyio.Event()
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        sent = time.perf_counter() - t0
        deliveries, counts, finish = [], [], None
        async for k, reason in client.stream(f"{tag}-{i}", prompts[i], lengths[i], SEED_BASE + i):
            if k:
                deliveries.append(round(time.perf_counter() - t0, 6))
                counts.append(k)
            finish = reason or finish
        records[i] = dict(arrival=round(times[i], 6), sent=round(sent, 6), prompt_len=len(prompts[i]),
                          output_len=lengths[i], finish_reason=finish, times=deliveries, counts=counts)

    async def monitor() -> None:
        while not done.is_set():
            s = await client.stats()
            trace.append((round(time.perf_counter() - t0, 4), s.get("num_running", 0), s.get("num_waiting", 0)))
            with anyio.move_on_after(sample_interval):
                await done.wait()

    async with anyio.create_task_group() as tg:
        if sample_interval is not None:
            tg.start_soon(monitor)
        async with anyio.create_task_group() as requests:
            for i, at in enumerate(times):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                requests.start_soon(one, i)
        done.set()
    return records, trace


async def run_config(model_dir: str, args: Any, name: str, rates: list[float], vocab: int, emit: Any) -> list[dict]:
    mode, B, s = parse_config(name, args.shallow_loops)
    prompts, lengths, gaps = workload(args, vocab, args.seed, args.num_requests)
    width = min(args.max_num_seqs, args.num_requests)
    warm_prompts, _, _ = workload(args, vocab, args.seed + 1, width)
    rows = []
    async with open_client(model_dir, args, mode, B, s, args.max_prompt_len + args.max_tokens) as client:
        t = time.perf_counter()
        warm_lengths = [min(n, args.max_tokens) for n in warmup_lengths(width, B + 2)]
        await run_round(client, warm_prompts, warm_lengths, [0.0] * width, "warm", None)
        warmup_s = time.perf_counter() - t
        for rate in rates:
            await client.reset_cache()
            await client.take_steps()  # the warm-up's and the last round's: not this round's
            before, captures, drains = await client.stats(), client.graph_captures(), client.drain_reasons()
            compiles, allocator, t0 = client.compile_counts(), client.allocator(), time.perf_counter()
            records, trace = await run_round(client, prompts, lengths, arrivals(gaps, rate), f"{name}-{rate:g}",
                                             args.sample_interval)
            after, steps = await client.stats(), await client.take_steps()
            for step in steps or ():
                step["t"] = round(step["t"] - t0, 6)  # s since the round started, as the request records
            row = dict(config=name, mode=mode, deep_interval=B, shallow_loops=s, rate=rate_label(rate),
                       transport=client.transport, warmup_s=warmup_s, **measure(records, trace),
                       counters={k: after[k] - before[k] for k in COUNTERS if k in after and k in before},
                       graph_captures_during_round=None if captures is None else client.graph_captures() - captures,
                       kernels_compiled_during_round=_compiled_since(compiles, client.compile_counts()),
                       drain_reasons=None if drains is None else
                       {k: v - drains.get(k, 0) for k, v in client.drain_reasons().items() if v > drains.get(k, 0)},
                       allocator_during_round=counts_since(allocator, client.allocator()),
                       steps=None if steps is None else summarize_steps(steps))
            rows.append(row)
            emit(row, records, steps)
    return rows


def _compiled_since(before: Any, after: Any) -> dict | None:
    """Triton kernels compiled and loaded from the disk cache between two counter snapshots (None: no counter)."""
    if before is None or after is None:
        return None
    delta = after - before
    return dict(compiled=delta.compiled, loaded=delta.loaded, seconds=round(delta.seconds, 3))


OPTIONS = [  # flag, type, default, help
    ("--configs", str, "interval1,eager4,deferred4,deferred8,verify4", CONFIG_HELP),
    ("--rates", str, "4,8,16,24,32,inf", "requests/s, comma-separated; inf = all at once"),
    ("--num-requests", int, 200, "requests per rate"),
    ("--prompt-median", float, 256, None), ("--prompt-sigma", float, 0.6, None), ("--max-prompt-len", int, 1024, None),
    ("--output-median", float, 128, None), ("--output-sigma", float, 0.6, None),
    ("--max-tokens", int, 512, "cap on the drawn output lengths"), ("--seed", int, 0, None),
    ("--ttft-slo", float, 1000.0, "ms: the summary's bound on interval1's p99 TTFT"),
    ("--plot-rate", str, None, "rate of the running / gaps plots (default: the summary's, else the highest finite)"),
    ("--max-num-seqs", int, 256, None), ("--num-kv-blocks", int, None, "KV pool size (default: sized from memory)"),
    ("--max-num-batched-tokens", int, None, "tokens per step (default: EngineConfig's)"),
    ("--max-prefill-tokens-while-decoding", int, None, "prompt tokens per step while any request decodes "
                                                       "(default: EngineConfig's, no cap)"),
    ("--block-size", int, 16, None), ("--device", str, "cuda", None), ("--dtype", str, "bfloat16", None),
    ("--shallow-loops", int, 2, None), ("--gpu-memory-utilization", float, 0.9, None),
    ("--sample-interval", float, 0.05, "seconds between engine stats samples")]
AT_LEAST = {"num_requests": 1, "max_prompt_len": 1, "max_tokens": 1, "max_num_seqs": 1, "prompt_sigma": 0,
            "output_sigma": 0}
POSITIVE = ("prompt_median", "output_median", "ttft_slo", "sample_interval")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--out", required=True, help="folder for the results (see above)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--server", action="store_true", help="through `python -m ourobatch serve` on 127.0.0.1 (a "
                    "subprocess per config) and the openai client, instead of the in-process Engine")
    for flag, kind, default, text in OPTIONS:
        ap.add_argument(flag, type=kind, default=default, help=(text + " " if text else "") + "(default: %(default)s)")
    return ap


def check_args(args: Any) -> tuple[list[float], list[str]]:
    """ValueError naming the flag for a bad value; returns the rates and the config names."""
    for name, low in AT_LEAST.items():
        if not getattr(args, name) >= low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    for name in POSITIVE:
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    names = args.configs.split(",")
    for name in names:
        parse_config(name, args.shallow_loops)  # ValueError naming the config and the allowed forms
    if len(set(names)) != len(names):
        raise ValueError(f"--configs lists a config twice: {args.configs!r}")
    return parse_rates(args.rates), names


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        rates, names = check_args(args)
        plot_rate = None if args.plot_rate is None else rate_label(parse_rates(args.plot_rate)[0])
    except ValueError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_checkpoint(args)
    cuda = args.device.startswith("cuda")
    commit = provenance.commit()
    meta = dict(date=datetime.date.today().isoformat(), device=args.device, dtype=args.dtype, torch=torch.__version__,
                device_name=torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
                machine=platform.platform(), python=platform.python_version(), cuda=torch.version.cuda,
                transport="HTTP server (openai client, SSE)" if args.server else "async Engine", configs=names,
                rates=[rate_label(r) for r in rates], commit=commit,
                model=args.model or ("random tiny" if args.tiny else "random Ouro-1.4B shape"),
                **{k: getattr(args, k) for k in ("num_requests", "prompt_median", "prompt_sigma", "max_prompt_len",
                                                 "output_median", "output_sigma", "max_tokens", "seed", "max_num_seqs",
                                                 "shallow_loops", "sample_interval", "ttft_slo")})
    vocab = OuroConfig.from_checkpoint(model_dir).vocab_size
    rows: list[dict] = []
    with gzip.open(out / "serving_requests.jsonl.gz", "wt") as raw, \
            gzip.open(out / "serving_steps.jsonl.gz", "wt") as step_file:
        def emit(row: dict, records: list[dict], steps: list[dict] | None) -> None:
            print(progress_line(row), flush=True)
            print(steps_line(row["steps"]), flush=True)
            raw.write(json.dumps(dict(config=row["config"], rate=row["rate"], requests=records)) + "\n")
            raw.flush()
            if steps is not None:
                step_file.write(json.dumps(dict(config=row["config"], rate=row["rate"], steps=steps)) + "\n")
                step_file.flush()

        for name in names:
            rows += anyio.run(run_config, model_dir, args, name, rates, vocab, emit)
            summary = summarize(rows, args.ttft_slo)  # both files rewritten per config: a cut run keeps its part
            (out / "serving.json").write_text(json.dumps(dict(meta=meta, rows=rows, summary=summary)))
            (out / "serving.md").write_text(markdown(rows, meta, summary))
    if plot_rate is None:
        finite = [r for r in rates if not math.isinf(r)]
        plot_rate = summary["rate"] if summary["rate"] is not None else rate_label(max(finite, default=rates[-1]))
    if not args.no_plots:
        plot(rows, out, plot_rate)
    print(markdown(rows, meta, summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
