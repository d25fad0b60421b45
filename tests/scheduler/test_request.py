import itertools

import pytest

from scheduler import TRANSITIONS, InvalidTransition, Request, RequestStatus, SamplingParams, set_status


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


def test_positions_follow_the_docstring_rule_token_k_is_fed_at_p_plus_k_minus_1():
    r = Request("r1", (5, 6, 7), SamplingParams(seed=1, max_tokens=4, logprobs=1), frozenset({0}), 0)
    r.append_output(8, -0.5, 4, 3, ((8, -0.5),))
    assert (r.num_tokens, r.all_token_ids, r.feed_position) == (4, (5, 6, 7, 8), 3)  # token 1 at P + 0
    assert (r.logprobs, r.readout_loops, r.weight_versions, r.top_logprobs) == ([-0.5], [4], [3], [{8: -0.5}])
    r.draft_token_ids = [9, 10]  # verify mode: drafts are fed too, but are no outputs
    assert (r.num_tokens, r.num_tokens_with_drafts, r.feed_position, r.can_feed) == (4, 6, 5, True)
    r.draft_token_ids = [9, 10, 11]  # outputs + drafts reach max_tokens: nothing more to feed
    assert not r.can_feed
    r.draft_token_ids = [0]  # a drafted stop token waits for its boundary too
    assert not r.can_feed and r.stop_status() is None


def test_stop_status_a_stop_token_before_max_tokens():
    r = Request("r1", (5,), SamplingParams(seed=1, max_tokens=2), frozenset({0}), 0)
    r.append_output(3, -1.0, 2, 0, None)
    assert r.stop_status() is None and r.top_logprobs is None and r.cumulative_logprob == -1.0
    r.append_output(0, -1.0, 2, 0, None)  # both rules hold: the stop token wins
    assert r.stop_status() == RequestStatus.FINISHED_STOPPED
    r.output_token_ids[-1] = 4
    assert r.stop_status() == RequestStatus.FINISHED_LENGTH
