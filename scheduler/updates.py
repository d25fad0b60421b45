"""One update's bookkeeping (torch-free): which request incarnations a plan ran, and what changed.

``Scheduler.update`` matches a step's results to the ``Request`` objects its plan recorded at schedule
time, with the preemption count they had then, never to whatever request holds an id now: an id aborted
mid-step may already be reused, and a request preempted meanwhile ignores the step. The same test says
which rows of a plan made ahead (async scheduling) are wasted: those of requests that ended since.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request, RequestStatus


@dataclass(frozen=True)
class RequestUpdate:
    """A request that got new tokens or ended in a step; the front end reads the request's lists."""

    request: Request
    num_new_tokens: int
    finished: bool


_NOT_PLANNED = (None, -1)
_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses from here on are terminal


@dataclass
class StepUpdate:
    """One update()'s bookkeeping: the incarnations its plan ran, who failed, the updates so far (in order)."""

    planned: dict[str, tuple[Request, int]]  # request id -> (the request, its num_preemptions) as planned
    failed: set[str] = field(default_factory=set)
    updates: dict[str, RequestUpdate] = field(default_factory=dict)

    def live(self, rid: str) -> Request | None:
        """The incarnation this plan ran, if it still runs as planned (aborted or preempted ones ignore
        their results; preemption itself is only ever done between steps, this is the last guard)."""
        r, epoch = self.planned.get(rid, _NOT_PLANNED)
        return r if r is not None and r.status < _FINISHED and r.num_preemptions == epoch else None

    def usable(self, rid: str) -> Request | None:
        """live, and not failed in this step."""
        return None if rid in self.failed else self.live(rid)
