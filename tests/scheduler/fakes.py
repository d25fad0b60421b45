"""A torch-free executor double: fabricates tokens, checks the plan's positions, injects failures."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from scheduler.plan import Phase, SampledToken, StepFailure, StepPlan, StepResult, VerifyResult

STOP = 0  # the fake checkpoint's eos


@dataclass
class FakeExecutor:
    vocab_size: int = 50
    shallow_loops: int = 2
    total_ut_steps: int = 4
    stop_at: dict[str, int] = field(default_factory=dict)  # request id -> j of a generated eos
    fail: dict[int, Phase] = field(default_factory=dict)  # step id -> phase that raises
    plans: list[StepPlan] = field(default_factory=list)
    retained: dict[str, list[int]] = field(default_factory=dict)  # request -> retained positions
    fed: dict[str, list[int]] = field(default_factory=dict)  # request -> every position it wrote

    def token(self, rid: str, j: int) -> int:
        if self.stop_at.get(rid) == j:
            return STOP
        return 1 + zlib.crc32(f"{rid}/{j}".encode()) % (self.vocab_size - 1)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for rid in plan.released_request_ids:
            self.retained.pop(rid, None)
        failing = self.fail.get(plan.step_id)
        failures, sampled, verified = [], [], []
        specs = []
        if plan.prefills:
            if failing == Phase.PREFILL:
                failures.append(StepFailure(Phase.PREFILL, tuple(w.request_id for w in plan.prefills), "boom"))
            else:
                for w in plan.prefills:
                    if w.sample_from is not None:  # a fork: every prompt position shared, nothing written
                        assert not w.token_ids and w.sample_from in {p.request_id for p in plan.prefills}
                        self.fed[w.request_id] = list(range(w.start_position))
                    self.fed.setdefault(w.request_id, []).extend(
                        range(w.start_position, w.start_position + len(w.token_ids)))
                    specs.append((w.request_id, w.sample))
        shallow_failed = set()
        if plan.shallow:
            if failing == Phase.SHALLOW:
                shallow_failed = {w.request_id for w in plan.shallow}
                failures.append(StepFailure(Phase.SHALLOW, tuple(sorted(shallow_failed)), "boom"))
            else:
                for w in plan.shallow:
                    fed = self.fed[w.request_id]
                    assert w.position == fed[-1] + 1, (w, fed[-1])
                    fed.append(w.position)
                    if w.retain:
                        kept = self.retained.setdefault(w.request_id, [])
                        assert not kept or kept[-1] + 1 == w.position
                        kept.append(w.position)
                    specs.append((w.request_id, w.sample))
        deep = [d for d in plan.deep if d.request_id not in shallow_failed]
        if deep:
            if failing == Phase.DEEP:
                failures.append(StepFailure(Phase.DEEP, tuple(d.request_id for d in deep), "boom"))
            else:
                for d in deep:
                    kept = self.retained.pop(d.request_id)
                    assert kept == list(range(d.start_position, d.start_position + d.num_rows)), (d, kept)
                    if d.verify:
                        verified.append(self.verify(d))
                    else:
                        specs.append((d.request_id, d.sample))
            for d in deep:
                self.retained.pop(d.request_id, None)
        for rid, spec in specs:
            if spec is not None:
                sampled.append(SampledToken(rid, self.token(rid, spec.token_index), -0.5, spec.loop))
        return StepResult(plan.step_id, tuple(sampled), tuple(failures), tuple(verified))

    def verify(self, d) -> VerifyResult:
        """Accept a pseudo-random prefix of the drafts; a rejection rolls the fed frontier back."""
        drafts = d.draft_token_ids
        assert d.num_rows in (len(drafts), len(drafts) + 1), d
        first = d.sample.token_index - len(drafts)
        accepted = 0
        while accepted < len(drafts) and zlib.crc32(f"{d.request_id}/a{first + accepted}".encode()) % 4:
            accepted += 1
        j = first + accepted
        token = self.token(d.request_id, j) if accepted < len(drafts) or d.num_rows > len(drafts) else None
        # row i fed the token before draft i: positions after the last accepted draft's row roll back
        keep = d.start_position + accepted + 1
        self.fed[d.request_id] = [p for p in self.fed[d.request_id] if p < keep]
        return VerifyResult(d.request_id, accepted, (-0.25,) * accepted, token, -0.5 if token is not None else None)
