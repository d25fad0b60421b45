"""Where one engine step's time goes (benchmarks/mixed_step.py): a torch.profiler trace of it (device kernels
and their time, the top CPU ops, kernel launches, synchronizing runtime calls) and, on CUDA, every call in
it that synchronizes with the device (torch.cuda.set_sync_debug_mode("warn")), with its source lines."""

from __future__ import annotations

import collections
import contextlib
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REPO = Path(__file__).resolve().parents[1]
ENGINE_DIRS = ("engine", "scheduler", "ourobatch")  # the engine's code (benchmarks/ is the harness)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
TOP = 15


ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts(cuda: bool) -> dict[str, int] | None:
    """The CUDA caching allocator's event counters (cudaMalloc / cudaFree calls, flush-and-retry after a
    failed cudaMalloc, syncs of all streams); None off CUDA. Read it outside a timed window (~0.1 ms)."""
    if not cuda:
        return None
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_KEYS}


def counts_since(before: dict | None, after: dict | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in before}


def _kernel_table(prof: Any) -> tuple[list[dict], float, int]:
    """Device activities (kernels, copies) by name: calls and microseconds; their total; their count."""
    per: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
    rows = sorted((dict(name=n[:160], calls=c, us=t) for n, (c, t) in per.items()), key=lambda r: -r["us"])
    return rows, sum(r["us"] for r in rows), sum(r["calls"] for r in rows)


def _cpu_table(prof: Any) -> list[dict]:
    """CPU ops and runtime calls by self time (the host's part: dispatch, launches, waits)."""
    rows = [dict(name=e.key[:160], calls=e.count, self_us=e.self_cpu_time_total, total_us=e.cpu_time_total)
            for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    return sorted(rows, key=lambda r: -r["self_us"])


def profile_steps(steps: dict[str, Callable[[Any], dict]], cuda: bool) -> dict[str, dict]:
    """Each step run once untraced (so nothing first-use is traced), then once under torch.profiler.
    steps: name -> run(around), which runs one step inside the context manager `around` (None: none)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, run in steps.items():
        run(None)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities)
        sample = run(prof)
        kernels, kernel_us, num_kernels = _kernel_table(prof)
        cpu = _cpu_table(prof)
        launches = sum(r["calls"] for r in cpu if r["name"] in LAUNCHES)
        waits = [r for r in cpu if "Synchronize" in r["name"] or r["name"].startswith("cudaMemcpy")]
        wall = sample["step_ms"]
        out[name] = dict(sample=sample, wall_ms=wall, gpu_ms=sample["gpu_ms"], kernel_ms=kernel_us / 1e3,
                         device_activities=num_kernels, launches=launches,
                         busy_share=kernel_us / 1e3 / wall if wall else None,
                         waits=[dict(name=r["name"], calls=r["calls"], self_ms=r["self_us"] / 1e3) for r in waits],
                         host_ms=sum(r["self_us"] for r in cpu) / 1e3, top_kernels=kernels[:TOP], top_cpu=cpu[:TOP])
    return out


def _site(frames: list[traceback.FrameSummary]) -> tuple[str, bool]:
    """'engine/kv_cache.py:81 slots_for < engine/attention.py:96 _chunk_with_history < ...' (innermost first,
    the repository's frames only) and whether the innermost of them is the engine's."""
    ours = []
    for f in reversed(frames):
        try:
            rel = Path(f.filename).resolve().relative_to(REPO)
        except ValueError:
            continue
        ours.append((rel, f"{rel}:{f.lineno} {f.name}"))
        if len(ours) == 4:
            break
    if not ours:
        return "?", False
    return " < ".join(text for _, text in ours), ours[0][0].parts[0] in ENGINE_DIRS


@contextlib.contextmanager
def _sync_debug() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def sync_sites(steps: dict[str, Callable[[Any], dict]]) -> dict[str, dict]:
    """Per step: the calls that synchronized with the device (CUDA's sync debug mode), by source site."""
    out = {}
    for name, run in steps.items():
        sites: collections.Counter[str] = collections.Counter()
        engine: collections.Counter[str] = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            site, is_engine = _site(traceback.extract_stack()[:-1])
            sites[site] += 1
            engine[site] += is_engine

        with warnings.catch_warnings():  # restores warnings.showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = show
            run(_sync_debug())
        out[name] = dict(count=sum(sites.values()), engine_count=sum(engine.values()),
                         sites=[dict(site=s, calls=c, engine=bool(engine[s])) for s, c in sites.most_common()])
    return out
