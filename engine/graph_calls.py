"""The calls a CUDA graph is captured for, as typed keys (torch-free): a shallow step or a deep call of one
loop range, or a prefill. With the bucket (requests; tokens for a prefill) they name one graph of the cache
(cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShallowCall:
    """Loops 1..last_loop over one fed token per request (a ShallowWork group)."""

    last_loop: int
    retain: bool  # the last loop's readout is written as a retained row

    def __str__(self) -> str:  # how the cuda_graphs_captured log event names it
        return f"shallow:{self.last_loop}:{self.retain}"


@dataclass(frozen=True)
class DeepCall:
    """Loops first_loop..T over rows_per_request retained rows of each request (a uniform DeepWork batch)."""

    first_loop: int
    rows_per_request: int

    def __str__(self) -> str:
        return f"deep:{self.first_loop}:{self.rows_per_request}"


@dataclass(frozen=True)
class PrefillCall:
    """Loops 1..T over a step's prompt chunks, padded to a bucket of tokens (engine/prefill_graph.py). Every
    mode prefills, so the cache captures its buckets whatever the mode (not one of mode_calls)."""

    def __str__(self) -> str:
        return "prefill"


GraphCall = ShallowCall | DeepCall | PrefillCall


def mode_calls(mode: str, total_ut_steps: int, deep_interval: int, shallow_loops: int) -> list[GraphCall]:
    """The graphed calls a scheduler of this mode plans (scheduler/decode_plan.py, verify_plan.py)."""
    T, s, B = total_ut_steps, shallow_loops, deep_interval
    if mode == "verify":
        return [ShallowCall(s, True)]  # drafts; the verify deep call is varlen (eager)
    if mode == "eager" or B == 1:  # every step one call of loops 1..T, nothing retained
        return [ShallowCall(T, False)]
    return [ShallowCall(s, True), DeepCall(s + 1, B)]
