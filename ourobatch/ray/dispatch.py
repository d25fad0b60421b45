"""How the pool runs a request: seed it as an Engine would, place it (routing.Router), stream it from the
replica into its Flight, and on the replica's death fail it (ReplicaDiedError) or continue it elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

from scheduler.errors import EngineClosedError, EngineDeadError, InconsistentWeightsError, RequestRejectedError
from ourobatch.runtime.engine_core import check_new_request, request_seed
from ourobatch.log import get_logger
from ourobatch.outputs import RequestOutput
from scheduler.params import RequestOutputKind, SamplingParams

from .actor import ReplicaNotArmedError
from .errors import ReplicaDiedError
from .flight import Flight, SubRequest
from .replica import Replica, ReplicaState, cancel_generator, cause_of, is_actor_failure

log = get_logger()

BACKPRESSURE_OBJECTS = 2  # outputs a replica may stream ahead of the pool; the engine coalesces the rest


class Dispatch:
    """EnginePool's request path (a mixin: it uses the pool's replicas, router, flights and tasks)."""

    def _add(self, prompt_token_ids: Sequence[int], params: Any, request_id: str | None,
             kind: RequestOutputKind | None) -> Flight:
        """Check a request, give it a seed as an Engine would, and start placing it."""
        self._check_open()
        params = SamplingParams.coerce(params)
        request_id = check_new_request(params, request_id, self.config.max_num_seqs, self._flights)
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type(prompt_token_ids).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
        if len(prompt) + params.max_tokens > self.config.max_model_len:  # the replica checks the rest
            raise RequestRejectedError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                                       f"{len(prompt) + params.max_tokens} exceeds "
                                       f"max_model_len={self.config.max_model_len}")
        if params.seed is None:  # the seed an Engine would give its i-th unseeded request
            params = params.with_seed(request_seed(self.config.seed, self._num_unseeded))
            self._num_unseeded += 1
        caller_kind = params.output_kind if kind is None else kind
        # The replica sends deltas (the pool rebuilds what the caller asked for), or one final output
        # when nobody needs progress (no stream, no retry).
        engine_kind = (RequestOutputKind.FINAL_ONLY if caller_kind == RequestOutputKind.FINAL_ONLY
                       and not self.retry_aborted else RequestOutputKind.DELTA)
        flight = Flight(request_id, prompt, params, caller_kind)
        flight.retry = self.retry_aborted
        self._flights[request_id] = flight
        self._start(SubRequest(flight, request_id, prompt, dataclasses.replace(params, output_kind=engine_kind),
                               list(range(params.n))))
        return flight

    def _start(self, sub: SubRequest) -> None:
        sub.flight.subs.append(sub)
        sub.task = asyncio.ensure_future(self._run(sub))
        self._tasks.add(sub.task)
        sub.task.add_done_callback(self._tasks.discard)

    async def _place(self, sub: SubRequest) -> Replica:
        deadline = asyncio.get_running_loop().time() + self.ready_timeout_s
        while True:
            if self._closing:
                raise EngineClosedError("the pool is closed")
            if self.control.inconsistent:
                raise InconsistentWeightsError(f"the pool's replicas hold different weights "
                                               f"({self.control.inconsistent}); "
                                               f"a complete update_weights / load_weights restores service")
            if self.control.weights_missing:  # as every replica would answer, ready or not (control.py)
                raise InconsistentWeightsError("generate: the pool's replicas hold no weights since sleep(2); "
                                               "update_weights / load_weights restores them")
            loads = [r.load if r.state == ReplicaState.READY else None for r in self.replicas]
            index = self.router.choose(sub.prompt_token_ids, loads)
            if index is not None:
                return self.replicas[index]
            if all(r.state >= ReplicaState.DEAD for r in self.replicas):
                raise ReplicaDiedError(f"every replica of the pool is dead ({self._states()})")
            await self._wait_changed(deadline, "a ready replica")

    async def _run(self, sub: SubRequest) -> None:
        """Run one engine request to its end: place it, stream it, and on a replica's death fail or retry."""
        flight = sub.flight
        try:
            while True:
                if sub.is_all_aborted():  # aborted before it reached a replica
                    flight.finish_unplaced(sub.indexes, "abort")
                    return
                try:
                    replica = await self._place(sub)
                except (ReplicaDiedError, EngineClosedError, InconsistentWeightsError) as exc:
                    flight.fail(exc)
                    return
                outcome = await self._serve(replica, sub)
                if outcome != "unarmed":  # "unarmed": it never ran there (a restart): place it again
                    break
            if outcome == "died":
                self._after_death(replica, sub)
        finally:
            flight.subs.remove(sub)
            flight.event.set()

    def _after_death(self, replica: Replica, sub: SubRequest) -> None:
        """`sub`'s replica died: aborted completions end as aborted (the abort may never have landed), the
        others are retried elsewhere or fail with ReplicaDiedError."""
        flight = sub.flight
        flight.finish_unplaced([i for i in sub.indexes if i in flight.aborted or self._closing], "abort")
        if all(flight.completions[i].finish_reason is not None for i in sub.indexes):
            return
        if flight.retry and flight.num_retries < self.max_retries and not flight.abandoned:
            self.counters["requests_retried"] += 1
            log.info("request_retried", request_id=flight.request_id, failed_replica=replica.index)
            for retry in flight.retry_subrequests(sub):
                self._start(retry)
        else:
            self.counters["requests_failed_replica_died"] += 1
            flight.fail(ReplicaDiedError(
                f"replica {replica.index} died with request {flight.request_id!r} in flight "
                f"({replica.last_failure}); retry_aborted=True resubmits such requests to another replica"))

    async def _serve(self, replica: Replica, sub: SubRequest) -> str:
        """Stream `sub` from `replica` into its flight: "done", "unarmed" or "died"."""
        flight = sub.flight
        sub.replica = replica.index
        sub.charged = sub.remaining()
        replica.load += sub.charged
        replica.subs.add(sub)
        replica.requests_routed += 1
        try:
            sub.generator = replica.actor.stream.options(
                num_returns="streaming", _generator_backpressure_num_objects=BACKPRESSURE_OBJECTS,
            ).remote(sub.prompt_token_ids, sub.params, sub.engine_id)
            for engine_id in sub.pending_aborts():
                replica.actor.abort.remote(engine_id)
            async for ref in sub.generator:
                out = await ref
                if sub.is_retry and self._mixes_weights(sub, out):
                    cancel_generator(sub.generator)  # its engine request aborts; nothing of it is kept
                    flight.aborted |= set(sub.indexes)
                    flight.finish_unplaced(sub.indexes, "abort")
                    return "done"
                added = flight.merge(sub, out)
                paid = min(added, sub.charged)
                sub.charged -= paid
                replica.load -= paid
            return "done"
        except asyncio.CancelledError:
            cancel_generator(sub.generator)
            raise
        except Exception as exc:  # noqa: BLE001 - sorted below; nothing is lost silently
            cause = cause_of(exc)
            if isinstance(cause, ReplicaNotArmedError):  # restarted before the pool noticed: catch it up
                self._mark_down(replica, "restarted (not armed)")
                return "unarmed"
            if is_actor_failure(exc) or isinstance(cause, EngineDeadError) or (
                    isinstance(cause, EngineClosedError) and not self._closing):
                cancel_generator(sub.generator)
                self._mark_down(replica, f"{type(cause).__name__}: {cause}")
                return "died"
            flight.fail(cause)  # the request itself was refused (RequestRejectedError, ValueError, ...)
            return "done"
        finally:
            replica.load -= sub.charged
            sub.charged = 0
            replica.subs.discard(sub)
            sub.generator = None

    def _mixes_weights(self, sub: SubRequest, out: RequestOutput) -> bool:
        """A continuation would append tokens of other weights than its completion's earlier tokens: the
        weights changed while it was between replicas, outside pause("keep") (where kept requests continue
        under the new weights by design). It ends as aborted instead, with the tokens it has."""
        for c in out.outputs:
            last = sub.flight.completions[sub.indexes[c.index]].last_weight_version()
            new = c.weight_versions[0] if c.weight_versions else None
            if last is not None and new is not None and new != last and new not in self.control.keep_versions:
                log.warning("continuation_weights_changed", request_id=sub.flight.request_id,
                            had_version=last, replica_version=new)
                return True
        return False

    async def _final(self, flight: Flight) -> RequestOutput:
        try:
            while not flight.finished:
                await flight.wait()
            if flight.error is not None:
                raise flight.error
            return flight.output()
        finally:
            self._release(flight)

    def _release(self, flight: Flight) -> None:
        """The caller is gone: abort what still runs, forget the flight."""
        if self._flights.get(flight.request_id) is flight:
            del self._flights[flight.request_id]
        if flight.subs:  # still running somewhere (also after an error: the retries of its other completions)
            flight.abandoned = True
            self._abort(flight, None)

    def _release_later(self, flight: Flight) -> None:
        """_release from a finalizer, which may run on any thread: do it on the pool's loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._release, flight)

    def _abort(self, flight: Flight, index: int | None) -> bool:
        """Abort completion `index` (None: all) of a flight: remembered (never retried), and sent to the
        replicas that run it."""
        targets = {i for i, c in enumerate(flight.completions)
                   if c.finish_reason is None and (index is None or i == index)}
        if not targets:
            return False
        flight.aborted |= targets
        for sub in list(flight.subs):
            ids = sub.abort_ids(targets)
            if not ids:
                continue
            if sub.replica is None or sub.generator is None:  # not on a replica yet: _run ends it, or
                if sub.is_all_aborted() and sub.task:  # _serve sends its pending aborts once it is there
                    flight.finish_unplaced(sub.indexes, "abort")
                    sub.task.cancel()
                continue
            actor = self.replicas[sub.replica].actor
            for engine_id in ids:
                actor.abort.remote(engine_id)
        return True

    def _abort_live(self) -> list[Flight]:
        """Remember an abort of every live request (before pause("abort") / abort_all is broadcast, so a
        replica that dies meanwhile retries none of them); the caller then _aborts each flight."""
        flights = list(self._flights.values())
        for flight in flights:
            flight.aborted |= {i for i, c in enumerate(flight.completions) if c.finish_reason is None}
        return flights
