"""A request's state, its ordered status, and the one table of allowed status transitions.

    WAITING ──► PREFILLING ──► ALIGNING ──► DECODING ──► FINISHED_*
       ▲ │         │  │            │  │         │  │
       │ └─────────┼──┴────────────┴──┼─────────┴──┼──► FINISHED_ABORTED / FINISHED_ERROR
       └───────────┴──────────────────┴────────────┘    preempted (KV room): back to WAITING

WAITING: queued, holds no KV (a preempted request keeps the tokens it produced). PREFILLING: admitted;
its (re)prefill (prompt + outputs so far) runs, in one step or in chunks over several (scheduler/
prefill.py), and it holds the blocks of the chunks planned so far; the last chunk samples its next token.
ALIGNING: prefilled (its next token sampled from loop T), waiting for its cohort's next block start.
DECODING: takes one shallow step every engine step, and a deep call at each cohort boundary.
Terminal statuses sort last, so ``status >= FINISHED_STOPPED`` means finished.

Async scheduling (scheduler/lookahead.py): while a step runs, the next one is planned as if every token
that step samples were there: ``num_pending`` counts them (in ``num_generated`` and ``feed_position``;
``append_output`` fills them in). A request prefilled by the step in flight may already be a cohort
member while still PREFILLING (its first token pending); it becomes ALIGNING or DECODING through the
usual transitions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import InvalidTransition
from .params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    PREFILLING = 1
    ALIGNING = 2
    DECODING = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# One prompt position's log-prob: (logprob of the prompt token, its rank, the k best (token, logprob) pairs)
PromptLogprob = tuple[float, int, tuple[tuple[int, float], ...]]

_S = RequestStatus
_ENDS_EARLY = frozenset({_S.FINISHED_ABORTED, _S.FINISHED_ERROR})
_ENDS = frozenset({_S.FINISHED_STOPPED, _S.FINISHED_LENGTH}) | _ENDS_EARLY

# Every allowed status change, in one place. Terminal statuses have no way out.
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.PREFILLING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}),
    _S.PREFILLING: frozenset({_S.ALIGNING, _S.WAITING}) | _ENDS,  # WAITING: preempted between two chunks
    _S.ALIGNING: frozenset({_S.DECODING, _S.WAITING}) | _ENDS_EARLY,  # WAITING: preempted
    _S.DECODING: frozenset({_S.WAITING}) | _ENDS,
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
    _S.FINISHED_ERROR: frozenset(),
}


@dataclass(eq=False)
class Request:
    """One sequence being generated. Positions: prompt 0..P-1; generated token k is fed at P + k - 1."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # seed resolved at admission
    stop_token_ids: frozenset[int]  # params.stop_token_ids plus the checkpoint's eos unless ignore_eos
    arrival_index: int  # add order (unique per incarnation); FIFO among waiting requests, preempt newest
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    readout_loops: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)  # per output token
    top_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    block_ids: tuple[int, ...] = ()  # one table for all T planes; grows as positions are written
    num_cached_tokens: int = 0  # prompt tokens whose KV the first prefill shared from the prefix cache
    pending_block_keys: list = field(default_factory=list)  # (key, block) this prefill computes
    pending_keys_epoch: int = 0  # the prefix cache's epoch (KVManager.epoch) its pending keys were offered in
    num_preemptions: int = 0
    admission_version: int | None = None  # the weight version when first admitted (None: never admitted)
    num_outputs_at_prefill: int = 0  # outputs fed by the last (re)prefill: 0, or k after a preemption
    num_bypassed: int = 0  # times later requests were admitted while this one did not fit
    cohort_id: int | None = None
    num_deep_positions: int = 0  # positions [0, num_deep_positions) have every loop's plane filled; while
    #                              PREFILLING this is the prefill's progress (shared blocks + chunks run)
    num_pending: int = 0  # async scheduling: tokens sampled by the step in flight, not yet appended (0 or 1)
    draft_token_ids: list[int] = field(default_factory=list)  # verify mode: drawn from loop s, unverified
    num_drafted: int = 0  # verify mode: drafts checked against loop T
    num_accepted: int = 0  # verify mode: drafts accepted
    error: str | None = None  # why it ended with finish_reason "error"
    # params.prompt_logprobs set: (logprob, rank, top k) of prompt positions 1, 2, ... computed so far
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs: the tokens a (re)prefill feeds (outputs do not change while it prefills)."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """Prompt + outputs, the tokens a (re)prefill feeds."""
        return self.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Outputs + tokens pending from the step in flight: j of the newest generated token."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def is_ending(self) -> bool:
        """Its pending token ends it by length (max_tokens): a plan made ahead feeds it nothing more."""
        return self.num_pending > 0 and len(self.output_token_ids) + self.num_pending >= self.params.max_tokens

    @property
    def num_tokens_with_drafts(self) -> int:
        """Prompt + outputs + pending tokens + unverified drafts (verify mode; elsewhere the drafts are
        always empty; tokens are pending only while a step runs that sampled them)."""
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending
                + len(self.draft_token_ids))

    @property
    def feed_position(self) -> int:
        """Where the newest token (output, pending or draft) is fed: token k at P + k - 1, the position a
        decoding request's next shallow step writes. Positions before it are fed (written at least to loop s).
        (Written out: it is read for every decoding request in every step.)"""
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending
                + len(self.draft_token_ids) - 1)

    @property
    def can_feed(self) -> bool:
        """Whether a decoding request's next shallow step feeds it a token: not when its unverified drafts
        (verify mode) already reach max_tokens or end in a stop token; it then waits for its boundary."""
        drafts = self.draft_token_ids
        return not (self.num_output_tokens + len(drafts) >= self.params.max_tokens
                    or (bool(drafts) and drafts[-1] in self.stop_token_ids))

    @property
    def num_cache_positions(self) -> int:
        """Positions this request may ever write: P + max_tokens - 1 (the last token is never fed)."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first position whose loop-T readout a prefill must still compute for prompt log-probs (its
        target is the prompt token after it); None when none is needed (not asked for, or all computed).
        No shared (prefix-cached) block may cover it: kv_manager.plan_admission stops sharing before it."""
        if self.params.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens - 1:
            return None
        return len(self.prompt_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.status >= _S.FINISHED_STOPPED

    def append_output(self, token_id: int, logprob: float, loop: int, weight_version: int,
                      top_logprobs: tuple[tuple[int, float], ...] | None) -> None:
        """Record one generated token: its log-prob, readout loop, weight version and (when asked for) the
        top log-probs (a pending token is filled in). The only place outputs grow."""
        if self.num_pending:
            self.num_pending -= 1
        self.output_token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.readout_loops.append(loop)
        self.weight_versions.append(weight_version)
        self.cumulative_logprob += logprob
        if self.params.num_top_logprobs > 0:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.append(dict(top_logprobs or ()))

    def stop_status(self) -> RequestStatus | None:
        """The status the newest output ends it with (a stop token, then max_tokens), or None."""
        if self.output_token_ids[-1] in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason


def set_status(request: Request, new: RequestStatus) -> None:
    """The only way a request's status changes; raises InvalidTransition outside the table."""
    if new not in TRANSITIONS[request.status]:
        raise InvalidTransition(f"req {request.request_id}: {request.status.name} -> {new.name}")
    request.status = new
