"""EngineCore: the request table callers see (one request, n completions) over the Scheduler and an
Executor. Torch-free: the facade builds the executor and hands it in.

A caller's request (a ParentRequest) fans out to n scheduler requests, one per completion, each with
its own seed: the request's seed for completion 0, a splitmix64 step away for the others. One step is
``schedule() -> executor.execute(plan) -> update(plan, result)``, run by the StepPipeline (pipeline.py),
which with async scheduling plans and launches the next step before reading this one; the sync facade
calls ``step()``, the async driver drives the pipeline from its worker thread.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from .control import EngineControl
from scheduler.config import SchedulerConfig
from scheduler.scheduler import RequestUpdate, Scheduler
from scheduler.errors import RequestRejectedError
from scheduler.validate import check_ids_free
from ourobatch.log import get_logger
from ourobatch.outputs import CompletionOutput, Logprob, RequestOutput
from scheduler.params import MAX_SEED, SamplingParams, field_error
from .pipeline import StepPipeline
from scheduler.plan import Executor, StepPlan, StepResult
from scheduler.request import Request

log = get_logger()


def child_seed(seed: int, index: int) -> int:
    """Seed of completion `index`: the request's seed for 0, a splitmix64 step away otherwise."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & MAX_SEED


def request_seed(engine_seed: int, index: int) -> int:
    """Seed of the engine's `index`-th unseeded request (0-based, in add order): reproducible run to run."""
    return child_seed(engine_seed ^ 0x2545F4914F6CDD1D, index + 1)


def check_new_request(params: SamplingParams, request_id: str | None, max_num_seqs: int,
                      live_ids: Mapping[str, Any]) -> str:
    """What every engine front (EngineCore, the Ray pool) checks before queueing a request; returns its id
    (a fresh uuid when None: a counter's "req-3" can be a caller's own live id)."""
    if params.stop:  # text needs a tokenizer: the front ends that hold one cut the text themselves
        raise field_error(ValueError, "stop", f"SamplingParams.stop={list(params.stop)!r}: stop strings need a "
                          f"tokenizer; use ourobatch.LLM or the HTTP server, or stop_token_ids with this engine")
    if params.n > max_num_seqs:  # one request's samples fit in one batch
        raise field_error(RequestRejectedError, "n", f"SamplingParams.n={params.n} exceeds max_num_seqs="
                          f"{max_num_seqs}; lower n or raise max_num_seqs")
    if request_id is None:
        return f"req-{uuid.uuid4().hex}"
    check_ids_free([request_id], live_ids)
    return request_id


def build_prompt_logprobs(r: Request) -> list[dict[int, Logprob] | None] | None:
    """r's prompt log-probs in vLLM's shape, or None until all P - 1 of them are computed."""
    prompt = r.prompt_token_ids
    if len(r.prompt_logprobs) < len(prompt) - 1:
        return None
    out: list[dict[int, Logprob] | None] = [None]
    for token, (logprob, rank, top) in zip(prompt[1:], r.prompt_logprobs):
        entry = {token: Logprob(logprob, rank)}
        for i, (t, lp) in enumerate(top, start=1):
            entry.setdefault(t, Logprob(lp, i))
        out.append(entry)
    return out


@dataclass(eq=False)
class ParentRequest:
    """A caller's request: one prompt, n child requests in the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request] = field(default_factory=list)
    weight_version: int = 0
    _prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:
            return children[0].is_finished
        return all(c.is_finished for c in children)

    def output(self, since: list[int] | None = None) -> RequestOutput:
        """The cumulative output, or with `since` (tokens already delivered per child) only what is new."""
        outs = []
        for i, c in enumerate(self.children):
            start = since[i] if since is not None else 0
            stop = c.output_token_ids[-1] if c.finish_reason == "stop" and c.output_token_ids else None
            top = c.top_logprobs[start:] if c.top_logprobs is not None else None
            outs.append(CompletionOutput(
                index=i, token_ids=c.output_token_ids[start:], logprobs=c.logprobs[start:],
                readout_loops=c.readout_loops[start:],
                cumulative_logprob=c.cumulative_logprob, finish_reason=c.finish_reason,
                seed=c.params.seed if c.params.seed is not None else 0,
                weight_version=c.admission_version if c.admission_version is not None else self.weight_version,
                weight_versions=c.weight_versions[start:], num_preemptions=c.num_preemptions,
                top_logprobs=[dict(t) for t in top] if top is not None else None,
                stop_reason=stop, error=c.error, num_drafted=c.num_drafted, num_accepted=c.num_accepted,
            ))
        first = since is None or not since[0]  # DELTA outputs carry the prompt log-probs once, as vLLM's
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outs, self.finished,
                             self.prompt_logprobs() if first else None,
                             self.children[0].num_cached_tokens if self.children else 0)

    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's prompt_logprobs (built once, when completion 0's prefill has computed them all)."""
        if self._prompt_logprobs is None and self.params.prompt_logprobs is not None and self.children:
            self._prompt_logprobs = build_prompt_logprobs(self.children[0])
        return self._prompt_logprobs

    def num_tokens(self) -> list[int]:
        return [c.num_output_tokens for c in self.children]


class EngineCore:
    """Owns the scheduler and the executor. Not thread-safe: one driver calls it from one thread."""

    def __init__(self, scheduler_config: SchedulerConfig, executor: Executor,
                 extra_stats: Callable[[], Mapping[str, Any]] | None = None, seed: int = 0,
                 tensor_names: Callable[[], Iterable[str]] = tuple, async_scheduling: bool = False) -> None:
        self.scheduler = Scheduler(scheduler_config)
        # the engine's control state (pause, sleep, weights, life): its one owner (control.py)
        self.control = EngineControl(self.scheduler, tensor_names)
        self.seed = seed  # the engine seed: unseeded requests get request_seed(seed, i)
        self._num_unseeded = 0  # unseeded requests added so far: i of the next one
        self.executor = executor
        self.parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, str] = {}  # child request id -> parent request id
        self._extra_stats = extra_stats
        if async_scheduling and scheduler_config.mode == "verify":
            raise ValueError("async_scheduling needs mode 'deferred' or 'eager': verify mode's next step "
                             "depends on how many drafts the step before accepts")
        self.pipeline = StepPipeline(self, lookahead=async_scheduling)  # the stepping loop (pipeline.py)

    # ------------------------------------------------------------------ requests

    def check(self, prompt_token_ids: Iterable[int], params: SamplingParams | Mapping[str, Any] | None,
              request_id: str | None = None, op: str = "add") -> None:
        """Raise what add() would raise for this request now, changing nothing (a batch checks every prompt
        before it queues any: a rejected batch leaves no trace in the counters)."""
        params, _, _ = self._admissible(params, request_id, op)
        self.scheduler.check(prompt_token_ids, params)

    def _admissible(self, params: SamplingParams | Mapping[str, Any] | None, request_id: str | None,
                    op: str) -> tuple[SamplingParams, str, list[str]]:
        """The checks of a request as a whole: the control state allows `op`, its params and its id (and its
        completions' ids) are free. -> (params, request id, completion ids)."""
        params = SamplingParams.coerce(params)
        self.control.check(op)
        request_id = check_new_request(params, request_id, self.scheduler.config.max_num_seqs, self.parents)
        child_ids = [f"{request_id}:{i}" for i in range(params.n)] if params.n > 1 else [request_id]
        check_ids_free(child_ids, self.scheduler.requests)  # all before any is added: nothing half-queued
        return params, request_id, child_ids

    def check_batch(self, arguments: Sequence[tuple[Iterable[int], Any, str | None]], op: str = "add") -> None:
        """check() for each (prompt, params, request_id) of a batch, and no request_id twice in it."""
        ids = [rid for _, _, rid in arguments if rid is not None]
        if len(set(ids)) != len(ids):
            twice = next(rid for rid in ids if ids.count(rid) > 1)
            raise field_error(ValueError, "request_id", f"request_ids holds {twice!r} more than once")
        for prompt, params, request_id in arguments:
            self.check(prompt, params, request_id, op)

    def add(self, prompt_token_ids: Iterable[int], params: SamplingParams | Mapping[str, Any] | None,
            request_id: str | None = None, op: str = "add") -> ParentRequest:
        """Validate and queue a request; raises (and changes nothing) on bad input or when the control
        state refuses `op` ("add": the async engine's, which queues; "add_sync": SyncEngine's)."""
        params, request_id, child_ids = self._admissible(params, request_id, op)
        unseeded = params.seed is None
        if unseeded:  # request i of this engine gets a seed derived from (engine seed, i), reported back
            params = params.with_seed(request_seed(self.seed, self._num_unseeded))
        if params.min_tokens:  # the sampler masks these while fewer than min_tokens exist (vLLM's set)
            params = params.with_checkpoint_eos(self.scheduler.config.eos_token_ids)
        parent = ParentRequest(request_id, [], params, weight_version=self.control.weight_version)
        for i, cid in enumerate(child_ids):
            # Child 0 is validated first; the others differ only in seed and id, so they cannot fail.
            child_params = params.with_seed(child_seed(params.seed, i))
            if i and params.prompt_logprobs is not None:  # the prompt's log-probs are the request's: completion
                child_params = dataclasses.replace(child_params, prompt_logprobs=None)  # 0 computes them
            parent.children.append(self.scheduler.add(cid, prompt_token_ids, child_params))
            self._parent_of[cid] = request_id
        self._num_unseeded += unseeded
        parent.prompt_token_ids = list(parent.children[0].prompt_token_ids)
        self.parents[request_id] = parent
        log.debug("request_added", request_id=request_id, prompt_tokens=len(parent.prompt_token_ids),
                  max_tokens=params.max_tokens, n=params.n)
        return parent

    def abort(self, request_id: str, stop_string: bool = False) -> ParentRequest | None:
        """End a live request with finish_reason 'abort'; unknown or finished ids are ignored.

        With n > 1, ``"{request_id}:{index}"`` ends one completion only (its siblings keep running), as a
        collector does when a sample reaches its length or a reward model has seen enough. `stop_string`: a
        front end (LLM, the server) cut it at a stop string: the stats count it as finished by stop."""
        parent = self.parents.get(request_id)
        if parent is None:
            parent = self.parents.get(self._parent_of.get(request_id, ""))
            if parent is None or not self.scheduler.abort(request_id, stop_string):
                return None
            log.info("completion_aborted", request_id=parent.request_id, completion=request_id)
            if parent.finished:
                self._forget(parent)
            return parent
        for child in parent.children:
            self.scheduler.abort(child.request_id, stop_string)
        self._forget(parent)
        log.info("request_aborted", request_id=request_id)
        return parent

    def fail_all(self, message: str) -> list[ParentRequest]:
        """End every live request with 'error' (the engine is going down)."""
        updates = self.scheduler.fail_all(message)
        return self._touched(updates)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block (blocks live requests hold stay theirs); returns how many."""
        dropped = self.scheduler.reset_prefix_cache()
        log.info("prefix_cache_reset", blocks=dropped)
        return dropped

    def close(self) -> None:
        """Release the executor (weights, KV pool, graphs). Call from the thread that steps, with live
        requests ended; a step still in flight is read first. The scheduler's bookkeeping (plain Python)
        stays readable."""
        if self.executor is not None:
            self.pipeline.drain()
        executor, self.executor = self.executor, None  # type: ignore[assignment]
        self._extra_stats = None
        close = getattr(executor, "close", None)
        if close is not None:
            close()

    @property
    def is_closed(self) -> bool:
        return self.executor is None

    def _forget(self, parent: ParentRequest) -> None:
        del self.parents[parent.request_id]
        for child in parent.children:
            self._parent_of.pop(child.request_id, None)

    # ------------------------------------------------------------------ stepping

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule()

    def update(self, plan: StepPlan, result: StepResult) -> list[ParentRequest]:
        """Apply a step's result; return the parents that changed (finished ones are forgotten here)."""
        for failure in result.failures:
            log.warning("step_phase_failed", step=plan.step_id, phase=failure.phase.value,
                        requests=list(failure.request_ids), error=failure.message)
        if plan.deep:
            log.info("deep_boundary", step=plan.step_id, cohorts=sorted({d.cohort_id for d in plan.deep}),
                     requests=len(plan.deep), rows=sum(d.num_rows for d in plan.deep))
        return self._touched(self.scheduler.update(plan, result))

    def step(self) -> list[ParentRequest]:
        """Run one step on the calling thread: one update (with async scheduling the next step is already
        launched when it returns; drain() reads it)."""
        return self.pipeline.advance(may_plan_ahead=self._may_plan_ahead) or []

    def _may_plan_ahead(self) -> bool:
        return not self.control.needs_loop  # control work comes next: it runs with nothing in flight

    def drain(self) -> list[ParentRequest]:
        """Read and update the step in flight, if any (async scheduling): afterwards no step runs."""
        return self.pipeline.drain()

    def poll(self) -> bool:
        """EngineControl.poll() between steps: the pipeline is drained first when the control state has
        something to apply. True if a step may run."""
        if self.control.needs_loop:
            self.drain()
        return self.control.poll()

    def _touched(self, updates: list[RequestUpdate]) -> list[ParentRequest]:
        touched: dict[str, ParentRequest] = {}
        for u in updates:
            parent = self.parents.get(self._parent_of.get(u.request.request_id, ""))
            if parent is not None:
                touched[parent.request_id] = parent
                if u.num_new_tokens and u.request.num_output_tokens == 1:
                    log.debug("request_prefilled", request_id=parent.request_id,
                              cohort=u.request.cohort_id)
        for parent in touched.values():
            if parent.finished:
                self._forget(parent)
                c = parent.children[0]
                event = "request_failed" if c.finish_reason == "error" else "request_finished"
                log.info(event, request_id=parent.request_id, finish_reason=c.finish_reason,
                         tokens=c.num_output_tokens, cohort=c.cohort_id, error=c.error)
        return list(touched.values())

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self.scheduler.stats())
        stats.update(self.control.snapshot())
        if self._extra_stats is not None:
            stats.update(self._extra_stats())
        return stats
