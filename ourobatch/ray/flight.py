"""One caller request in the pool: its completions, assembled from the outputs of one or more engine
requests on the replicas, and the stream the caller reads. Ray-free.

A Flight starts as one engine request (all n completions, on one replica). When that replica dies and
the pool retries, each unfinished completion i becomes an engine request of its own: prompt + the tokens
i already has, ``max_tokens`` (and ``min_tokens``) less what it has, so the outputs stitch: token ids,
log-probs, readout loops and top log-probs are appended, the counters added.

Stitching knows what each engine output holds: a DELTA output's per-token lists are appended to what the
current engine request gave so far; a CUMULATIVE or FINAL_ONLY output's lists replace it (they hold all
of it). Either way the completion is the earlier engine requests' tokens + the current one's. Counters
(cumulative_logprob, num_*) are running totals of the engine request in every kind, so they are added to
the earlier requests' totals. Retries always ask their replica for DELTA (the pool needs the tokens).

Aborts are remembered (``Flight.aborted``): a completion the caller aborted is never retried, even when
its replica dies before the abort reaches it; it ends with finish_reason "abort" and its partial output.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from ourobatch.runtime.engine_core import child_seed
from ourobatch.outputs import CompletionOutput, RequestOutput
from scheduler.errors import fresh_error
from scheduler.params import RequestOutputKind, SamplingParams
from ourobatch.runtime.cursor import OutputCursor
from ourobatch.runtime.streams import OutputStream

# How each CompletionOutput field stitches across the engine requests of one completion (a retry starts a
# new one): per-token lists are appended, counters over the completion added, the rest is the latest.
# Fields not named here are classified by value (a list: per token; num_*: a counter), so a field added
# to CompletionOutput is carried without a change here.
OWN_FIELDS = ("index", "seed")  # the pool's: the flight's index and the completion's original seed
PER_TOKEN_FIELDS = ("token_ids", "logprobs", "readout_loops", "top_logprobs")
COUNTER_FIELDS = ("cumulative_logprob",)
FIRST_FIELDS = ("weight_version",)  # the completion's first engine request's: the weights it was admitted with


def _is_per_token(name: str, value: Any) -> bool:
    return name in PER_TOKEN_FIELDS or isinstance(value, list)


def _is_counter(name: str, value: Any) -> bool:
    return name in COUNTER_FIELDS or (name.startswith("num_") and isinstance(value, (int, float)))


class Completion:
    """Completion i as the caller sees it (cumulative), stitched from its engine requests' outputs."""

    def __init__(self, index: int, seed: int) -> None:
        self.index, self.seed = index, seed
        self.values: dict[str, Any] = {}  # CompletionOutput field -> cumulative value
        self.prefix: dict[str, list] = {}  # per-token lists of the engine requests before the current one
        self.base: dict[str, Any] = {}  # counters of the engine requests before the current one
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.values.get("token_ids", ()))

    @property
    def token_ids(self) -> list[int]:
        return self.values.get("token_ids", [])

    def last_weight_version(self) -> int | None:
        versions = self.values.get("weight_versions")
        return versions[-1] if versions else None

    def absorb(self, out: CompletionOutput, cumulative: bool) -> int:
        """Fold in an output of the current engine request: all of it so far (`cumulative`: a CUMULATIVE
        or FINAL_ONLY output) or a DELTA; returns how many tokens it added."""
        before = self.num_tokens
        for f in dataclasses.fields(CompletionOutput):
            name, value = f.name, getattr(out, f.name)
            if name in OWN_FIELDS or (name in FIRST_FIELDS and name in self.values):
                continue
            if _is_per_token(name, value):
                if value is not None:
                    head = self.prefix.get(name, []) if cumulative else self.values.get(name) or []
                    self.values[name] = list(head) + [dict(v) if isinstance(v, dict) else v for v in value]
            elif _is_counter(name, value):
                self.values[name] = self.base.get(name, 0) + value
            else:
                self.values[name] = value
        self.finish_reason = out.finish_reason
        return self.num_tokens - before

    def start_retry(self) -> None:
        """A new engine request continues this completion: what it has so far is the fixed prefix."""
        self.base = {k: v for k, v in self.values.items() if _is_counter(k, v)}
        self.prefix = {k: list(v) for k, v in self.values.items() if _is_per_token(k, v) and v is not None}

    def output(self, start: int = 0) -> CompletionOutput:
        fields = {}
        for f in dataclasses.fields(CompletionOutput):
            if f.name in self.values:
                value = self.values[f.name]
                fields[f.name] = value[start:] if _is_per_token(f.name, value) else value
        fields.setdefault("token_ids", [])
        fields.setdefault("logprobs", [])
        fields.setdefault("readout_loops", [])
        fields.setdefault("cumulative_logprob", 0.0)
        fields["finish_reason"] = self.finish_reason
        return CompletionOutput(index=self.index, seed=self.seed, **fields)


@dataclass(eq=False)
class SubRequest:
    """One engine request of a flight on one replica: completions `indexes` of the flight."""

    flight: "Flight"
    engine_id: str  # the request id on the replica
    prompt_token_ids: list[int]
    params: SamplingParams  # as sent (seeded, output_kind chosen by the pool)
    indexes: list[int]  # flight completion of each of its completions
    replica: int | None = None  # where it runs (None: not placed yet)
    task: asyncio.Task | None = None
    generator: Any = None  # the Ray streaming generator while it runs
    charged: int = 0  # tokens of load it holds on its replica
    is_retry: bool = False  # it continues completions whose replica died (Flight.retry_subrequests)

    @property
    def is_cumulative(self) -> bool:
        """Each output of its engine request holds all of it so far (CUMULATIVE or FINAL_ONLY), not a delta."""
        return self.params.output_kind != RequestOutputKind.DELTA

    def abort_ids(self, targets: Iterable[int]) -> list[str]:
        """Engine request ids that abort the flight completions `targets` it serves."""
        targets = set(targets)
        local = [k for k, i in enumerate(self.indexes) if i in targets]
        if not local:
            return []
        if len(local) == len(self.indexes):
            return [self.engine_id]
        return [f"{self.engine_id}:{k}" for k in local]  # one completion of an n > 1 engine request

    def is_all_aborted(self) -> bool:
        return set(self.indexes) <= self.flight.aborted

    def pending_aborts(self) -> list[str]:
        """What to abort once it is on a replica: the completions aborted before it got there."""
        return self.abort_ids(self.flight.aborted)

    def remaining(self) -> int:
        """Tokens this engine request may still generate (the router's load)."""
        done = sum(len(self.flight.completions[i].token_ids) for i in self.indexes)
        return max(0, self.flight.params.max_tokens * len(self.indexes) - done)


class Flight:
    """A caller's request: n completions, the engine requests serving them, and its waiting consumer."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params  # seeded
        assert params.seed is not None
        self.completions = [Completion(i, child_seed(params.seed, i)) for i in range(params.n)]
        self.subs: list[SubRequest] = []  # live engine requests
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.cursor = OutputCursor(params.n, kind)  # what the caller has been given, per its output kind
        self.num_retries = 0
        self.retry = False  # the pool's retry_aborted when the request was added
        self.aborted: set[int] = set()  # completions the caller aborted: never retried (docs/scaling.md)
        self.abandoned = False  # the caller is gone: nothing reads it
        self.prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: from the first engine request

    @property
    def finished(self) -> bool:
        return self.error is not None or all(c.finish_reason is not None for c in self.completions)

    def merge(self, sub: SubRequest, out: RequestOutput) -> int:
        """Fold one engine output of `sub` in; returns the tokens added."""
        added = sum(self.completions[sub.indexes[c.index]].absorb(c, sub.is_cumulative) for c in out.outputs)
        if out.prompt_logprobs is not None and not sub.is_retry:  # a retry's prompt holds generated tokens too
            self.prompt_logprobs = out.prompt_logprobs
        self.event.set()
        return added

    def fail(self, error: BaseException) -> None:
        if self.error is None and not self.finished:
            self.error = error
        self.event.set()

    def finish_unplaced(self, indexes: Iterable[int], reason: str) -> None:
        """End completions the engine will not end: aborted before placement, or on a replica that died
        (they keep their partial output)."""
        for i in indexes:
            if self.completions[i].finish_reason is None:
                self.completions[i].finish_reason = reason
        self.event.set()

    def retry_subrequests(self, sub: SubRequest) -> list[SubRequest]:
        """Engine requests that continue `sub`'s unfinished completions elsewhere, one per completion:
        prompt + its tokens, the token budget less what it has, a seed of its own (a continuation is
        a fresh draw given its prefix, as after a preemption: docs/scaling.md)."""
        self.num_retries += 1
        subs = []
        for i in sub.indexes:
            c = self.completions[i]
            if c.finish_reason is not None or i in self.aborted:
                continue
            have = len(c.token_ids)
            c.start_retry()
            params = dataclasses.replace(  # DELTA: the stitcher appends, and the pool sees each token
                self.params, n=1, output_kind=RequestOutputKind.DELTA, max_tokens=self.params.max_tokens - have,
                min_tokens=max(0, self.params.min_tokens - have),
                seed=child_seed(c.seed, have + 1) if have else c.seed)
            engine_id = f"{self.request_id}:{i}~retry{self.num_retries}"
            subs.append(SubRequest(self, engine_id, self.prompt_token_ids + c.token_ids, params, [i], is_retry=True))
        return subs

    def output(self, since: list[int] | None = None) -> RequestOutput:
        """The stitched output: cumulative, or with `since` each completion's tokens from since[i] on."""
        outs = [c.output(since[i] if since is not None else 0) for i, c in enumerate(self.completions)]
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outs, self.finished, self.prompt_logprobs)

    def num_tokens(self) -> list[int]:
        return [len(c.token_ids) for c in self.completions]

    def pending(self) -> bool:
        return self.cursor.pending(self)

    def take(self) -> RequestOutput | None:
        """What the caller reads now, per its output kind (None: nothing for it yet)."""
        if self.error is not None:
            raise fresh_error(self.error)  # a copy: raising the stored one again grows its traceback
        return self.cursor.take(self)

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class FlightOwner(Protocol):
    """What a PoolStream releases its flight through: the EnginePool (pool.py, which imports this module)."""

    def _release(self, flight: Flight) -> None: ...

    def _release_later(self, flight: Flight) -> None: ...


class PoolStream(OutputStream):
    """Async iterator over one pool request's outputs (Engine.stream's contract: ourobatch/runtime/streams.py).
    Closing it early (``aclose()``, leaving ``async with``, cancelling the consumer, or dropping it) aborts
    the request. Raises ReplicaDiedError if its replica dies (unless the pool retries it)."""

    def __init__(self, pool: FlightOwner, flight: Flight) -> None:
        self._pool = pool
        self._flight = flight
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._flight.request_id

    def _ready(self) -> bool:
        return self._flight.error is not None or self._flight.pending()

    def _take(self) -> RequestOutput | None:
        return self._flight.take()

    def _sent_final(self) -> bool:
        return self._flight.cursor.sent_final

    async def _wait(self) -> None:
        await self._flight.wait()

    def _release(self) -> None:
        self._pool._release(self._flight)

    def _release_later(self) -> None:
        self._pool._release_later(self._flight)
