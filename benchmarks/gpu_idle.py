"""GPU idle time between engine steps, measured so that pipelined (async-scheduled) steps are seen too.

With async scheduling the engine's StepPipeline launches step k+1 (``executor.launch(plan)``) before it
reads step k (``PendingStep.result()``), so host clocks around schedule / update / execute no longer say
whether the device waited. ``StepGaps`` wraps the executor's ``launch`` (the one entry every step takes:
``ModelExecutor.execute`` is ``launch(plan).result()``) and records a CUDA event on the current stream
before the step's first kernel is queued and one after its last (sampling and the copies of its tokens
included); a plan with no work (only releases) is not a step. On one stream the events run in queue
order, so for consecutive steps k, k+1:

    idle(k) = start(k+1) - end(k) >= 0     (device clock: the stream had nothing to run)

is the time the GPU sat between the two steps waiting for the host; with the next step queued ahead it is
~0. ``gpu_idle_share`` = sum of idle / (end(last) - start(first)), the step phase's span on the device.
It is a lower bound: host work inside ``launch`` before its first kernel (building the inputs, the table
rows) counts as part of the step, and gaps between kernels inside a step are not seen.

On the CPU (no CUDA events) host clocks stand in: start when ``launch`` is called, end when it returns
(the CPU runs the step's work inside it), so the smoke tests exercise the same bookkeeping.
"""

from __future__ import annotations

import statistics
import time

import torch


def idle_between(marks: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """(span, idle, gaps) of step marks (start, end) in seconds, in launch order: span = last end - first
    start, gaps[k] = max(0, start[k+1] - end[k]), idle = sum(gaps)."""
    if not marks:
        return 0.0, 0.0, []
    gaps = [max(0.0, marks[k + 1][0] - marks[k][1]) for k in range(len(marks) - 1)]
    return marks[-1][1] - marks[0][0], sum(gaps), gaps


class StepGaps:
    """Start / end marks of every step `executor` launches while installed (install() ... remove())."""

    def __init__(self, executor, cuda: bool) -> None:
        self.executor, self.cuda = executor, cuda
        self.marks: list[tuple[object, object]] = []  # (start, end): CUDA events or host seconds
        # an executor without launch() runs each step in execute() (pipeline.launch's fallback)
        self._name = "launch" if hasattr(type(executor), "launch") else "execute"

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def install(self) -> None:
        inner = getattr(self.executor, self._name)

        def timed(plan):
            if not (plan.prefills or plan.shallow or plan.deep):  # release-only: no device work, not a step
                return inner(plan)
            start = self._mark()
            out = inner(plan)
            self.marks.append((start, self._mark()))
            return out

        setattr(self.executor, self._name, timed)  # an instance attribute shadowing the class's method

    def remove(self) -> None:
        if self._name in vars(self.executor):
            delattr(self.executor, self._name)

    def seconds(self) -> list[tuple[float, float]]:
        """The marks as seconds since the first step's start (waits for the device on CUDA)."""
        if not self.marks:
            return []
        if not self.cuda:
            t0 = self.marks[0][0]
            return [(s - t0, e - t0) for s, e in self.marks]
        torch.cuda.synchronize()
        first = self.marks[0][0]
        return [(first.elapsed_time(s) / 1e3, first.elapsed_time(e) / 1e3) for s, e in self.marks]

    def summary(self) -> dict:
        span, idle, gaps = idle_between(self.seconds())
        ms = sorted(1e3 * g for g in gaps)
        return dict(clock="cuda_events" if self.cuda else "host", steps=len(self.marks), span_s=span, idle_s=idle,
                    gpu_idle_share=idle / span if span > 0 else None,
                    gap_ms_p50=statistics.median(ms) if ms else None, gap_ms_max=ms[-1] if ms else None)
