"""The startup's compile pass (engine/kernel_warmup.py lists its launches): every launch run once, in threads,
its compiles in forked children (engine/fork_compile.py) where they can be, and a timeline of where the wall time
went.

Theory of operation (forked). The pass is as long as its slowest chain: the loop-pass launch's compile alone takes
~4-5 s on the H200 host, so what matters is how soon its child is forked. Session 20's timeline showed two things
ahead of it: ~1 s before the first launch (Triton's driver, the kernels' per-device caches) and ~1.1 s more before
the first children forked, the first four launches each hashing Triton's own key (~400 MB of libtriton) at the
same time. So: Triton's key is made known once (read back from its cache folder where a process before stored
it, engine/triton_key.py; else hashed; in a forked child either way) and the driver made ready (its gcc build on
an empty cache), each in a thread of its own (PassSetup: the engine's startup starts them beside its checks and
Triton's import, before the pass), while this thread lists the launches; then the kernels' per-device caches
(`_prepare`, ~0.05 s: so two first launches of one kernel cannot race to make them);
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
from dataclasses import dataclass
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
                   triton_sampler, triton_streamk)

    # triton_streamk: one kernel behind two keys (gate_up_stream, qkv_stream) that may launch at once
    modules = [triton_attention, attention_combine, triton_fused, triton_gemm, triton_sampler, triton_streamk]
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


class Milestone:
    """Every launch but the loop-pass launch's ended (the pass's tail: engine/gluon_layers.py's compile alone),
    for a startup that captures the other graphs meanwhile (ourobatch/kernel_prefetch.py). `wait()` returns once
    they have (`reached`), or the pass has ended (whatever happened); `failed`: one of them failed (its kernel may
    then compile on first use, which a capture must not meet)."""

    LATE = "gluon_layers"  # the kernel whose launches do not count

    def __init__(self) -> None:
        self._event, self._lock = threading.Event(), threading.Lock()
        self._left: int | None = None  # the other launches not ended yet (None: the list is not known yet)
        self.failed = False
        self.late = 0  # the launches that do not count

    @property
    def reached(self) -> bool:
        """Every other launch ended (not merely the pass closed it)."""
        return self._left == 0

    def expect(self, tasks: list[Task]) -> None:
        self.late = sum(self.LATE in t.kernels for t in tasks)
        with self._lock:
            self._left = len(tasks) - self.late
        if self.reached:
            self._event.set()

    def ended(self, task: Task, error: str | None) -> None:
        if self.LATE in task.kernels:
            return
        with self._lock:
            self.failed = self.failed or error is not None
            if self._left is not None:
                self._left -= 1
        if self.reached:
            self._event.set()

    def close(self) -> None:
        """The pass has ended: nothing is left to wait for (a pass stopped, or broken, before its launches)."""
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


@dataclass
class _Pass:
    """What every launch of one pass shares."""

    device: torch.device
    zero: float  # the pass's start (timeline times are from it)
    slots: threading.Semaphore | None = None  # forked: parent slots
    milestone: Milestone | None = None
    stream: "torch.cuda.Stream | None" = None  # with a milestone (CUDA): the launches' own stream


def _run(task: Task, ps: _Pass, forked: threading.Event | None = None) -> tuple[str, float, str | None, dict]:
    """The launch of `task`: its name, seconds, error (None) and timeline entry (warmup_order.entry, times from
    the pass's start); `forked` is set once its first child is forked (or it ends without one)."""
    times, error, children, done = {"queued": time.perf_counter()}, None, [], False
    try:
        with fork_compile.recording(None if forked is None else forked.set) as children:
            try:  # (CPU tensors: Triton's interpreter, TRITON_INTERPRET=1, for tests)
                with (fork_compile.parent_slot(ps.slots), fork_compile.compiles_in_children(ps.slots is not None),
                      torch.cuda.device(ps.device) if ps.device.type == "cuda" else contextlib.nullcontext(),
                      torch.cuda.stream(ps.stream) if ps.stream is not None else contextlib.nullcontext(),
                      torch.inference_mode()):
                    times["slot"] = time.perf_counter()
                    task.launch()
            except Exception as exc:  # noqa: BLE001 - the kernel compiles on first use instead; reported
                error = f"{task.name}: {type(exc).__name__}: {exc}"
        done = True
    finally:
        if forked is not None:
            forked.set()
        if ps.milestone is not None:
            ps.milestone.ended(task, error if done else f"{task.name}: interrupted")
    times["end"] = time.perf_counter()
    return task.name, times["end"] - times["queued"], error, entry(task, times, children, ps.zero)


def _forked(pool: ThreadPoolExecutor, tasks: list[Task], ps: _Pass, stopped: Callable[[], bool],
            report: KernelReport) -> None:
    """The head alone, one launch at a time until its child is forked (or it ends); then the rest at once."""
    head, rest = head_first(tasks)
    futures: list[Future] = []
    for task in head:
        if stopped():
            break
        forked = threading.Event()
        futures.append(pool.submit(_run, task, ps, forked))
        forked.wait(HEAD_WAIT_S)
    if not stopped():
        futures += [pool.submit(_run, task, ps) for task in rest]
    report.add([f.result() for f in futures])


class PassSetup:
    """What the pass needs before its first fork, started early: Triton's driver (its first use in a process builds
    its utilities with gcc: 0.4-1.4 s on an empty cache on the H200 host) and Triton's own key (fork_compile.
    prime_key), each in a thread of its own, and whether the launches fork. The engine's startup starts it as soon
    as the compile cache's folder is set (ourobatch/assembly.py), so both run beside its checks and Triton's import
    (0.4-0.7 s) instead of after them; a pass without one starts its own. A context manager: its exit waits for
    both threads. CUDA devices only (elsewhere nothing starts and nothing forks)."""

    def __init__(self, device: torch.device) -> None:
        on = device.type == "cuda" and fork_compile.enabled()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ourobatch-pass-setup") if on else None
        self.key = self._pool.submit(_key) if self._pool else None
        self.driver = self._pool.submit(_timed, _driver, device) if self._pool else None

    def __enter__(self) -> "PassSetup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def forking(self, report: KernelReport) -> bool:
        """Waits for the driver: whether the launches can fork (its seconds into `report`)."""
        if self.driver is None:
            return False
        ready, report.driver_seconds = self.driver.result()
        return ready and fork_compile.available()

    def key_into(self, report: KernelReport) -> None:
        """Waits for the key: its seconds and source into `report` (nothing where it failed: the launches hash)."""
        if self.key is not None and self.key.exception() is None and self.key.result() is not None:
            report.key_seconds, report.key_source = self.key.result()


def _key() -> tuple[float, str] | None:
    return fork_compile.prime_key() if fork_compile.available() else None


def _before(device: torch.device, tasks_of: Callable[[], list[Task]], report: KernelReport,
            started: float, setup: PassSetup | None = None) -> tuple[list[Task], bool]:
    """The launch list, beside `setup`'s driver and key (this pass's own where none is given), then the kernels'
    per-device caches. Returns the list and whether the launches fork."""
    own = setup is None
    setup = PassSetup(device) if own else setup
    try:
        tasks = tasks_of()
        report.list_seconds = time.perf_counter() - started
        forking = setup.forking(report)
        t = time.perf_counter()
        forking = forking and _prepare(device)
        report.prepare_seconds = time.perf_counter() - t
        setup.key_into(report)
    finally:
        if own:
            setup.close()
    return tasks, forking


def _timed(fn: Callable, *args) -> tuple:
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def run_pass(tasks_of: Callable[[], list[Task]], device: torch.device, threads: int | None = None,
             should_stop: Callable[[], bool] | None = None, milestone: Milestone | None = None,
             setup: PassSetup | None = None) -> KernelReport:
    """Run every launch `tasks_of()` lists (CUDA: forked where fork_compile is available), `threads` at a time
    (default: NUM_THREADS, else default_threads); `should_stop()` true: no further launch starts. `milestone`: told
    of each launch's end (closed when the pass ends, however); the launches then run on a stream of their own, and
    the pass ends by syncing it, not the device (a graph may be capturing in another thread meanwhile). `setup`:
    the driver and key started before the pass (PassSetup; else the pass starts its own)."""
    report, started = KernelReport(), time.perf_counter()
    stopped = lambda: should_stop is not None and bool(should_stop())  # noqa: E731
    try:
        tasks, forking = _before(device, tasks_of, report, started, setup)
        if milestone is not None:
            milestone.expect(tasks)
        ps = _Pass(device, started, threading.Semaphore(PARENT_SLOTS) if forking else None, milestone,
                   torch.cuda.Stream(device) if milestone is not None and device.type == "cuda" else None)
        report.threads = threads or NUM_THREADS or default_threads(forking)
        with ThreadPoolExecutor(max_workers=max(1, report.threads), thread_name_prefix="ourobatch-compile") as pool:
            if forking:
                _forked(pool, tasks, ps, stopped, report)
            for stage in [] if forking else staged(tasks):
                if stopped():
                    break
                report.add(list(pool.map(lambda task: _run(task, ps), stage)))
        if ps.stream is not None:
            ps.stream.synchronize()
        elif device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        if milestone is not None:
            milestone.close()
    report.seconds = time.perf_counter() - started
    report.timeline.sort(key=lambda e: e["end"])
    return report
