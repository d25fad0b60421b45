"""What the collector counts: its counters, the staleness of consumed tokens, occupancy over time."""

from __future__ import annotations

import collections
from collections import Counter
from typing import Any, Iterable

COUNTERS = ("groups_started", "groups_yielded", "groups_filtered", "groups_carried", "groups_aborted",
            "groups_stale", "groups_failed", "samples_started", "samples_restarted", "samples_paused", "batches",
            "updates",
            "tokens_consumed", "mixed_version_samples", "samples_consumed")


def new_counters() -> collections.Counter:
    counters: collections.Counter = collections.Counter()
    for name in COUNTERS:
        counters[name] = 0
    return counters


class Ledger:
    """The collector's counters (``collector.counters``), ``staleness_histogram`` (consumed tokens by how
    many updates behind their version was at hand-over) and ``occupancy`` ((t, samples in flight, engine
    running) every occupancy_interval_s)."""

    def __init__(self) -> None:
        self.counters = new_counters()
        self.staleness_histogram: Counter[int] = Counter()
        self.occupancy: list[tuple[float, int, int | None]] = []

    def account(self, batch: Any, budget: Any) -> None:
        c = self.counters
        c["batches"] += 1
        c["groups_yielded"] += len(batch.groups)
        for s in batch.samples:
            c["samples_consumed"] += 1
            c["tokens_consumed"] += len(s.token_ids)
            c["mixed_version_samples"] += s.is_mixed
            for v in s.weight_versions:
                self.staleness_histogram[budget.staleness(v)] += 1

    def stats(self, budget: Any, runs: Iterable[Any], num_paused: int) -> dict[str, Any]:
        in_flight: Counter[int] = Counter()
        for run in runs:
            for s in run.samples:
                if s is not None:
                    in_flight[s.oldest_version] += 1
        running = [r for _, _, r in self.occupancy if r is not None]
        return {**self.counters, "samples_in_flight": budget.samples_in_flight,
                "groups_in_flight": budget.groups_in_flight, "groups_ready": budget.groups_ready,
                "samples_paused_now": num_paused, "weight_version": budget.current_version,
                "staleness_histogram": dict(sorted(self.staleness_histogram.items())),
                "finished_samples_in_flight_by_version": dict(in_flight),
                "mean_samples_in_flight": _mean([s for _, s, _ in self.occupancy]),
                "mean_engine_running": _mean(running) if running else None}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
