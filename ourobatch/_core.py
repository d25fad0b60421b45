"""The composition root: checkpoint -> model, KV pool, executor and scheduler, wired together.

Shared by SyncEngine (a plain loop) and the async Engine. One `step()` is schedule -> execute -> update.
Also here: fanning a request with n > 1 out to n child requests, and building RequestOutputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ourobatch.engine.config import OuroConfig
from ourobatch.engine.executor import ModelExecutor
from ourobatch.engine.kv_cache import KVPool
from ourobatch.engine.loader import load_model
from ourobatch.scheduler.core import RequestUpdate, Scheduler, SchedulerConfig
from ourobatch.scheduler.outputs import CompletionOutput, RequestOutput
from ourobatch.scheduler.params import MAX_SEED, SamplingParams
from ourobatch.scheduler.plan import Executor, StepPlan
from ourobatch.scheduler.request import Request

from ._logging import get_logger
from .config import EngineConfig

log = get_logger()


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    name = config.dtype
    if name == "auto":
        name = "bfloat16" if config.device.startswith("cuda") else "float32"
    return getattr(torch, name)


def child_seed(seed: int, index: int) -> int:
    """Seed of completion `index` of a request: the request's seed for 0, a splitmix64 step away otherwise."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & MAX_SEED


@dataclass
class ParentRequest:
    """A caller's request: one prompt, n child requests in the scheduler (ids f"{request_id}:{i}")."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request] = field(default_factory=list)
    weight_version: int = 0

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        outs = []
        for i, c in enumerate(self.children):
            stop = c.output_token_ids[-1] if c.finish_reason == "stop" and c.output_token_ids else None
            outs.append(CompletionOutput(
                index=i, token_ids=list(c.output_token_ids), logprobs=list(c.logprobs),
                readout_loops=list(c.readout_loops), cumulative_logprob=c.cumulative_logprob,
                finish_reason=c.finish_reason, seed=c.params.seed or 0, weight_version=self.weight_version,
                top_logprobs=[dict(t) for t in c.top_logprobs] if c.top_logprobs is not None else None,
                stop_reason=stop, error=c.error,
            ))
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outs, self.finished)


class EngineCore:
    """Owns the model, the pool, the executor and the scheduler. Not thread-safe: one driver calls it."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.dtype = resolve_dtype(config)
        self.model_config = OuroConfig.from_checkpoint(config.model)
        mc = self.model_config
        T = mc.total_ut_steps
        if config.shallow_loops > T - 1:
            raise ValueError(
                f"EngineConfig.shallow_loops must satisfy 1 <= shallow_loops <= {T - 1} for this checkpoint "
                f"(total_ut_steps={T}), got {config.shallow_loops}")
        num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        self.model = load_model(config.model, self.dtype, config.device)
        self.pool = KVPool(T, mc.num_hidden_layers, num_blocks, config.block_size, mc.num_key_value_heads,
                           mc.head_dim, self.dtype, config.device)
        self.executor: Executor = executor or ModelExecutor(self.model, self.pool, config.device)
        self.scheduler = Scheduler(SchedulerConfig(
            num_kv_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_model_len=min(config.max_model_len, mc.max_position_embeddings),
            max_num_batched_tokens=config.max_num_batched_tokens, total_ut_steps=T,
            shallow_loops=config.shallow_loops, deep_interval=config.deep_interval, mode=config.mode,
            vocab_size=mc.vocab_size, eos_token_ids=frozenset(mc.eos_token_ids)))
        self.parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, str] = {}  # child request id -> parent request id
        self.weight_version = 0
        self._next_id = 0
        log.info("engine_ready", model=str(config.model), mode=config.mode, deep_interval=config.deep_interval,
                 shallow_loops=config.shallow_loops, kv_blocks=num_blocks, dtype=str(self.dtype))

    def _auto_num_blocks(self) -> int:
        mc, cfg = self.model_config, self.config
        per_block = (2 * mc.total_ut_steps * mc.num_hidden_layers * cfg.block_size * mc.num_key_value_heads
                     * mc.head_dim * torch.empty((), dtype=self.dtype).element_size())
        wanted = math.ceil(cfg.max_num_seqs * cfg.max_model_len / cfg.block_size)
        return max(1, min(wanted, int(cfg.kv_cache_memory_gb * 2**30) // per_block))

    # ------------------------------------------------------------------ requests

    def add(self, prompt_token_ids, params, request_id: str | None = None) -> ParentRequest:
        params = SamplingParams.coerce(params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        child_ids = [f"{request_id}:{i}" for i in range(params.n)] if params.n > 1 else [request_id]
        for cid in child_ids:
            if cid in self.scheduler.requests:
                raise ValueError(f"request_id {cid!r} is already in use by a live request")
        parent = ParentRequest(request_id, [], params, weight_version=self.weight_version)
        base_seed = params.seed
        for i, cid in enumerate(child_ids):
            # Child 0 is validated first; the others differ only in seed and id, so they cannot fail.
            child_params = params if base_seed is None else params.with_seed(child_seed(base_seed, i))
            parent.children.append(self.scheduler.add(cid, prompt_token_ids, child_params))
            self._parent_of[cid] = request_id
        parent.prompt_token_ids = list(parent.children[0].prompt_token_ids)
        self.parents[request_id] = parent
        log.debug("request_added", request_id=request_id, prompt_tokens=len(parent.prompt_token_ids),
                  max_tokens=params.max_tokens, n=params.n)
        return parent

    def abort(self, request_id: str) -> ParentRequest | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            self.scheduler.abort(child.request_id)
        self._forget(parent)
        log.info("request_aborted", request_id=request_id)
        return parent

    def _forget(self, parent: ParentRequest) -> None:
        del self.parents[parent.request_id]
        for child in parent.children:
            self._parent_of.pop(child.request_id, None)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[ParentRequest]:
        """Run one engine step; return the parents that changed (finished ones are forgotten here)."""
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.released_request_ids:
            return []
        result = self.executor.execute(plan)
        for failure in result.failures:
            log.warning("step_phase_failed", phase=failure.phase.value, requests=list(failure.request_ids),
                        error=failure.message)
        if plan.deep:
            log.debug("deep_boundary", step=plan.step_id, cohorts=sorted({d.cohort_id for d in plan.deep}),
                      requests=len(plan.deep), rows=sum(d.num_rows for d in plan.deep))
        updates = self.scheduler.update(plan, result)
        return self._touched(updates)

    def _touched(self, updates: list[RequestUpdate]) -> list[ParentRequest]:
        touched: dict[str, ParentRequest] = {}
        for u in updates:
            parent = self.parents.get(self._parent_of.get(u.request.request_id, ""))
            if parent is not None:
                touched[parent.request_id] = parent
        for pid, parent in touched.items():
            if parent.finished:
                self._forget(parent)
                c = parent.children[0]
                log.debug("request_finished", request_id=pid, finish_reason=c.finish_reason,
                          tokens=c.num_output_tokens)
        return list(touched.values())

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["kv_capacity_tokens"] = self.pool.num_blocks * self.pool.block_size
        stats["kv_pool_bytes"] = self.pool.num_bytes
        stats["weight_version"] = self.weight_version
        return stats
