"""Cohorts: requests that share one boundary clock, so their deep calls happen on the same step.

A cohort's ``phase`` counts the shallow steps its decoding members took in the current block
(0..interval-1). Every decoding member is at the same phase. A newly prefilled member waits (ALIGNING)
until phase 0, the next block start, so it waits at most interval-1 steps; when no member is decoding
the clock is free and resets to 0. A deep call that fails closes the cohort; later requests form a new one.
``Cohorts`` is the one owner of membership: requests join the open cohort, leave, and closing happens there.

Async scheduling (lookahead.py) plans a step while the previous one runs: a request whose last prefill
chunk runs then joins before its first token is known and counts as aligning while still PREFILLING;
a member whose pending token ends it by length (``Request.is_ending``) no longer counts as decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping

from .request import Request, RequestStatus, set_status


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

    def end_step(self, boundary: bool) -> None:
        """The step fed the members: the clock moves on; a boundary (a forced one too) ends the block."""
        if boundary:
            self.phase = self.interval - 1
        self.advance()


_ALIGNING = (RequestStatus.ALIGNING, RequestStatus.PREFILLING)  # PREFILLING: joined, first token pending


def is_decoding(r: Request) -> bool:
    """A decoding member the coming step feeds (not one whose pending token ends it)."""
    return r.status == RequestStatus.DECODING and not r.is_ending


def members_fed(cohort: Cohort, members: list[Request]) -> list[Request]:
    """The members a cohort's coming step feeds: the decoding ones, and the aligning ones when a block
    starts (phase 0, or no member mid-block), in member order, decoding ones first."""
    decoding = [r for r in members if r.status == RequestStatus.DECODING and not r.is_ending]  # is_decoding
    if decoding and cohort.phase != 0:
        return decoding
    return decoding + [r for r in members if r.status in _ALIGNING and not r.is_ending]


class Cohorts:
    """Every cohort with members, by id, and the open one that newly prefilled requests join."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._by_id: dict[int, Cohort] = {}  # open and closing cohorts with members
        self._open: Cohort | None = None
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def values(self) -> list[Cohort]:
        return list(self._by_id.values())

    def is_member(self, r: Request) -> bool:
        cohort = self._by_id.get(r.cohort_id) if r.cohort_id is not None else None
        return cohort is not None and r.request_id in cohort.member_ids

    def join(self, r: Request) -> None:
        """`r` (just prefilled) joins the open cohort; a new one opens when there is none or it closed."""
        if self._open is None or self._open.is_closed:
            self._open = Cohort(self._next_id, self.interval)
            self._next_id += 1
            self._by_id[self._open.cohort_id] = self._open
        self._open.member_ids[r.request_id] = None
        r.cohort_id = self._open.cohort_id

    def leave(self, r: Request) -> None:
        cohort = self._by_id.get(r.cohort_id) if r.cohort_id is not None else None
        if cohort is not None:
            cohort.member_ids.pop(r.request_id, None)
            if not cohort.member_ids and (cohort.is_closed or cohort is not self._open):
                del self._by_id[cohort.cohort_id]

    def close(self, cohort_id: int) -> list[str]:
        """Close a cohort (its deep call failed): nobody joins it any more. Returns its member ids."""
        cohort = self._by_id.get(cohort_id)
        if cohort is None:
            return []
        cohort.is_closed = True
        return list(cohort.member_ids)

    def begin_step(self, requests: Mapping[str, Request]) -> Iterator[tuple[Cohort, list[Request]]]:
        """Each cohort the coming step feeds, with the members it feeds (``members_fed``); a clock with
        nobody mid-block resets, and aligning members that start a block start decoding."""
        for cohort in list(self._by_id.values()):
            fed = members_fed(cohort, [requests[rid] for rid in cohort.member_ids])
            if not fed or fed[0].status != RequestStatus.DECODING:  # decoding members come first
                cohort.phase = 0  # nobody mid-block: the clock is free
            for r in fed:
                if r.status == RequestStatus.PREFILLING:  # joined ahead: its first token is pending
                    set_status(r, RequestStatus.ALIGNING)
                if r.status == RequestStatus.ALIGNING:
                    set_status(r, RequestStatus.DECODING)
            if fed:
                yield cohort, fed

    def feeding(self, requests: Mapping[str, Request]) -> Iterator[Request]:
        """The requests the coming step feeds, by the same rule, changing nothing."""
        for cohort in self._by_id.values():
            yield from members_fed(cohort, [requests[rid] for rid in cohort.member_ids])
