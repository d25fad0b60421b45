"""Property-based test of the scheduler core: hypothesis drives random arrivals, aborts (also while a
step is in flight), stops and injected phase failures, and the invariants are checked after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler import Phase, RequestRejectedError, SamplingParams

from .conftest import check_block_refs, check_cohort_clocks, make_scheduler
from .fakes import FakeExecutor


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(B=st.sampled_from([1, 2, 3, 4, 8]), mode=st.sampled_from(["deferred", "eager", "verify"]),
                blocks=st.integers(4, 30), max_seqs=st.integers(1, 6))
    def setup(self, B, mode, blocks, max_seqs):
        self.B, self.mode = B, mode
        self.sched = make_scheduler(deep_interval=B, mode=mode, num_kv_blocks=blocks, block_size=4,
                                    max_num_seqs=max_seqs)
        self.ex = FakeExecutor()
        self.ended: dict[str, str] = {}
        self.added: set[str] = set()
        self.n = 0

    @rule(prompt_len=st.integers(1, 9), max_tokens=st.integers(1, 14), stop_at=st.none() | st.integers(1, 8))
    def add(self, prompt_len, max_tokens, stop_at):
        rid = f"r{self.n}"
        self.n += 1
        if stop_at is not None:
            self.ex.stop_at[rid] = stop_at
        try:
            self.sched.add(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, seed=self.n))
            self.added.add(rid)
        except RequestRejectedError:
            pass

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        assert self.sched.abort(rid).finished
        self._end(rid, "abort")

    @rule(fail=st.none() | st.sampled_from(list(Phase)), abort_in_flight=st.booleans(), data=st.data())
    def step(self, fail, abort_in_flight, data):
        if fail is not None:
            self.ex.fail[self.sched._next_step] = fail
        plan = self.sched.schedule()
        result = self.ex.execute(plan)
        if abort_in_flight and self.sched.requests:
            rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
            self.sched.abort(rid)
            self._end(rid, "abort")
        for u in self.sched.update(plan, result):
            if u.finished:
                self._end(u.request.request_id, u.request.finish_reason)

    def _end(self, rid, reason):
        assert rid not in self.ended, f"{rid} ended twice"
        self.ended[rid] = reason

    @invariant()
    def blocks_match_live_reservations(self):
        if hasattr(self, "sched"):
            check_block_refs(self.sched)

    @invariant()
    def every_request_is_live_or_ended_once(self):
        assert set(self.sched.requests) | set(self.ended) == self.added
        assert not set(self.sched.requests) & set(self.ended)

    @invariant()
    def cohort_members_share_the_clock(self):
        if hasattr(self, "sched"):
            check_cohort_clocks(self.sched, self.B, self.mode)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for rid in list(self.sched.requests):
            self.sched.abort(rid)
        assert self.sched.blocks.num_used == 0
        self.ex.execute(self.sched.schedule())
        assert self.ex.retained == {}


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None, derandomize=True,
                                         suppress_health_check=[HealthCheck.too_slow])
