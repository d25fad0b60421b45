"""ourobatch/runtime/cursor.py: the one output cursor of the engine's collectors and the pool's flights.
What a reader gets per output kind, over a plain source written here, and over the pool's real Flight
(Ray-free) across a retry that stitches a completion from two engine requests. Torch-free; every expected
output is written out."""

from __future__ import annotations

import pytest

from ourobatch.outputs import CompletionOutput, Logprob, RequestOutput
from ourobatch.ray.flight import Flight, SubRequest
from ourobatch.runtime.cursor import OutputCursor
from scheduler.params import RequestOutputKind, SamplingParams

DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY
PROMPT_LOGPROBS = [None, {7: Logprob(-0.5, 1)}]


class Source:
    """A request of n completions whose tokens are appended by hand."""

    def __init__(self, n: int, prompt_logprobs=None) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.prompt_logprobs = prompt_logprobs

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.reasons)

    def num_tokens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def output(self, since=None) -> RequestOutput:
        outs = [CompletionOutput(i, t[since[i] if since else 0:], [-1.0] * (len(t) - (since[i] if since else 0)),
                                 [4] * (len(t) - (since[i] if since else 0)), -1.0 * len(t), self.reasons[i], seed=i)
                for i, t in enumerate(self.tokens)]
        return RequestOutput("r", [7, 7], outs, self.finished, self.prompt_logprobs)


def tokens(out: RequestOutput | None) -> list[list[int]] | None:
    return None if out is None else [c.token_ids for c in out.outputs]


def test_delta_hands_over_each_token_once_and_the_end_once():
    src, cursor = Source(1), OutputCursor(1, DELTA)
    assert not cursor.pending(src)
    src.tokens[0] += [5, 6]
    assert cursor.pending(src)
    assert tokens(cursor.take(src)) == [[5, 6]] and not cursor.pending(src)
    src.tokens[0] += [8]
    out = cursor.take(src)
    assert tokens(out) == [[8]] and out.outputs[0].logprobs == [-1.0] and out.outputs[0].readout_loops == [4]
    assert out.outputs[0].cumulative_logprob == -3.0  # a running total, not sliced
    assert not out.finished and not cursor.sent_final
    src.reasons[0] = "length"  # ends with no new token: one more (empty) delta carries the end
    assert cursor.pending(src)
    out = cursor.take(src)
    assert tokens(out) == [[]] and out.finished and out.outputs[0].finish_reason == "length"
    assert cursor.sent_final and not cursor.pending(src)


def test_cumulative_hands_over_everything_every_time():
    src, cursor = Source(1), OutputCursor(1, CUMULATIVE)
    src.tokens[0] += [5, 6]
    assert tokens(cursor.take(src)) == [[5, 6]]
    src.tokens[0] += [8]
    src.reasons[0] = "stop"
    out = cursor.take(src)
    assert tokens(out) == [[5, 6, 8]] and out.finished and cursor.sent_final and not cursor.pending(src)


def test_final_only_gives_nothing_until_the_end_and_is_not_pending_meanwhile():
    src, cursor = Source(1), OutputCursor(1, FINAL_ONLY)
    src.tokens[0] += [5, 6]
    assert cursor.pending(src)  # new tokens wake a reader, which takes nothing ...
    assert cursor.take(src) is None and not cursor.sent_final
    assert not cursor.pending(src)  # ... and is not woken again by what it has seen
    src.tokens[0] += [8]
    assert cursor.take(src) is None
    src.reasons[0] = "length"
    assert cursor.pending(src)
    out = cursor.take(src)
    assert tokens(out) == [[5, 6, 8]] and out.finished and cursor.sent_final and not cursor.pending(src)


def test_n_completions_advance_independently():
    src, cursor = Source(3), OutputCursor(3, DELTA)
    src.tokens[0] += [1, 2]
    src.tokens[2] += [9]
    assert tokens(cursor.take(src)) == [[1, 2], [], [9]] and cursor.delivered == [2, 0, 1]
    src.tokens[1] += [4, 4, 4]
    src.reasons[0] = "stop"  # one completion ends: the request does not
    out = cursor.take(src)
    assert tokens(out) == [[], [4, 4, 4], []] and not out.finished and not cursor.sent_final
    assert [c.finish_reason for c in out.outputs] == ["stop", None, None]
    src.tokens[2] += [3]
    src.reasons[1:] = ["length", "length"]
    assert tokens(cursor.take(src)) == [[], [], [3]] and cursor.sent_final


@pytest.mark.parametrize("kind, carried", [(DELTA, [True, False, False]), (CUMULATIVE, [True, True, True])])
def test_prompt_logprobs_once_in_a_delta_stream_every_time_otherwise(kind, carried):
    src, cursor = Source(1, PROMPT_LOGPROBS), OutputCursor(1, kind)
    got = []
    for token in (5, 6, 7):
        src.tokens[0].append(token)
        got.append(cursor.take(src).prompt_logprobs is not None)
    assert got == carried


def test_prompt_logprobs_that_arrive_late_are_still_carried_once():
    src, cursor = Source(1), OutputCursor(1, DELTA)
    src.tokens[0].append(5)
    assert cursor.take(src).prompt_logprobs is None  # not computed yet
    src.prompt_logprobs = PROMPT_LOGPROBS
    src.tokens[0].append(6)
    assert cursor.take(src).prompt_logprobs == PROMPT_LOGPROBS
    src.tokens[0].append(7)
    assert cursor.take(src).prompt_logprobs is None


# ---------------------------------------------------------------------- the pool's Flight, retried

def engine_output(index: int, token_ids: list[int], total: float, reason: str | None = None) -> CompletionOutput:
    """An engine request's DELTA output: its new tokens, each of log-prob -0.25, and its running total."""
    return CompletionOutput(index, token_ids, [-0.25] * len(token_ids), [4] * len(token_ids), total, reason, seed=0)


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
def test_a_retried_flight_resumes_from_what_the_caller_was_given(kind):
    params = SamplingParams(n=2, max_tokens=5, seed=11, output_kind=DELTA)
    flight = Flight("f", [1, 2, 3], params, kind)
    assert flight.cursor.kind == kind
    first = SubRequest(flight, "f", [1, 2, 3], params, [0, 1])  # both completions on one replica, DELTA
    flight.merge(first, RequestOutput("f", [1, 2, 3], [engine_output(0, [10, 11], -0.5),
                                                       engine_output(1, [20], -0.25)]))
    got = [tokens(flight.take())]
    # the replica dies: each unfinished completion continues elsewhere from prompt + its tokens
    retries = flight.retry_subrequests(first)
    assert [s.prompt_token_ids for s in retries] == [[1, 2, 3, 10, 11], [1, 2, 3, 20]]
    assert [s.params.max_tokens for s in retries] == [3, 4]
    flight.merge(retries[1], RequestOutput("f:1", [1, 2, 3, 20], [engine_output(0, [21, 22], -0.5)]))
    got.append(tokens(flight.take()))
    flight.merge(retries[0], RequestOutput("f:0", [1, 2, 3, 10, 11], [engine_output(0, [12], -0.25, "stop")]))
    flight.merge(retries[1], RequestOutput("f:1", [1, 2, 3, 20], [engine_output(0, [23, 24], -1.0, "length")]))
    out = flight.take()
    got.append(tokens(out))
    assert out.finished and flight.cursor.sent_final and not flight.pending()
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
    expected = {
        DELTA: [[[10, 11], [20]], [[], [21, 22]], [[12], [23, 24]]],
        CUMULATIVE: [[[10, 11], [20]], [[10, 11], [20, 21, 22]], [[10, 11, 12], [20, 21, 22, 23, 24]]],
        FINAL_ONLY: [None, None, [[10, 11, 12], [20, 21, 22, 23, 24]]],
    }[kind]
    assert got == expected
    if kind != FINAL_ONLY:  # the stitched counters run over the whole completion
        assert [c.cumulative_logprob for c in out.outputs] == [-0.75, -1.25]


def test_a_flight_that_failed_raises_instead_of_reading():
    flight = Flight("f", [1], SamplingParams(max_tokens=2, seed=1), DELTA)
    flight.fail(RuntimeError("replica 0 died"))
    with pytest.raises(RuntimeError, match="replica 0 died"):
        flight.take()
