"""GroupRun: one task's group while it is generated (its samples, their engine requests and rounds), and
the Sample each finished completion becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .partial import Rounds
from .types import Sample


@dataclass(eq=False)
class GroupRun:
    """A group being generated."""

    seq: int  # start order
    task: Any
    task_index: int
    prompt: list[int]
    samples: list[Sample | None]
    live: dict[int, str] = field(default_factory=dict)  # sample index -> engine request id in flight
    attempts: list[int] = field(default_factory=list)
    restart: set[int] = field(default_factory=set)  # aborted by on_update="abort": resubmit
    rounds: dict[int, Rounds] = field(default_factory=dict)  # max_tokens_per_round: each sample's rounds
    paused: set[int] = field(default_factory=set)  # aborted at a hand-over to continue after the update
    wake: Any = None  # the event its paused samples wait on
    aborted: bool = False  # surplus aborted: its task is requeued
    error: BaseException | None = None

    def sample_of(self, i: int, c: Any) -> Sample:
        """Sample i from its last CompletionOutput `c` (and, in rounds, what its rounds produced)."""
        r = self.rounds.get(i)
        if r is None:
            return Sample(i, list(self.prompt), list(c.token_ids), list(c.logprobs), list(c.readout_loops),
                          list(c.weight_versions), c.finish_reason, c.weight_version, num_restarts=self.attempts[i])
        return Sample(i, list(self.prompt), r.token_ids, r.logprobs, r.readout_loops, r.weight_versions,
                      c.finish_reason, c.weight_version if r.first_version is None else r.first_version,
                      num_restarts=self.attempts[i], round_starts=r.round_starts)
