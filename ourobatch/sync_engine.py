"""SyncEngine: the blocking facade for scripts, tests and the CLI. One plain loop over EngineCore.step()."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from ourobatch.scheduler.errors import EngineClosedError
from ourobatch.scheduler.outputs import RequestOutput
from ourobatch.scheduler.params import SamplingParams

from ourobatch.scheduler.frontend import EngineCore

from ._core import build_engine_core
from .config import EngineConfig, batch_arguments, resolve_config

ParamsLike = SamplingParams | Mapping[str, Any] | None


class SyncEngine:
    """Generate on the calling thread. ``with SyncEngine(EngineConfig(model=...)) as llm: ...``"""

    def __init__(self, config: EngineConfig | None = None, *, model: Any = None, **kwargs: Any) -> None:
        """`model`: an already loaded OuroForCausalLM of this checkpoint, dtype and device, to share between
        engines (harnesses that run many configurations load the weights once)."""
        self.config = config = resolve_config(config, kwargs)
        self._core: EngineCore | None = build_engine_core(config, model=model)

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
        parents = []
        try:
            for prompt, p, request_id in batch_arguments(prompts, params, request_ids):
                parents.append(core.add(prompt, p, request_id))
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
