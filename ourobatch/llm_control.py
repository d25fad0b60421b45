"""The calls an RL worker makes on vLLM's ``LLM`` between two ``generate`` calls, on ourobatch's ``LLM``.

vLLM's ``LLM.sleep(level)``, ``wake_up(tags)`` and ``reset_prefix_cache()`` keep their names and meaning;
weight updates, which vLLM reaches through ``collective_rpc`` into its workers, are one call here
(``update_weights`` / ``load_weights``, as SyncEngine's). ``LLM`` runs its engine on the calling thread and
returns from ``generate`` only with every request finished, so these calls never meet a running request:
the rules that remain are EngineControl's (ourobatch/runtime/control.py), and a ``generate`` while asleep
raises EngineAsleepError (never waits).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterable

WAKE_TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags


def _controls() -> Any:
    from . import _control  # torch loads here

    return _control


class LLMControl:
    """Mixed into ourobatch.LLM: its RL calls. The host class provides ``_require_core()``."""

    def _require_core(self) -> Any:  # pragma: no cover - LLM's
        raise NotImplementedError

    def _idle_core(self) -> Any:
        """The core, with no step in flight."""
        core = self._require_core()
        core.drain()  # a step planned ahead (async scheduling) lands first
        return core

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep``: level 1 moves the weights to the CPU, level 2 drops them (load new ones
        with update_weights / load_weights before the next generate); the KV pool and CUDA graphs are freed
        at both. The prefix cache is dropped."""
        _controls().sleep(self._idle_core(), nullcontext(), level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``LLM.wake_up``. ``tags`` (vLLM: wake the weights and the KV cache separately, to update
        weights before the KV pool comes back) is accepted, but any tag wakes both here: the pool comes back
        with the weights, so the peak memory of a weights-only wake is not saved."""
        if tags is not None:
            if isinstance(tags, str) or not all(isinstance(t, str) and t in WAKE_TAGS for t in tags):
                raise ValueError(f"LLM.wake_up(tags={tags!r}): tags must be None or a list of {list(WAKE_TAGS)}")
        _controls().wake_up(self._idle_core(), nullcontext())

    @property
    def is_sleeping(self) -> bool:
        return bool(self._require_core().stats()["is_sleeping"])

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``LLM.reset_prefix_cache``: forget every cached prompt block; True (nothing runs between
        generate calls, so it always succeeds)."""
        self._idle_core().reset_prefix_cache()
        return True

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], *, version: int | None = None) -> int:
        """Copy (checkpoint name, tensor) pairs into the weights in place (as Engine.update_weights); returns
        the new weight version, which every later completion reports. The prefix cache is dropped."""
        return _controls().update_weights(self._idle_core(), nullcontext(), named_tensors, version)

    def load_weights(self, path: str | Path, *, version: int | None = None) -> int:
        """update_weights from a Hugging Face checkpoint folder."""
        return self.update_weights(_controls().checkpoint_weights(self._idle_core(), path), version=version)
