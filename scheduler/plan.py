"""The boundary between the scheduler (which decides) and the engine (which executes).

Plain frozen dataclasses: ids, ints and SamplingParams, never tensors. The scheduler fills a StepPlan;
the engine's Executor runs it and returns a StepResult. Per-request tensors (the retained loop-s rows of
deferred mode) live in the engine, keyed by request id, and are dropped when a plan lists the request in
``released_request_ids``.

One step of the engine runs, in order: every PrefillWork (loops 1..T over prompt tokens), every
ShallowWork (one fed token per decoding request, loops 1..last_loop), every DeepWork (loops first_loop..T
over a request's retained rows at their original positions), then samples every work item that carries a
SampleSpec from the named loop's readout at that item's last position.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from .params import SamplingParams


@dataclass(frozen=True)
class SampleSpec:
    """Sample one token at the last position of a work item."""

    loop: int  # scheduler: the readout loop (1..T) whose logits are sampled
    token_index: int  # scheduler: j, the 1-based index of the generated token; the RNG counter
    params: SamplingParams  # scheduler: the request's params, seed already resolved


@dataclass(frozen=True)
class PromptLogprobSpec:
    """Report prompt log-probs from a prefill chunk: the log-prob of each prompt token under loop T's readout
    at the position before it (raw or processed per the engine's logprobs_mode), its rank, the top k."""

    start_position: int  # scheduler: readout position of row 0; its target is the prompt token at start_position + 1
    target_token_ids: tuple[int, ...]  # scheduler: the prompt tokens at start_position + 1, ...: one per readout row
    num_top: int  # scheduler: SamplingParams.prompt_logprobs: k best to report too (0: none; -1: the whole vocabulary)
    params: SamplingParams  # scheduler: temperature and filters, for logprobs_mode "processed"


@dataclass(frozen=True)
class PrefillWork:
    """Run all T loops over prompt tokens, filling every cache plane at their positions."""

    request_id: str
    token_ids: tuple[int, ...]  # scheduler: the prompt tokens of this chunk
    # scheduler: position of token_ids[0]: 0, or after shared blocks or earlier chunks (their planes are in
    # the pool); a chunk that is not the last ends on a block boundary
    start_position: int
    block_ids: tuple[int, ...]  # scheduler: the request's block table, shared by all T planes
    sample: SampleSpec | None  # scheduler: loop T for the last chunk (generated token 1), None for the others
    # scheduler: a sample of the same prompt forked from another prefill of this step (token_ids is empty,
    # every block is shared): its token is drawn from that request's readout at the prompt's last position
    sample_from: str | None = None
    # scheduler: the prompt log-probs this chunk's readouts give (positions inside the chunk), or None
    prompt_logprobs: PromptLogprobSpec | None = None


@dataclass(frozen=True)
class ShallowWork:
    """Feed one generated token at its position through loops 1..last_loop."""

    request_id: str
    # scheduler: generated token k, fed at position P + k - 1; None when the step in flight samples it
    # (async scheduling: the engine feeds the token it sampled last for this request, on the device)
    token_id: int | None
    position: int  # scheduler
    block_ids: tuple[int, ...]  # scheduler
    last_loop: int  # scheduler: shallow_loops in deferred mode; T in eager mode (deep loops at once)
    retain: bool  # scheduler: keep the loop-last_loop output as a retained row for a later DeepWork
    sample: SampleSpec | None  # scheduler: None when this step's DeepWork of the request samples instead


@dataclass(frozen=True)
class DeepWork:
    """Run loops first_loop..T over a request's retained rows, at their original positions."""

    request_id: str
    cohort_id: int  # scheduler: the cohort whose boundary this is (for logs and failure scope)
    start_position: int  # scheduler: first position whose deep planes are not yet filled
    num_rows: int  # scheduler: retained rows, positions start_position .. start_position + num_rows - 1
    block_ids: tuple[int, ...]  # scheduler
    first_loop: int  # scheduler: shallow_loops + 1
    sample: SampleSpec | None  # scheduler: loop T at the last row (the boundary readout)
    # scheduler, verify mode: the unverified tokens drawn from loop s since the last boundary. Row i's
    # loop-T distribution verifies draft i; a row after the last draft yields the next token. The
    # drafts' token indices are sample.token_index - len(draft_token_ids) + i.
    draft_token_ids: tuple[int, ...] = ()
    verify: bool = False


@dataclass(frozen=True)
class StepPlan:
    """Everything the engine runs in one step."""

    step_id: int  # scheduler: increasing; echoed in the StepResult
    prefills: tuple[PrefillWork, ...] = ()
    shallow: tuple[ShallowWork, ...] = ()
    deep: tuple[DeepWork, ...] = ()
    # scheduler: requests that ended since the previous plan; the engine drops their retained rows
    released_request_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.shallow or self.deep)


class Phase(str, enum.Enum):
    """The part of a step that failed, which decides who fails with it."""

    PREFILL = "prefill"  # the prefill requests of the step
    SHALLOW = "shallow"  # the requests fed in the step's shallow call
    DEEP = "deep"  # every member of the cohorts in the deep call (the cohort closes)
    SAMPLE = "sample"  # the named requests


@dataclass(frozen=True)
class SampledToken:
    """One sampled token of one request."""

    request_id: str
    token_id: int  # engine
    logprob: float  # engine: processed log-prob of token_id under the distribution it was drawn from
    loop: int  # engine: the readout loop it was drawn from
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # engine: when params.logprobs > 0


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt log-probs of one PrefillWork's PromptLogprobSpec, one entry per target token."""

    request_id: str
    start_position: int  # engine: the spec's start_position
    logprobs: tuple[float, ...]  # engine: each target's log-prob (logprobs_mode: processed or raw)
    ranks: tuple[int, ...]  # engine: each target's 1-based rank in its row (ties: the lower token id ranks first)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # engine: per row the k best, in rank order (k != 0)


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of verifying one request's drafts against loop T (verify mode)."""

    request_id: str
    num_accepted: int  # engine: drafts accepted, a prefix of DeepWork.draft_token_ids
    accepted_logprobs: tuple[float, ...]  # engine: loop-T log-prob of each accepted draft (logprobs_mode:
    #                                       processed or raw)
    token_id: int | None  # engine: the residual draw at the first rejection, or the token after all
    #                       accepted drafts (None when all were accepted and no row follows them)
    logprob: float | None  # engine: loop-T processed log-prob of token_id
    # engine, when params.logprobs > 0: loop T's top log-probs (the k best plus the token, as SampledToken's)
    # of each accepted draft, then of token_id when it is not None; () when not asked for
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class StepFailure:
    """A phase of the step raised; the scheduler ends the affected requests with finish_reason='error'."""

    phase: Phase  # engine
    request_ids: tuple[str, ...]  # engine: the requests that phase was running
    message: str  # engine: the exception, for the log and the caller
    # engine, non-finite logits: the requests whose rows were not finite. The scheduler ignores the failure
    # when all of them had already ended (a row planned ahead for a request that stopped meanwhile); the
    # step's sampled tokens are then in StepResult.sampled as usual. Empty: the phase failed as a whole.
    culprit_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What the engine returns for one StepPlan."""

    step_id: int  # engine: the plan's step_id
    sampled: tuple[SampledToken, ...] = ()
    failures: tuple[StepFailure, ...] = field(default=())
    verified: tuple[VerifyResult, ...] = ()  # verify mode: one per DeepWork with verify=True
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # one per PrefillWork with a PromptLogprobSpec


class Executor(Protocol):
    """The one seam between deciding and executing. Test doubles implement the same method."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan; never raise for a failing phase, report it in StepResult.failures."""
        ...


class PendingStep(Protocol):
    """A launched step (async scheduling): its result, read once."""

    def result(self) -> StepResult:
        """Wait for the step and read it back; failures are data, as execute()'s."""
        ...


class LaunchingExecutor(Executor, Protocol):
    """An executor that can start a step without waiting for it (ModelExecutor): ``launch(plan).result()``
    is ``execute(plan)``; the next plan may be launched before this result is read (its ShallowWork rows
    with token_id None feed what this step samples)."""

    def launch(self, plan: StepPlan) -> PendingStep:
        ...
