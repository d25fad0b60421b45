"""Cohorts: requests that share one boundary clock, so their deep calls happen on the same step.

A cohort's ``phase`` counts the shallow steps its decoding members took in the current block
(0..interval-1). Every decoding member is at the same phase. A newly prefilled member waits (ALIGNING)
until phase 0, the next block start, so it waits at most interval-1 steps; when no member is decoding
the clock is free and resets to 0. A deep call that fails closes the cohort; later requests form a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Cohort:
    cohort_id: int
    interval: int  # deep_interval B of every member
    phase: int = 0  # shallow steps taken in the current block
    member_ids: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    is_closed: bool = False

    def is_boundary_step(self) -> bool:
        """Whether the next shallow step completes a block (decode step k with k % B == 0)."""
        return self.phase + 1 == self.interval

    def advance(self) -> None:
        self.phase = (self.phase + 1) % self.interval
