"""The oracle of tests/test_ray_pool_stateful.py: what one pool request may end with, given the events of
its life that the state machine recorded (no tests here: the machine calls these after every example).

Events: "killed" (a replica died while it was live, or it may have been sent to one already dead),
"updated" (an update ran while it was live), "keep_update" (one ran under pause("keep")),
"pause_abort", "maybe_refused" (weights may have been missing or half-updated somewhere),
"surely_refused" (submitted while no replica held weights); ``aborted``: the completions pool.abort ended.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import pytest

from ourobatch import SamplingParams
from ourobatch.ray import ReplicaDiedError
from scheduler.errors import InconsistentWeightsError


@dataclasses.dataclass(eq=False)
class Record:
    """One request of the machine and the events of its life that widen what it may end with."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    how: str  # "generate" | "cumulative" | "delta" (a stream of that output kind)
    future: Future
    events: set[str] = dataclasses.field(default_factory=set)
    aborted: set[int] = dataclasses.field(default_factory=set)  # completions pool.abort ended

    @property
    def live(self) -> bool:
        return not self.future.done()


def check_outputs(world: Any, rec: Record, outs: list, retry: bool) -> None:
    """Exactly one finished output, the last; streams extend (CUMULATIVE) or join (DELTA) to it."""
    assert "surely_refused" not in rec.events or "updated" in rec.events, f"{rec.rid} ran without weights"
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1]), rec.rid
    if rec.how == "delta":
        final = dataclasses.replace(outs[-1], outputs=[dataclasses.replace(
            c, **{f: [x for o in outs for x in getattr(o.outputs[c.index], f)]
                  for f in ("token_ids", "logprobs", "readout_loops", "weight_versions")})
            for c in outs[-1].outputs])
    else:
        for a, b in zip(outs, outs[1:]):
            assert all(y.token_ids[:len(x.token_ids)] == x.token_ids for x, y in zip(a.outputs, b.outputs)), rec.rid
        final = outs[-1]
    assert len(final.outputs) == rec.params.n
    for c in final.outputs:
        check_completion(world, rec, c)


def check_completion(world: Any, rec: Record, c) -> None:
    where = f"{rec.rid}:{c.index} {sorted(rec.events)} {c.finish_reason} {c.weight_versions}"
    n = len(c.token_ids)
    assert n <= rec.params.max_tokens, where
    assert len(c.logprobs) == len(c.readout_loops) == len(c.weight_versions) == n, where
    assert c.finish_reason in ("length", "abort"), where
    if c.finish_reason == "length":
        assert n == rec.params.max_tokens, where
    else:  # aborted by the caller, pause("abort"), or a continuation whose weights changed meanwhile
        assert c.index in rec.aborted or "pause_abort" in rec.events or {"killed", "updated"} <= rec.events, where
    versions = set(c.weight_versions)
    if "keep_update" not in rec.events:
        assert len(versions) <= 1, f"mixed weight versions: {where}"
    if len(versions) != 1 or versions & world.ambiguous:
        return
    (version,) = versions
    if rec.params.temperature != 0.0 and rec.events & {"killed", "updated", "keep_update"}:
        return  # a retried sampled completion is a fresh draw given its prefix
    want = world.reference(world.ckpt_of[version], rec.prompt, rec.params).outputs[c.index]
    assert c.token_ids == want.token_ids[:n], f"not the single engine's tokens: {where}"
    assert c.readout_loops == want.readout_loops[:n], where
    assert c.logprobs == pytest.approx(want.logprobs[:n], abs=1e-9), where


def check_error(rec: Record, exc: BaseException, retry: bool) -> None:
    where = f"{rec.rid} {sorted(rec.events)}: {type(exc).__name__}: {exc}"
    if isinstance(exc, ReplicaDiedError) and "killed" in rec.events and not retry:
        return  # sent to a killed replica the pool still thought ready: the death can beat the refusal
    if "surely_refused" in rec.events and "updated" not in rec.events:
        assert isinstance(exc, InconsistentWeightsError), where
    if isinstance(exc, InconsistentWeightsError):
        assert "maybe_refused" in rec.events, where
    elif isinstance(exc, ReplicaDiedError):
        assert "killed" in rec.events and not retry, where
    else:
        raise AssertionError(f"not a legal end: {where}") from exc
