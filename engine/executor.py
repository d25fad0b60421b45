"""ModelExecutor: runs a StepPlan on the model and the paged pool, returns a StepResult.

Order within a step: prefills (loops 1..T), the shallow call (one fed token per decoding request,
loops 1..last_loop), the deep call (retained rows of every boundary request, loops first_loop..T, one
batch), then one batched sampling pass over every work item that carries a SampleSpec.

Retained rows (deferred mode) are per-request tensors kept here, keyed by request id: the loop-s
readout of each fed position whose deep loops have not run. A DeepWork consumes them; a released
request's rows are dropped unread. A failing phase is reported as a StepFailure, never raised: the
scheduler decides who ends with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ourobatch.scheduler.plan import (
    DeepWork,
    Phase,
    PrefillWork,
    SampledToken,
    SampleSpec,
    ShallowWork,
    StepFailure,
    StepPlan,
    StepResult,
)

from .attention import SeqSpan
from .kv_cache import KVPool
from .model import BatchMeta, OuroForCausalLM
from .sampler import sample


@dataclass
class RetainedRows:
    start_position: int  # position of rows[0]
    rows: list[torch.Tensor] = field(default_factory=list)  # each [hidden], loop-s readouts


class ModelExecutor:
    def __init__(self, model: OuroForCausalLM, pool: KVPool, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.pool = pool
        self.device = torch.device(device)
        self.total_ut_steps = model.config.total_ut_steps
        self.retained: dict[str, RetainedRows] = {}
        # Tests set this to raise inside a phase: called as fault_hook(phase, request_ids) at its start.
        self.fault_hook: Callable[[Phase, tuple[str, ...]], None] | None = None

    def _enter(self, phase: Phase, works) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase, tuple(w.request_id for w in works))

    # ------------------------------------------------------------------ the seam

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.released_request_ids:
            self.retained.pop(rid, None)
        failures: list[StepFailure] = []
        to_sample: list[tuple[str, SampleSpec, torch.Tensor]] = []  # (request, spec, readout row)
        failed: set[str] = set()

        if plan.prefills:
            try:
                self._enter(Phase.PREFILL, plan.prefills)
                to_sample += self._prefill(plan.prefills)
            except Exception as exc:  # noqa: BLE001 - reported to the scheduler as data
                failures.append(_failure(Phase.PREFILL, plan.prefills, exc))
        if plan.shallow:
            try:
                self._enter(Phase.SHALLOW, plan.shallow)
                to_sample += self._shallow(plan.shallow)
            except Exception as exc:  # noqa: BLE001
                failures.append(_failure(Phase.SHALLOW, plan.shallow, exc))
                failed.update(w.request_id for w in plan.shallow)
        deep = [d for d in plan.deep if d.request_id not in failed]
        if deep:
            try:
                self._enter(Phase.DEEP, deep)
                to_sample += self._deep(deep)
            except Exception as exc:  # noqa: BLE001
                failures.append(_failure(Phase.DEEP, deep, exc))
            finally:
                for d in deep:  # consumed, or discarded with a failed (closing) cohort
                    self.retained.pop(d.request_id, None)
        sampled: list[SampledToken] = []
        if to_sample:
            try:
                sampled = self._sample(to_sample)
            except Exception as exc:  # noqa: BLE001
                failures.append(StepFailure(Phase.SAMPLE, tuple(r for r, _, _ in to_sample), repr(exc)))
        return StepResult(plan.step_id, tuple(sampled), tuple(failures))

    # ------------------------------------------------------------------ phases

    def _meta(self, items: list[tuple[tuple[int, ...], int, int]]) -> BatchMeta:
        """items: (block_ids, first position, num rows) per request, rows contiguous in that order."""
        positions, slots, spans = [], [], []
        row = 0
        for block_ids, start, n in items:
            pos = torch.arange(start, start + n, device=self.device)
            positions.append(pos)
            slots.append(self.pool.slots_for(block_ids, pos))
            spans.append(SeqSpan(row, n, start + n, block_ids))
            row += n
        return BatchMeta(torch.cat(positions), torch.cat(slots), spans)

    def _prefill(self, works: tuple[PrefillWork, ...]) -> list[tuple[str, SampleSpec, torch.Tensor]]:
        ids = torch.tensor([t for w in works for t in w.token_ids], dtype=torch.long, device=self.device)
        meta = self._meta([(w.block_ids, w.start_position, len(w.token_ids)) for w in works])
        h_T = self.model.run_loops(self.model.embed(ids), meta, self.pool, 1, self.total_ut_steps)[-1]
        out = []
        for w, span in zip(works, meta.spans):
            if w.sample is not None:
                out.append((w.request_id, w.sample, h_T[span.row_start + span.num_rows - 1]))
        return out

    def _shallow(self, works: tuple[ShallowWork, ...]) -> list[tuple[str, SampleSpec, torch.Tensor]]:
        out = []
        by_depth: dict[int, list[ShallowWork]] = {}
        for w in works:
            by_depth.setdefault(w.last_loop, []).append(w)
        for last_loop, group in by_depth.items():
            ids = torch.tensor([w.token_id for w in group], dtype=torch.long, device=self.device)
            meta = self._meta([(w.block_ids, w.position, 1) for w in group])
            readouts = self.model.run_loops(self.model.embed(ids), meta, self.pool, 1, last_loop)
            for i, w in enumerate(group):
                if w.retain:
                    kept = self.retained.get(w.request_id)
                    if kept is None:
                        kept = self.retained[w.request_id] = RetainedRows(w.position)
                    assert kept.start_position + len(kept.rows) == w.position, (
                        f"req {w.request_id}: retained rows end at {kept.start_position + len(kept.rows)}, "
                        f"fed position {w.position}")
                    kept.rows.append(readouts[-1][i])
                if w.sample is not None:
                    out.append((w.request_id, w.sample, readouts[w.sample.loop - 1][i]))
        return out

    def _deep(self, works: list[DeepWork]) -> list[tuple[str, SampleSpec, torch.Tensor]]:
        rows = []
        first_loop = works[0].first_loop
        for d in works:
            assert d.first_loop == first_loop, "one deep call runs one loop range"
            kept = self.retained.get(d.request_id)
            if kept is None or kept.start_position != d.start_position or len(kept.rows) != d.num_rows:
                have = None if kept is None else (kept.start_position, len(kept.rows))
                raise RuntimeError(f"req {d.request_id}: deep work wants rows ({d.start_position}, "
                                   f"{d.num_rows}) but the engine retains {have}")
            rows.extend(kept.rows)
        h = torch.stack(rows)  # [sum rows, hidden], loop first_loop-1 readouts
        meta = self._meta([(d.block_ids, d.start_position, d.num_rows) for d in works])
        h_T = self.model.run_loops(h, meta, self.pool, first_loop, self.total_ut_steps)[-1]
        out = []
        for d, span in zip(works, meta.spans):
            if d.sample is not None:
                out.append((d.request_id, d.sample, h_T[span.row_start + span.num_rows - 1]))
        return out

    def _sample(self, items: list[tuple[str, SampleSpec, torch.Tensor]]) -> list[SampledToken]:
        logits = self.model.logits(torch.stack([h for _, _, h in items]))
        result = sample(logits, [spec.params for _, spec, _ in items], [spec.token_index for _, spec, _ in items])
        return [
            SampledToken(rid, tok, lp, spec.loop, top)
            for (rid, spec, _), tok, lp, top in zip(items, result.token_ids, result.logprobs, result.top_logprobs)
        ]


def _failure(phase: Phase, works, exc: Exception) -> StepFailure:
    return StepFailure(phase, tuple(w.request_id for w in works), f"{type(exc).__name__}: {exc}")
