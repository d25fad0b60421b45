"""SyncEngine: the blocking facade for scripts, tests and the CLI. One plain loop over EngineCore.step()."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from ourobatch.scheduler.errors import EngineClosedError
from ourobatch.scheduler.outputs import RequestOutput
from ourobatch.scheduler.params import SamplingParams

from ourobatch.scheduler.frontend import EngineCore

from ._core import build_engine_core
from .config import EngineConfig

ParamsLike = SamplingParams | Mapping[str, Any] | None


class SyncEngine:
    """Generate on the calling thread. ``with SyncEngine(EngineConfig(model=...)) as llm: ...``"""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        self._core: EngineCore | None = build_engine_core(config)

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineClosedError("this SyncEngine is closed")
        return self._core

    def __enter__(self) -> "SyncEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._core = None

    def generate(self, prompt_token_ids: Sequence[int], params: ParamsLike = None,
                 request_id: str | None = None) -> RequestOutput:
        """Generate for one prompt and return its finished RequestOutput."""
        return self.generate_batch([prompt_token_ids], params,
                                   request_ids=None if request_id is None else [request_id])[0]

    def generate_batch(self, prompts: Sequence[Sequence[int]], params: ParamsLike | Sequence[ParamsLike] = None,
                       use_tqdm: bool = False, request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Generate for many prompts at once; outputs come back in the order of `prompts`.

        `params` is one SamplingParams (or dict) for all prompts, or a list with one per prompt.
        If any prompt is rejected, nothing is generated and the error is raised.
        """
        core = self.core
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of token-id lists")
        if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = [SamplingParams.coerce(p) for p in params]
        else:
            per_prompt = [SamplingParams.coerce(params)] * len(prompts)
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"got {len(request_ids)} request_ids for {len(prompts)} prompts")
        parents = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
                parents.append(core.add(prompt, p, None if request_ids is None else request_ids[i]))
        except BaseException:
            for parent in parents:  # all or nothing: a bad prompt leaves no request behind
                core.abort(parent.request_id)
            raise
        bar = tqdm(total=len(parents), desc="generate", unit="req", disable=not use_tqdm)
        try:
            pending = {p.request_id for p in parents}
            while pending:
                for parent in core.step():
                    if parent.finished and parent.request_id in pending:
                        pending.discard(parent.request_id)
                        bar.update(1)
        except BaseException:
            for parent in parents:
                core.abort(parent.request_id)
            raise
        finally:
            bar.close()
        return [p.output() for p in parents]

    def stats(self) -> dict[str, Any]:
        """Counters: deep_calls, deep_rows, shallow_steps, prefill_tokens, kv_blocks_used, kv_blocks_total, ..."""
        return self.core.stats()
