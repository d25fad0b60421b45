"""PendingStep: a step ModelExecutor.launch() queued on the device, read back by result().

Async scheduling launches step k+1 before it reads step k, so everything that waits for the device is
here, not in launch(): the sampled tokens, their log-probs and top log-probs (copied to pinned host
memory when launched), the check that no sampled logit was non-finite, a prefill's prompt log-probs
(computed now from the prefill's loop-T readouts, kept alive for it), and the step's GPU time. A phase
that fails here becomes a StepFailure, as in launch().
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from scheduler.plan import Phase, PromptLogprobs, StepFailure, StepPlan, StepResult, VerifyResult

from .readout import PendingSample, non_finite_message


class PendingStep:
    def __init__(self, plan: StepPlan, failures: list[StepFailure], timing: tuple | None = None) -> None:
        self.plan = plan
        self.failures = failures  # the phases that raised at launch
        self.sample: PendingSample | None = None  # the batched sampling pass, queued
        self.prompt_job: Callable[[], list[PromptLogprobs]] | None = None  # prompt log-probs, computed at result
        self.verified: list[VerifyResult] = []  # verify mode (read back at launch: it never runs ahead)
        self.timing = timing  # (start, end) CUDA events, when the executor records GPU time
        self.timings: list[float] | None = None  # where that time goes (ModelExecutor.timing)
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """Wait for the step and read it back (once; later calls return the same result)."""
        if self._result is None:
            with torch.inference_mode():
                self._result = self._read()
        return self._result

    def _read(self) -> StepResult:
        failures = list(self.failures)
        prompt_lps: list[PromptLogprobs] = []
        if self.prompt_job is not None:
            try:
                prompt_lps = self.prompt_job()
            except Exception as exc:  # noqa: BLE001 - part of the prefill phase (non-finite logits)
                failures.insert(0, failure(Phase.PREFILL, self.plan.prefills, exc))
        sampled: tuple = ()
        if self.sample is not None:
            ids = tuple(rid for rid, _ in self.sample.items)
            try:
                tokens, bad = self.sample.read()
            except Exception as exc:  # noqa: BLE001
                failures.append(StepFailure(Phase.SAMPLE, ids, f"{type(exc).__name__}: {exc}"))
            else:
                sampled = tuple(tokens)
                if bad:  # the step fails every request it sampled, unless the culprits had already ended
                    failures.append(StepFailure(Phase.SAMPLE, ids, f"FloatingPointError: {non_finite_message(bad)}",
                                                culprit_ids=tuple(bad)))
        if self.timing is not None and self.timings is not None:
            start, end = self.timing
            end.synchronize()
            self.timings.append(start.elapsed_time(end))
        return StepResult(self.plan.step_id, sampled, tuple(failures), tuple(self.verified), tuple(prompt_lps))


def failure(phase: Phase, works, exc: Exception) -> StepFailure:
    return StepFailure(phase, tuple(w.request_id for w in works), f"{type(exc).__name__}: {exc}")


def without_requests(plan: StepPlan, ids: set[str]) -> StepPlan:
    """`plan` without the work of requests `ids` (rows planned ahead for requests that a phase of the step
    before failed: they end in that step's update, and their retained rows or positions no longer line up)."""
    keep = lambda works: tuple(w for w in works if w.request_id not in ids)  # noqa: E731
    return dataclasses.replace(plan, prefills=keep(plan.prefills), shallow=keep(plan.shallow), deep=keep(plan.deep))


def start_timing(device: torch.device, enabled: bool) -> tuple | None:
    """(start, end) CUDA events of a step when the executor records GPU ms (end is recorded at launch's end)."""
    if not enabled or device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end
