"""OutputCursor: how much of one request its caller has been given, and what to hand it next. Torch-free.

One cursor per reader of a request: the engine's per-request collector (driver.py) and the Ray pool's
Flight (ray/flight.py) each hold one over their request's state, so the rules of the three output kinds
are written once:

- DELTA: what is new since the last read, per completion (its tokens, log-probs, readout loops, top
  log-probs and weight versions from the first undelivered token on); the prompt log-probs once.
- CUMULATIVE: everything so far, every read.
- FINAL_ONLY: nothing until the request finished, then everything; a read before marks what exists as
  seen, so ``pending()`` stays false until the end (the caller only waits for it).

The source is anything with ``finished``, ``num_tokens()`` (tokens per completion, in completion order)
and ``output(since)`` (the cumulative RequestOutput, or with `since` only each completion's tokens from
``since[i]`` on): EngineCore's ParentRequest, the pool's Flight. The caller reads it consistently (the
driver under its lock, the pool on its one event loop). Counts are positions in the source's completions,
so a flight whose completion continues on another replica after a retry (its tokens stitched) resumes
from what the caller already has.
"""

from __future__ import annotations

from typing import Protocol

from ourobatch.outputs import RequestOutput
from scheduler.params import RequestOutputKind


class OutputSource(Protocol):
    @property
    def finished(self) -> bool: ...

    def num_tokens(self) -> list[int]: ...

    def output(self, since: list[int] | None = None) -> RequestOutput: ...


class OutputCursor:
    """What a reader of one request has been given: tokens per completion, the final output, the prompt
    log-probs (a DELTA stream carries them once)."""

    __slots__ = ("kind", "delivered", "sent_final", "sent_prompt_logprobs")

    def __init__(self, num_completions: int, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.delivered = [0] * num_completions  # tokens handed over (or, FINAL_ONLY, seen), per completion
        self.sent_final = False  # the finished output was handed over
        self.sent_prompt_logprobs = False

    def pending(self, source: OutputSource) -> bool:
        """Something to read: new tokens, or the end not yet handed over."""
        return source.num_tokens() != self.delivered or (source.finished and not self.sent_final)

    def take(self, source: OutputSource) -> RequestOutput | None:
        """The output to hand over now per the kind (None: FINAL_ONLY before the end), marked as given."""
        finished = source.finished
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            self.delivered = source.num_tokens()
            return None
        if self.kind == RequestOutputKind.DELTA:
            out = source.output(since=self.delivered)
            if self.sent_prompt_logprobs:
                out.prompt_logprobs = None
        else:
            out = source.output()
        self.delivered = source.num_tokens()
        self.sent_prompt_logprobs = self.sent_prompt_logprobs or out.prompt_logprobs is not None
        self.sent_final = finished
        return out
