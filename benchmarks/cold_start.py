"""Cold start: a fresh process's time to ready and its first rounds, with an empty and a warm compile cache.

For each config (interval1, deferred8 by default), two fresh subprocesses share one compile_cache_dir
(Triton's on-disk cache; TRITON_CACHE_DIR is unset for them, so the engine's folder is the one used):

- process 1, the folder empty: time to ready through the async ``Engine`` (split into weights, KV pool,
  kernel warm-up, graph captures and the request warm-up: the ``engine_ready`` event's fields; the kernels
  compile while the weights load, so "kernels" is the wait for them after the load plus the check pass;
  the JSON also has the load's own breakdown and the compiles during each phase), and the
  time from the process's start (spawned by this script: interpreter and imports included) to ready,
  what a user waits; kernels compiled / loaded from the cache; then --rounds rounds (3 by default) of N
  prompts of P tokens x M tokens (temperature 1, ignore_eos, prefill included), each round its own
  seeded random prompts, so no round finds another's prompt blocks in the prefix cache and every round
  prefills all N x P tokens (checked: the prefix-cache hits and computed prefill tokens of each round
  are recorded). Per round: wall time, Triton compiles and graph captures during it. "first / warm" is
  round 1 over the last round;
- process 2, the same folder: the same, now loading every kernel from the cache.

Output: cold_start.json (every process's numbers, the capture time of each graph) and cold_start.md.

    python benchmarks/cold_start.py --out results/cold                                  # H200
    python benchmarks/cold_start.py --device cpu --tiny -N 4 -P 8 -M 12 --out /tmp/c    # CPU smoke test
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before the heavy imports: the child reports its import time

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
PHASES = ("setup", "weights", "kv_pool", "executor", "kernels", "graphs", "requests")


def child(args) -> dict:
    """One process: build the engine, run the rounds, return the numbers (runs in the subprocess)."""
    import anyio
    from structlog.testing import capture_logs
    import torch

    from ourobatch import Engine
    from engine import warmup_pass

    sys.path.insert(0, str(HERE))
    from public_path import engine_config  # noqa: E402
    from throughput import ensure_checkpoint  # noqa: E402

    if args.threads:
        warmup_pass.NUM_THREADS = args.threads
    if args.parent_slots:
        warmup_pass.PARENT_SLOTS = args.parent_slots
    imported = time.perf_counter() - _STARTED
    model_dir = ensure_checkpoint(args)
    cfg = engine_config(args, model_dir, args.config)
    cfg = dataclasses.replace(cfg, compile_cache_dir=args.cache_dir, warmup=not args.no_warmup)

    async def run() -> dict:
        engine = Engine(cfg)
        t = time.perf_counter()
        with capture_logs() as logs:
            await engine.__aenter__()
        ready, ready_at = time.perf_counter() - t, time.time()
        try:
            events = {e["event"]: e for e in logs}
            rounds = [await one_round(engine, args, r) for r in range(1, args.rounds + 1)]
        finally:
            await engine.__aexit__(None, None, None)
        ev = events.get("engine_ready", {})
        compiled = events.get("kernels_compiled", {})
        first, warm = rounds[0]["wall_s"], rounds[-1]["wall_s"]
        return dict(config=args.config, import_s=imported, ready_s=ready,
                    start_to_ready_s=ready_at - args.spawned_at if args.spawned_at else None,
                    phases={p: ev.get(f"{p}_s") for p in PHASES}, startup_s=ev.get("startup_s"),
                    setup_checks_s=ev.get("setup_checks_s"),  # the part of setup before the compile caches
                    kernels_compiled=compiled.get("compiled"), kernels_loaded=compiled.get("loaded"),
                    compile_s=compiled.get("seconds"), warmup_kernels=_strip(events.get("warmup_kernels")),
                    prefetch_kernels=_strip(events.get("warmup_kernels_prefetch")),
                    prefetch_timeline=events.get("warmup_kernels_prefetch_timeline", {}).get("tasks"),
                    compiled_during=ev.get("compiled_during"),
                    weights_breakdown={k: v for k, v in ev.items() if k.startswith("weights_") and k != "weights_s"},
                    warmup_requests=_strip(events.get("warmup_requests")),
                    graph_seconds={k: v for e in logs if e["event"] == "cuda_graph_timings"  # early + the rest
                                   for k, v in e["seconds"].items()} or None,
                    early_graphs=sum(e["graphs"] for e in logs if e["event"] == "cuda_graphs_captured"
                                     and e.get("early")),
                    rounds=rounds, first_round_s=first, warm_round_s=warm, first_over_warm=first / warm,
                    tokens=rounds[0]["tokens"], compiles_in_first_round=rounds[0]["compiles"],
                    captures_in_first_round=rounds[0]["captures"],
                    device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu")

    return anyio.run(run)


async def one_round(engine, args, seed: int) -> dict:
    """Round `seed` (1, 2, ...): N concurrent requests on prompts of its own (public_path.workload(seed=)),
    with what it compiled, captured, found in the prefix cache and prefilled."""
    from ourobatch import compile_cache
    from public_path import timed_round, workload  # noqa: E402

    core = engine.core
    prompts, params = workload(args, core.scheduler.config.vocab_size, seed=seed)
    graphs, executor = core.executor.graphs, core.executor
    if executor.device.type == "cuda":
        executor.timing = []  # GPU ms per step (CUDA events): is a slower round slower on the device or the host?
    counts0, captures0, stats0 = compile_cache.compile_counts(), graphs.num_captures if graphs else 0, core.stats()
    segments0, clock0 = _segments(executor.device), _sm_clock(executor.device)
    wall, tokens = await timed_round(engine, prompts, params)
    counts1, captures1, stats1 = compile_cache.compile_counts(), graphs.num_captures if graphs else 0, core.stats()
    segments = None if segments0 is None else _segments(executor.device) - segments0
    delta = None if counts0 is None else counts1 - counts0
    steps_ms, executor.timing = executor.timing, None
    return dict(round=seed, wall_s=wall, tokens=tokens, steps=len(steps_ms) if steps_ms is not None else None,
                gpu_s=sum(steps_ms) / 1e3 if steps_ms else None, slowest_step_ms=max(steps_ms) if steps_ms else None,
                compiles=None if delta is None else delta.compiled + delta.loaded, captures=captures1 - captures0,
                prompts_sha1=hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:12],
                new_memory_segments=segments, sm_clock_mhz_before=clock0,
                steps_ms=[round(x, 3) for x in steps_ms] if steps_ms else None,
                **{k: stats1[k] - stats0[k] for k in ("prefix_cache_hits", "prefill_tokens_computed")})


def _segments(device) -> int | None:
    """cudaMalloc'd segments of the caching allocator so far (a round that adds some paid for the mallocs)."""
    import torch

    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("segment.all.allocated", 0))


def _sm_clock(device) -> int | None:
    """The GPU's SM clock now (nvidia-smi; None without it): a first round slower on the device than a
    warm one, with the same kernels, may start on a clock the idle startup let fall."""
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    index = device.index if device.index is not None else 0
    run = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    try:
        return int(run.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


def _strip(event: dict | None) -> dict | None:
    return None if event is None else {k: v for k, v in event.items() if k not in ("event", "log_level")}


def spawn(args, config: str, cache_dir: str, process: int, early: str | None = None) -> dict:
    """Run one child process; its JSON line is the last line of its stdout. `early`: its OUROBATCH_EARLY_CAPTURE
    (None: this process's environment's); "1" marks the row's config "+early"."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--config", config, "--cache-dir", cache_dir,
           "--out", args.out, "-N", str(args.N), "-P", str(args.P), "-M", str(args.M), "--device", args.device,
           "--dtype", args.dtype, "--workdir", args.workdir, "--shallow-loops", str(args.shallow_loops),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--threads", str(args.threads or 0),
           "--parent-slots", str(args.parent_slots or 0),
           "--rounds", str(args.rounds), "--spawned-at", repr(time.time())]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--no-warmup"] if args.no_warmup else []
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    if early is not None:
        env["OUROBATCH_EARLY_CAPTURE"] = early
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{config} process {process} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    row = json.loads(run.stdout.strip().splitlines()[-1])
    row.update(process=process, process_wall_s=time.perf_counter() - t, early_capture=early)
    if early == "1":
        row["config"] = f"{config}+early"
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f"Measured {meta['date']} on {meta['device_name']}: {meta['rounds']} rounds of N = {meta['N']} "
             f"prompts of {meta['P']} tokens (each round its own prompts), {meta['M']} tokens each (temperature 1, "
             f"prefill included), through the async Engine; process 1 starts with an empty compile cache, "
             f"process 2 with the folder process 1 filled. start to ready: from the process's spawn "
             f"(interpreter, imports) to the engine ready; warm = the last round.", "",
             "| config | process | start to ready s | import s | ready s | setup | weights | KV pool | executor | "
             "kernels | graphs | requests | other | compiled / loaded | round s | first / warm | "
             "compiles, captures per round | "
             "prefix-cache hits |", "|---" * 18 + "|"]
    for r in rows:
        ph, rounds = r["phases"], r["rounds"]
        lines.append(f"| {r['config']} | {r['process']} | {f(r.get('start_to_ready_s'))} | {f(r['import_s'])} | "
                     f"{f(r['ready_s'])} | " + " | ".join(f(ph.get(p)) for p in PHASES)
                     + f" | {f(r['ready_s'] - sum(ph.get(p) or 0 for p in PHASES))}"  # outside every phase
                     + f" | {f(r['kernels_compiled'], '{}')} / {f(r['kernels_loaded'], '{}')} | "
                     + " / ".join(f(x["wall_s"]) for x in rounds) + f" | {f(r['first_over_warm'])} | "
                     + " / ".join(f"{f(x['compiles'], '{}')}, {x['captures']}" for x in rounds) + " | "
                     + f"{sum(x['prefix_cache_hits'] for x in rounds)} |")
    lines += ["", "Inside the startup: the weight load itself (engine_ready's weights_total_s), the kernel pass "
              "that compiles beside it (wall and summed seconds), and the kernels compiled during each phase; and "
              "per round, the steps' GPU time (CUDA events; the rest of the round's wall time is the host's).", "",
              "| config | process | load s | load GB/s | prefetch wall / summed s | compiled: weights / kernels / "
              "graphs / requests | steps, GPU s, SM MHz at its start, per round |", "|---" * 7 + "|"]
    for r in rows:
        load, pre, during = r.get("weights_breakdown") or {}, r.get("prefetch_kernels") or {}, r.get("compiled_during")
        compiled = "-" if during is None else " / ".join(str(during.get(p, 0)) for p in
                                                          ("weights", "kernels", "graphs", "requests"))
        per_round = " / ".join(f"{f(x.get('steps'), '{}')}, {f(x.get('gpu_s'))}, "
                               f"{f(x.get('sm_clock_mhz_before'), '{}')}" for x in r["rounds"])
        lines.append(f"| {r['config']} | {r['process']} | {f(load.get('weights_total_s'))} | "
                     f"{f(load.get('weights_gb_per_s'))} | {f(pre.get('seconds'))} / {f(pre.get('sequential_seconds'))}"
                     f" | {compiled} | {per_round} |")
    return "\n".join(lines + timeline_table(rows)) + "\n"


def timeline_table(rows: list[dict], last: int = 8) -> list[str]:
    """The compile pass's tail per process that compiled: the `last` launches to end (warmup_pass's timeline:
    queued, given a parent slot, each child forked -> reported with its compile seconds, ended; seconds from the
    pass's start), and the children's most at once."""
    out = []
    for r in rows:
        tasks = r.get("prefetch_timeline") or []
        children = [c for t in tasks for c in t["children"]]
        pre = r.get("prefetch_kernels") or {}
        before = ", ".join(f"{k} {pre[f'{k}_seconds']:.2f} s" for k in ("driver", "list", "key", "prepare")
                           if pre.get(f"{k}_seconds") is not None)
        before += f" (key {pre['key_source']})" if pre.get("key_source") else ""
        if tasks and not children:  # every kernel was cached: when the launches started and ended
            out += ["", f"{r['config']}, process {r['process']}: {before + '; ' if before else ''}{len(tasks)} "
                    f"launches, no child, the first queued at {min(t['queued'] for t in tasks):.2f} s, the last "
                    f"ended at {max(t['end'] for t in tasks):.2f} s"]
        if not children:
            continue
        edges = sorted([(a, 1) for a, _, _ in children] + [(b, -1) for _, b, _ in children])
        running = peak = 0
        for _, step in edges:
            running += step
            peak = max(peak, running)
        out += ["", f"{r['config']}, process {r['process']}: {before + '; ' if before else ''}"
                f"{len(children)} children, the last forked at "
                f"{max(a for a, _, _ in children):.2f} s, at most {peak} at once, compile seconds summed "
                f"{sum(s or 0 for _, _, s in children):.1f}; the last {min(last, len(tasks))} launches to end:", "",
                "| task | key | queued | slot | children: forked - reported (compile s) | end |", "|---" * 6 + "|"]
        for t in tasks[-last:]:
            kids = ", ".join(f"{a:.2f} - {b:.2f} ({'-' if s is None else f'{s:.2f}'})" for a, b, s in t["children"])
            out.append(f"| {t['task']} | {t['key'][:60]} | {t['queued']:.2f} | {t['slot']:.2f} | {kids or '-'} | "
                       f"{t['end']:.2f} |")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (the --child flags included: the subprocesses parse the same one)."""
    from throughput import add_checkpoint_args  # noqa: E402

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--out", required=True, help="folder for cold_start.json and cold_start.md")
    ap.add_argument("--configs", default="interval1,deferred8")
    ap.add_argument("-N", type=int, default=64, help="concurrent requests")
    ap.add_argument("-P", type=int, default=512, help="prompt tokens")
    ap.add_argument("-M", type=int, default=128, help="output tokens per request")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shallow-loops", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=0, help="compile threads of the kernel warm-up (0: its default)")
    ap.add_argument("--parent-slots", type=int, default=0,
                    help="forked compiles: warm-up threads working in the parent at once (0: its default)")
    ap.add_argument("--no-warmup", action="store_true", help="EngineConfig(warmup=False): the baseline")
    ap.add_argument("--early-capture", choices=("env", "0", "1", "both"), default="env",
                    help="OUROBATCH_EARLY_CAPTURE of the processes (ourobatch/kernel_prefetch.py): the environment's, "
                         "off, on, or both (each config off, then on, each with its own empty cache)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per process, each with its own prompts (>= 2)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from throughput import check_configs  # noqa: E402

    ap = build_parser()
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    names = check_configs(ap, args.configs, args.shallow_loops)
    for field in ("N", "P", "M"):
        if getattr(args, field) < 1:
            ap.error(f"-{field} must be >= 1, got {getattr(args, field)}")
    if args.rounds < 2:
        ap.error(f"--rounds must be >= 2 (a first and a warm round), got {args.rounds}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from throughput import ensure_checkpoint  # noqa: E402

    ensure_checkpoint(args)  # written once, before any timed process
    rows = []
    settings = {"env": [None], "0": ["0"], "1": ["1"], "both": ["0", "1"]}[args.early_capture]
    for name, early in [(n, e) for n in names for e in settings]:
        cache_dir = tempfile.mkdtemp(prefix=f"ourobatch-cold-{name}-")
        try:
            for process in (1, 2):
                rows.append(spawn(args, name, cache_dir, process, early))
                print(json.dumps(rows[-1]), flush=True)
                meta = dict(date=datetime.date.today().isoformat(), device=args.device, dtype=args.dtype, N=args.N,
                            P=args.P, M=args.M, rounds=args.rounds, device_name=rows[-1].get("device_name"),
                            warmup=not args.no_warmup)
                (out / "cold_start.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    md = markdown(rows, meta)
    (out / "cold_start.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
