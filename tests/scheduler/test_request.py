import itertools

import pytest

from ourobatch.scheduler import TRANSITIONS, InvalidTransition, Request, RequestStatus, SamplingParams, set_status


def make(status: RequestStatus) -> Request:
    r = Request("r1", (1, 2), SamplingParams(seed=1), frozenset(), 0)
    r.status = status
    return r


@pytest.mark.parametrize("old,new", list(itertools.product(RequestStatus, RequestStatus)))
def test_every_transition_is_decided_by_the_table(old, new):
    r = make(old)
    if new in TRANSITIONS[old]:
        set_status(r, new)
        assert r.status == new
    else:
        with pytest.raises(InvalidTransition, match=f"req r1: {old.name} -> {new.name}"):
            set_status(r, new)
        assert r.status == old


def test_terminal_statuses_sort_last_and_have_no_exit():
    live = [s for s in RequestStatus if not s.is_finished]
    done = [s for s in RequestStatus if s.is_finished]
    assert max(live) < min(done)
    assert all(not TRANSITIONS[s] for s in done)
    assert {s.finish_reason for s in done} == {"stop", "length", "abort", "error"}
    assert all(s.finish_reason is None for s in live)


def test_every_live_status_can_be_aborted_or_failed():
    for s in RequestStatus:
        if not s.is_finished:
            assert RequestStatus.FINISHED_ABORTED in TRANSITIONS[s]
            assert RequestStatus.FINISHED_ERROR in TRANSITIONS[s]
