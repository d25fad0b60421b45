"""SyncEngine: the blocking facade for scripts, tests and the CLI. One plain loop over EngineCore.step().

Thread safety. One lock guards the core. A caller adds its requests under the lock, then loops: take
the lock, stop if all of its own requests have finished, else run one step. A step advances every
caller's requests, whichever thread runs it, so several threads share one batch (and each returns as
soon as its own requests are done) instead of corrupting each other's state.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from ourobatch.scheduler.errors import EngineClosedError
from ourobatch.scheduler.frontend import EngineCore
from ourobatch.scheduler.outputs import RequestOutput
from ourobatch.scheduler.params import SamplingParams

from ._core import build_engine_core
from .config import EngineConfig, batch_arguments, resolve_config

ParamsLike = SamplingParams | Mapping[str, Any] | None


class SyncEngine:
    """Generate on the calling thread. ``with SyncEngine(EngineConfig(model=...)) as llm: ...``

    Safe to share between threads (see the module docstring). It has no stream or abort: use the async
    ``Engine`` for those."""

    def __init__(self, config: EngineConfig | None = None, *, loaded_model: Any = None, **kwargs: Any) -> None:
        """`config`, or EngineConfig's fields as keywords (``SyncEngine(model="path", dtype=...)``, as
        ``Engine`` takes them). `loaded_model`: an already loaded OuroForCausalLM of this checkpoint,
        dtype and device, to share between engines (harnesses that run many configurations load the
        weights once)."""
        self.config = config = resolve_config(config, kwargs)
        self._lock = threading.RLock()
        self._core: EngineCore | None = build_engine_core(config, model=loaded_model)

    @property
    def core(self) -> EngineCore:
        core = self._core
        if core is None:
            raise EngineClosedError("this SyncEngine is closed")
        return core

    def __enter__(self) -> "SyncEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the weights, the KV pool and any CUDA graphs now. Waits for a step another thread runs."""
        with self._lock:
            core, self._core = self._core, None
            if core is not None:
                for request_id in list(core.parents):
                    core.abort(request_id)
                core.close()

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
        arguments = batch_arguments(prompts, params, request_ids)
        parents = []
        with self._lock:
            core = self.core
            try:
                for prompt, p, request_id in arguments:
                    parents.append(core.add(prompt, p, request_id))
            except BaseException:
                for parent in parents:  # all or nothing: a bad prompt leaves no request behind
                    core.abort(parent.request_id)
                raise
        bar = tqdm(total=len(parents), desc="generate", unit="req", disable=not use_tqdm)
        try:
            done = 0
            while True:
                with self._lock:
                    finished = sum(p.finished for p in parents)
                    if finished == len(parents):
                        break
                    self.core.step()  # may finish other threads' requests too: they read their own
                bar.update(finished - done)
                done = finished
            bar.update(len(parents) - done)
        except BaseException:
            with self._lock:
                if self._core is not None:
                    for parent in parents:
                        self._core.abort(parent.request_id)
            raise
        finally:
            bar.close()
        return [p.output() for p in parents]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt block (e.g. after changing weights); returns how many were dropped."""
        with self._lock:
            return self.core.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        """Counters: deep_calls, deep_rows, shallow_steps, prefill_tokens, kv_blocks_used, kv_blocks_total, ..."""
        with self._lock:
            return self.core.stats()
