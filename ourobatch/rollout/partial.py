"""Partial rollouts (slime's): a long sample is paused at a hand-over and continued after the next update.

With ``Collector(max_tokens_per_round=k)``, every sample still in flight when a batch is handed over that
has produced at least k tokens in its current round is *paused*: its engine request is aborted (its KV
and its engine slot are freed at once) and what it produced is kept. It resumes when the consumer next
updates the weights (or at once, when the consumer waits for a batch and nothing but paused samples is
left): a new request whose prompt is the task's prompt plus every token so far (prefilled under the
weights current then, as ``on_update="recompute"`` does), for the rest of its ``max_tokens``, seeded per
round. Its tokens keep the versions they were drawn under, so the staleness bound still holds on the
oldest token: a paused sample's group can still be regenerated at a hand-over if it waited too long.

A sample in rounds streams its tokens (DELTA) so the collector knows how far each round has come; the
others wait for their final output only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import anyio

from ourobatch.runtime.engine_core import child_seed
from scheduler.params import RequestOutputKind, SamplingParams
from ourobatch.runtime.streams import OutputStream


@dataclass
class Rounds:
    """What one sample produced over its rounds (plain lists, extended by each round's deltas)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    readout_loops: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    round_starts: list[int] = field(default_factory=lambda: [0])
    this_round: int = 0  # tokens produced in the current round
    first_version: int | None = None  # the version the first round was admitted under
    num_preemptions: int = 0

    def add(self, c: Any) -> None:
        """Absorb one DELTA output of the current round."""
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs
        self.readout_loops += c.readout_loops
        self.weight_versions += c.weight_versions
        self.this_round += len(c.token_ids)
        if self.first_version is None:
            self.first_version = c.weight_version
        self.num_preemptions = max(self.num_preemptions, c.num_preemptions)

    def next_round(self) -> None:
        self.round_starts.append(len(self.token_ids))
        self.this_round = 0

    def request(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt and params of the current round: what is left of max_tokens / min_tokens, after the
        tokens so far, with a seed of its own per round (round 0 keeps the sample's seed)."""
        produced = len(self.token_ids)
        rounds = len(self.round_starts) - 1
        seed = params.seed if rounds == 0 or params.seed is None else child_seed(params.seed, rounds)
        p = dataclasses.replace(params, max_tokens=params.max_tokens - produced,
                                min_tokens=max(0, params.min_tokens - produced), seed=seed,
                                output_kind=RequestOutputKind.DELTA)
        return prompt + self.token_ids, p


async def run_round(engine: Any, prompt: list[int], params: SamplingParams, request_id: str,
                    rounds: Rounds) -> Any:
    """One round of a sample: stream it into `rounds`; returns the last CompletionOutput (its
    finish_reason says how the round ended: "abort" when it was paused, or cancelled)."""
    last = None
    stream: OutputStream = engine.stream(prompt, params, request_id)  # an Engine's or an EnginePool's
    async with stream:  # closed whatever happens: a round left early aborts its request
        async for out in stream:
            last = out.outputs[0]
            rounds.add(last)
    return last


class Pauser:
    """The collector's paused samples: which to pause at a hand-over, and when they continue."""

    def __init__(self, engine: Any, max_tokens_per_round: int | None) -> None:
        self.engine = engine
        self.k = max_tokens_per_round
        self.num_paused = 0  # samples waiting between rounds

    async def pause_long_samples(self, runs: Any) -> None:
        """At a hand-over: each sample whose current round has k tokens gives up its engine slot."""
        if self.k is None:
            return
        for run in list(runs):
            for i, rid in list(run.live.items()):
                r = run.rounds.get(i)
                if r is not None and r.this_round >= self.k and i not in run.paused:
                    run.paused.add(i)
                    await self.engine.abort(rid)

    async def wait(self, run: Any, i: int, budget: Any, notify: Any) -> None:
        """Sample i of `run` was paused: free its sample slot until `wake`, then start its next round."""
        run.paused.discard(i)
        budget.samples_in_flight -= 1
        self.num_paused += 1
        if run.wake is None:
            run.wake = anyio.Event()
        wake = run.wake
        notify()
        try:
            await wake.wait()
        finally:
            self.num_paused -= 1
            budget.samples_in_flight += 1
        run.rounds[i].next_round()

    @staticmethod
    def wake(runs: Any) -> None:
        for run in list(runs):
            if run.wake is not None:
                run.wake.set()
                run.wake = None
