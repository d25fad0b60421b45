"""Verify mode's two scheduler steps: plan a request's drafts and their check, apply the verdict.

Between boundaries a verify-mode request draws drafts from loop s (fed forward, not outputs). At its
cohort's boundary one DeepWork runs loops s+1..T over every retained row and the engine tests each draft
against loop T (engine/verify.py); ``apply_verify`` appends the accepted prefix and the residual or
next token as outputs and rolls every later position back (only lengths move). Both take the request
and plain values; the scheduler ends a request whose verified tokens stop it.
"""

from __future__ import annotations

from .config import SchedulerConfig
from .counters import SchedulerCounters
from .plan import DeepWork, SampleSpec, ShallowWork, VerifyResult
from .request import Request, RequestStatus


def plan_verify(config: SchedulerConfig, r: Request, cohort_id: int, boundary: bool, shallow: list[ShallowWork],
                deep: list[DeepWork]) -> None:
    """Verify mode: draft from loop s between boundaries; at a boundary verify every draft against loop T.

    A request whose drafts already reach max_tokens, or end in a stop token, feeds nothing more and
    waits for the boundary (it cannot end on an unverified token).
    """
    s, T = config.shallow_loops, config.total_ut_steps
    drafts = r.draft_token_ids
    k = r.num_output_tokens + len(drafts)  # tokens so far, verified or not
    frontier = r.feed_position  # end of the fed positions; token k goes here when fed
    if r.can_feed:
        last = drafts[-1] if drafts else r.output_token_ids[-1]
        spec = None if boundary else SampleSpec(s, k + 1, r.params)
        shallow.append(ShallowWork(r.request_id, last, frontier, r.block_ids, s, True, spec))
        frontier += 1
    if boundary and frontier > r.num_deep_positions:
        deep.append(DeepWork(r.request_id, cohort_id, r.num_deep_positions, frontier - r.num_deep_positions,
                             r.block_ids, s + 1, SampleSpec(T, k + 1, r.params), tuple(drafts), True))


def apply_verify(r: Request, d: DeepWork, v: VerifyResult, weight_version: int,
                 counters: SchedulerCounters) -> RequestStatus | None:
    """Accept a prefix of the drafts, then the residual or next token, as outputs read from loop T (up to a
    stop token or max_tokens); roll the rest back. Returns the status the tokens end `r` with, or None."""
    assert d.sample is not None  # plan_verify: loop T at the last row
    drafts = r.draft_token_ids
    assert tuple(drafts) == d.draft_token_ids and 0 <= v.num_accepted <= len(drafts)
    r.draft_token_ids = []
    r.num_drafted += len(drafts)
    r.num_accepted += v.num_accepted
    fed = d.start_position + d.num_rows  # the deep frontier this call filled
    tokens = list(zip(drafts[:v.num_accepted], v.accepted_logprobs))
    if v.token_id is not None:
        tokens.append((v.token_id, v.logprob if v.logprob is not None else 0.0))
    # loop T's top log-probs of each verified token (the engine fills them when params.logprobs > 0)
    assert not v.top_logprobs or len(v.top_logprobs) == len(tokens)
    tops = v.top_logprobs or (None,) * len(tokens)
    status = None
    for (token_id, logprob), top in zip(tokens, tops):
        r.append_output(token_id, logprob, d.sample.loop, weight_version, top)
        counters.tokens_generated += 1
        status = r.stop_status()
        if status is not None:
            break
    # every position whose token is verified and fed keeps its planes; the rest is rolled back
    r.num_deep_positions = r.feed_position  # the drafts are cleared: the newest output's position
    counters.count_verify(len(drafts), v.num_accepted, max(0, fed - r.num_deep_positions))
    return status
