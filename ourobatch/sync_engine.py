"""SyncEngine: the blocking facade for scripts, tests and the CLI. One plain loop over EngineCore.step().

Thread safety. One lock guards the core. A caller adds its requests under the lock, then loops: take
the lock, stop if all of its own requests have finished, else run one step. A step advances every
caller's requests, whichever thread runs it, so several threads share one batch (and each returns as
soon as its own requests are done) instead of corrupting each other's state. With async scheduling a
step may still be in flight between two calls (EngineCore's pipeline): every control call, and poll(),
drains it first under the lock.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tqdm.auto import tqdm

from scheduler.errors import EngineClosedError
from ourobatch.runtime.engine_core import EngineCore
from ourobatch.outputs import RequestOutput
from scheduler.params import SamplingParams

from ourobatch.runtime.control import EngineControl, Run

from . import _control
from .assembly import build_engine_core
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
        # generate() calls of other threads wait on it while a control call has stopped stepping
        self._changed = threading.Condition(self._lock)
        self._core: EngineCore | None = build_engine_core(config, model=loaded_model)
        self.control: EngineControl = self._core.control  # the rules; this class only serializes

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
                core.control.close()
                for request_id in list(core.parents):
                    core.abort(request_id)
                core.close()
            self._changed.notify_all()  # generate() calls waiting on a pause return their aborted outputs

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
            core.check_batch(arguments, op="add_sync")  # every prompt checked first: a rejected batch queues nothing
            try:
                for prompt, p, request_id in arguments:
                    # refused on a paused / sleeping engine: stepping on this thread could never finish
                    parents.append(core.add(prompt, p, request_id, op="add_sync"))
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
                    if not self.core.poll():
                        self._changed.wait()  # another thread paused it (or sleeps it): wait for resume()
                        continue
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

    # ------------------------------------------------------------------ the RL contract (blocking)
    # Thin: the rules are EngineControl's (ourobatch/runtime/control.py); every call holds the lock, which steps
    # also hold, so none ever runs with a step in flight. Each ends by waking generate() calls that wait.

    def _controlled(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            try:
                self.core.drain()  # control calls run with no step in flight
                return fn(self.core, *args)
            finally:
                self._changed.notify_all()

    def pause(self, mode: str = "abort") -> None:
        """As Engine.pause: "abort" ends live requests now (their generate() calls return the partial
        outputs); "wait" runs every admitted request to its end, admitting nobody new; "keep" flushes
        pending deep work (a forced boundary) and freezes running requests. Other threads' generate()
        calls wait until resume(); a new generate() on a paused engine raises EngineBusyError."""
        self._controlled(self._pause, mode)

    def _pause(self, core: EngineCore, mode: str) -> None:
        core.control.pause(mode)  # validates the mode
        if mode == "abort":
            self.abort_all()
        while core.poll() and core.control.run is Run.PAUSING:  # "wait": run to the end; "keep": flush
            core.step()
        core.drain()

    def resume(self, *, recompute_kv: bool = False) -> None:
        """As Engine.resume (the recompute of kept requests runs before the next step)."""
        self._controlled(lambda core: core.control.resume(recompute_kv))

    @property
    def is_paused(self) -> bool:
        return self.stats()["is_paused"]

    def abort_all(self) -> list[RequestOutput]:
        """Abort every live request; returns their partial outputs."""
        with self._lock:
            core, outputs = self.core, []
            for request_id in list(core.parents):
                parent = core.parents[request_id]
                core.abort(request_id)
                outputs.append(parent.output())
            return outputs

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        """As Engine.update_weights (in place; only while paused or idle); returns the new version."""
        return self._controlled(_control.update_weights, self._lock, named_tensors, version)

    def load_weights(self, path: str | Path, *, version: int | None = None) -> int:
        """update_weights from a Hugging Face checkpoint folder."""
        return self.update_weights(_control.checkpoint_weights(self.core, path), version=version)

    def sleep(self, level: int = 1) -> None:
        """As Engine.sleep: weights to CPU (1) or dropped (2); KV pool and graphs freed."""
        self._controlled(_control.sleep, self._lock, level)

    def wake_up(self) -> None:
        self._controlled(_control.wake_up, self._lock)

    @property
    def is_sleeping(self) -> bool:
        return self.stats()["is_sleeping"]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt block (e.g. after changing weights); returns how many were dropped."""
        with self._lock:
            self.core.drain()
            return self.core.reset_prefix_cache()

    def score(self, prompt_token_ids: Sequence[int], completion_token_ids: Sequence[int],
              readout_loops: Sequence[int] | None = None, params: ParamsLike = None) -> list[float]:
        """No-grad log-prob of each completion token under the engine's weights, as the engine reports them
        (its logprobs_mode and head_dtype): token j from loop readout_loops[j-1] (default: loop T).
        EngineAsleepError while asleep, InconsistentWeightsError while weights are missing."""
        return self._controlled(_control.score, self._lock, prompt_token_ids, completion_token_ids,
                                readout_loops, params)

    def stats(self) -> dict[str, Any]:
        """Counters: deep_calls, deep_rows, shallow_steps, prefill_tokens, kv_blocks_used, kv_blocks_total, ..."""
        with self._lock:
            return self.core.stats()
