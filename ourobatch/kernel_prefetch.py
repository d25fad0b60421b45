"""The startup's compile pass, run beside the weight load, and what the rest of the startup waits for.

Theory of operation. Every kernel specialization's shapes need only the config (engine/kernel_cases.KernelShapes),
so the pass (engine/kernel_warmup.warm_kernels) starts in its own thread before the weights load and its compiles
(forked children, CPU work) run beside the load's copies. ``KernelPrefetch`` is a context manager around the rest
of the startup: ``loaded()``, once the weights are in, waits for the pass (the "kernels" phase).

Early capture (on by default; ``OUROBATCH_EARLY_CAPTURE=0`` turns it off). The pass's tail is one
compile: the loop-pass launch's (engine/gluon_layers.py), ~4.5-6 s on the H200 host beside the others, and in
session 20's cold starts it ended up to ~1.2 s after every other launch; the graph captures (1.3-2.2 s) waited for
it, though only the shallow graphs of at most 8 requests use that launch. With early capture ``loaded()`` waits
only until every other launch has ended (engine/warmup_pass.Milestone) and all of them succeeded; the startup then
captures every graph that does not use the launch, with the capture in thread-local mode (the pass's thread may
still load and launch the kernel, on a stream of its own, meanwhile), and ``finish()`` waits for the rest before
anything that launches it: the kernel check pass, the remaining graphs, the request pass (ourobatch/warmup.py).
A failed launch, or a pass that ended early, turns it back into the plain order.

The block's exit waits for the pass in every case; a block left by an exception first stops it (no further launch
starts); no thread outlives the block. A pass that fails only logs a warning: warm_up's check pass, after the
executor exists, compiles whatever it missed.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from ourobatch.log import get_logger

log = get_logger()

EARLY_ENV = "OUROBATCH_EARLY_CAPTURE"


def early_capture() -> bool:
    """OUROBATCH_EARLY_CAPTURE: "1" (the default: capture the graphs the loop-pass launch is not in while it
    compiles) or "0" (every capture after the whole pass). Measured on the H200 (docs/benchmarks.md, session 24):
    cold ready 6.2-8.1 s with it against 8.3-9.7 s without, side by side."""
    value = os.environ.get(EARLY_ENV, "").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{EARLY_ENV} must be 1 (on) or 0 (off), got {value!r}")
    return value == "1"


class KernelPrefetch:
    """The compile pass beside the weight load (module docstring). `shapes` None: nothing to prefetch (CPU, or
    warmup off); `clock`: the StartupClock whose "kernels" phase counts the waits; `run`: the pass (tests give
    their own: run(shapes, device, should_stop, milestone) -> report); `setup`: the driver and Triton's key, started
    before (engine/warmup_pass.PassSetup; the default pass takes it, else starts its own)."""

    def __init__(self, shapes: Callable[[], Any] | None, device: str, clock, should_stop: Callable[[], bool] | None
                 = None, *, early: bool = False, run: Callable[..., Any] | None = None, setup: Any = None) -> None:
        self.shapes, self.device, self.clock, self.should_stop = shapes, device, clock, should_stop
        self.early, self._run = early, run or functools.partial(_warm_kernels, setup=setup)
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._milestone = None
        self._finished = False
        self.pending = False  # loaded() returned with the loop-pass launch's compile still under way

    def __enter__(self) -> "KernelPrefetch":
        if self.shapes is None:
            return self
        from engine.warmup_pass import Milestone

        self._milestone = Milestone() if self.early else None
        stop = lambda: self._stop.is_set() or bool(self.should_stop and self.should_stop())  # noqa: E731
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ourobatch-prefetch")
        self._future = self._pool.submit(self._pass, stop)
        return self

    def _pass(self, stop: Callable[[], bool]):
        try:
            return self._run(self.shapes, torch.device(self.device), stop, self._milestone)
        finally:
            if self._milestone is not None:
                self._milestone.close()  # (a pass that broke before its launches never reached run_pass)

    def loaded(self) -> None:
        """The weights are in: wait for the pass, or (early capture) for every launch but the loop-pass launch's;
        `pending` then says whether that one may still be compiling."""
        if self._future is None or self._finished:
            return
        if self._milestone is None:
            self.finish()
            return
        with self.clock.phase("kernels"):
            self._milestone.wait()
        m = self._milestone
        self.pending = m.reached and not m.failed and m.late > 0 and not self._future.done()
        if not self.pending:
            self.finish()
        else:
            log.info("warmup_kernels_early", late_launches=self._milestone.late)

    def finish(self) -> None:
        """Wait for the whole pass (the "kernels" phase) and log its report; at most once."""
        if self._future is None or self._finished:
            return
        self._finished, self.pending = True, False
        with self.clock.phase("kernels"):
            error = self._future.exception()  # waits
        if error is not None:
            log.warning("warmup_kernels_prefetch_failed", error=f"{type(error).__name__}: {error}")
        else:
            log_kernels("warmup_kernels_prefetch", self._future.result())

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._pool is None:
            return
        if exc_type is not None:
            self._stop.set()  # the launches under way end; no other starts
        try:
            self.finish()
        finally:
            self._pool.shutdown(wait=True)


def _warm_kernels(shapes: Callable[[], Any], device: torch.device, should_stop: Callable[[], bool], milestone,
                  setup=None):
    from engine import kernel_warmup

    return kernel_warmup.warm_kernels(shapes(), device, should_stop=should_stop, milestone=milestone, setup=setup)


def log_kernels(event: str, report) -> None:
    """A pass's report as one event (and its failures and timeline)."""
    from engine import fork_compile

    for failure in report.failures:
        log.warning("warmup_kernel_failed", error=failure)
    forks = fork_compile.STATS
    log.info(event, launches=report.cases, seconds=round(report.seconds, 2),
             sequential_seconds=round(report.task_seconds, 2), threads=report.threads,
             fork_children=forks.children, fork_compiled=forks.compiled, fork_failed=forks.failed,
             fork_child_seconds=round(forks.child_seconds, 2), fork_seconds=round(forks.fork_seconds, 3),
             fork_on_disk=forks.on_disk, failures=len(report.failures),
             driver_seconds=round(report.driver_seconds, 3), list_seconds=round(report.list_seconds, 3),
             key_seconds=round(report.key_seconds, 3), key_source=report.key_source,
             prepare_seconds=round(report.prepare_seconds, 3))
    log.debug(f"{event}_timeline", tasks=report.timeline)  # by end: where the pass's wall time goes
