"""The startup's compile pass (engine/kernel_warmup.py lists its launches): every launch run once, in threads,
its compiles in forked children (engine/fork_compile.py) where they can be, and a timeline of where the wall time
went.

Theory of operation (forked). The pass is as long as its slowest chain: the loop-pass launch's compile alone takes
~4-5 s on the H200 host, so what matters is how soon its child is forked. Session 20's timeline showed two things
ahead of it: ~1 s before the first launch (Triton's driver, the kernels' per-device caches) and ~1.1 s more before
the first children forked, the first four launches each hashing Triton's own key (~400 MB of libtriton) at the
same time. So: Triton's key is made known once (read back from its cache folder where a process before stored
it, engine/triton_key.py; else hashed), in a thread of its own beside the driver, the launch list and the
kernels' per-device caches (`_prepare`, ~0.05 s: so two first launches of one kernel cannot race to make them);
the slowest kernels' launches (warmup_order.SLOWEST) start first, each alone until its child is forked (their
Python work meets no other thread's); then every other launch starts at once, `threads` threads waiting on their
children, at most PARENT_SLOTS working in this process at a time. Where fork is off or `_prepare` fails, the
launches run in `staged` stages (warmup_order).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from . import fork_compile
from .warmup_order import KernelReport, Task, entry, head_first, staged

NUM_THREADS: int | None = None  # compile threads; None: `default_threads` (benchmarks/cold_start.py --threads)
PARENT_SLOTS = 4  # forked compiles: threads working in this process at once (fork_compile.parent_slot)
HEAD_WAIT_S = 2.0  # the longest a head launch's Python work holds the others back


def default_threads(forking: bool) -> int:
    """Threads that wait on forked compiles: one per core but two (the children are niced below the weight load
    beside them; PARENT_SLOTS run here at once: 16 loading cached kernels slowed the load through the GIL);
    threads that compile themselves: 8 at most (past that the GIL gains nothing)."""
    cores = os.cpu_count() or 1
    return max(1, min(14, cores - 2)) if forking else min(8, cores)


def _driver(device: torch.device) -> bool:
    """Triton's driver (its first use builds its utilities: a gcc compile on an empty cache). False where it fails:
    then nothing forks."""
    try:
        import triton

        with torch.cuda.device(device):
            triton.runtime.driver.active.get_current_device()
        return True
    except Exception:  # noqa: BLE001 - the launches find out themselves
        return False


def _modules(device: torch.device) -> list:
    """The engine's kernel modules this device launches."""
    from . import (attention_combine, layers_dispatch, mlp_dispatch, pdl, triton_attention, triton_fused, triton_gemm,
                   triton_sampler)

    modules = [triton_attention, attention_combine, triton_fused, triton_gemm, triton_sampler]
    if triton_attention.gluon_decode(device):
        modules += [importlib.import_module(f".{m}", __package__) for m in ("gluon_attention", "gluon_attention_o")]
    if mlp_dispatch.mlp_fold_on(device):
        modules.append(importlib.import_module(".gluon_mlp", __package__))
    if layers_dispatch.switch_on() and pdl.hopper(device) and pdl.gluon_importable():
        modules.append(importlib.import_module(".gluon_layers", __package__))
    return modules


def _prepare(device: torch.device) -> bool:
    """Every kernel's per-device cache (its binder) made before launches run at once, so two first launches of one
    kernel cannot race to make it. False where Triton's internals differ: the launches then run staged."""
    try:
        import triton
        from triton.runtime.jit import JITFunction

        with torch.cuda.device(device):
            index = triton.runtime.driver.active.get_current_device()
            for module in _modules(device):
                for kernel in vars(module).values():
                    if isinstance(kernel, JITFunction):
                        kernel.device_caches[index]  # noqa: B018 - the defaultdict makes it
        return True
    except Exception:  # noqa: BLE001 - an optimization only
        return False


def _run(task: Task, device: torch.device, slots: threading.Semaphore | None = None, zero: float = 0.0,
         forked: threading.Event | None = None) -> tuple[str, float, str | None, dict]:
    """The launch of `task`: its name, seconds, error (None) and timeline entry (warmup_order.entry, times from
    `zero`); `forked` is set once its first child is forked (or it ends without one)."""
    times, error = {"queued": time.perf_counter()}, None
    try:
        with fork_compile.recording(None if forked is None else forked.set) as children:
            try:  # (CPU tensors: Triton's interpreter, TRITON_INTERPRET=1, for tests)
                with (fork_compile.parent_slot(slots), fork_compile.compiles_in_children(slots is not None),
                      torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(),
                      torch.inference_mode()):
                    times["slot"] = time.perf_counter()
                    task.launch()
            except Exception as exc:  # noqa: BLE001 - the kernel compiles on first use instead; reported
                error = f"{task.name}: {type(exc).__name__}: {exc}"
    finally:
        if forked is not None:
            forked.set()
    times["end"] = time.perf_counter()
    return task.name, times["end"] - times["queued"], error, entry(task, times, children, zero)


def _forked(pool: ThreadPoolExecutor, tasks: list[Task], device: torch.device, slots: threading.Semaphore,
            zero: float, stopped: Callable[[], bool], report: KernelReport) -> None:
    """The head alone, one launch at a time until its child is forked (or it ends); then the rest at once."""
    head, rest = head_first(tasks)
    futures: list[Future] = []
    for task in head:
        if stopped():
            break
        forked = threading.Event()
        futures.append(pool.submit(_run, task, device, slots, zero, forked))
        forked.wait(HEAD_WAIT_S)
    if not stopped():
        futures += [pool.submit(_run, task, device, slots, zero) for task in rest]
    report.add([f.result() for f in futures])


def run_pass(tasks_of: Callable[[], list[Task]], device: torch.device, threads: int | None = None,
             should_stop: Callable[[], bool] | None = None) -> KernelReport:
    """Run every launch `tasks_of()` lists (CUDA: forked where fork_compile is available), `threads` at a time
    (default: NUM_THREADS, else default_threads); `should_stop()` true: no further launch starts."""
    report, started = KernelReport(), time.perf_counter()
    stopped = lambda: should_stop is not None and bool(should_stop())  # noqa: E731
    forking = device.type == "cuda" and fork_compile.available()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ourobatch-triton-key") as primer:
        key = primer.submit(fork_compile.prime_key) if forking else None  # beside the driver and the list
        forking = forking and _driver(device)
        report.driver_seconds = time.perf_counter() - started
        tasks = tasks_of()
        report.list_seconds = time.perf_counter() - started - report.driver_seconds
        t = time.perf_counter()
        forking = forking and _prepare(device)
        report.prepare_seconds = time.perf_counter() - t
        if key is not None and key.exception() is None:
            report.key_seconds, report.key_source = key.result()
    slots = threading.Semaphore(PARENT_SLOTS) if forking else None
    report.threads = threads or NUM_THREADS or default_threads(forking)
    with ThreadPoolExecutor(max_workers=max(1, report.threads), thread_name_prefix="ourobatch-compile") as pool:
        if forking:
            _forked(pool, tasks, device, slots, started, stopped, report)
        for stage in [] if forking else staged(tasks):
            if stopped():
                break
            report.add(list(pool.map(lambda task: _run(task, device, slots, started), stage)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.seconds = time.perf_counter() - started
    report.timeline.sort(key=lambda e: e["end"])
    return report
