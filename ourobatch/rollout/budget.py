"""How far ahead the collector may generate: sample slots and the staleness bound (pure, no awaits).

Versions are counted in *updates through the collector* (ordinals), whatever numbers the engine uses:
a token's staleness when a batch is handed over is ``ordinal(current) - ordinal(token's version)``.

Admission (AReaL's rule, in groups): a new group may start while the groups that count toward batches
(yielded + ready + in flight) stay within ``yielded_at_update + (eta + 1) * groups_per_batch +
oversample``, where ``yielded_at_update`` is how many groups had been yielded when the consumer last
updated the weights. With eta = 0 this admits exactly one batch per version: it stops admitting before
an update and drains (on-policy); with eta = 1 the next batch generates while the consumer trains.
Staleness only comes from updates, so when the consumer asks for a batch, nothing is ready or in flight
and no update came, the budget opens one more batch at the current version (no staleness is added).
The bound itself is enforced at hand-over (``Collector``), where a group over it is regenerated.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Budget:
    n: int  # samples per group
    groups_per_batch: int
    max_staleness: int | None  # eta; None: no bound
    oversample: int  # groups in flight beyond what the bound admits
    max_samples_in_flight: int  # sample slots (the engine's max_num_seqs x replicas, plus some queue)
    samples_in_flight: int = 0
    groups_in_flight: int = 0
    groups_ready: int = 0
    groups_yielded: int = 0
    yielded_at_update: int = 0
    ordinals: dict[int, int] = field(default_factory=dict)  # engine version -> updates before it
    current_version: int = 0

    def start_at(self, version: int) -> None:
        self.current_version = version
        self.ordinals.setdefault(version, 0)

    def can_start_group(self) -> bool:
        if self.samples_in_flight + self.n > self.max_samples_in_flight:
            return False
        if self.max_staleness is None:
            return True
        live = self.groups_yielded + self.groups_ready + self.groups_in_flight
        return live < self.yielded_at_update + (self.max_staleness + 1) * self.groups_per_batch + self.oversample

    def updated(self, version: int) -> None:
        """The consumer pushed new weights (the engine now serves `version`)."""
        self.ordinals[version] = max(self.ordinals.values(), default=0) + 1
        self.current_version = version
        self.yielded_at_update = self.groups_yielded

    def open_one_batch(self) -> None:
        """Nothing to wait for and no update since: let one more batch start at the current version."""
        self.yielded_at_update = self.groups_yielded

    def staleness(self, version: int) -> int:
        return self.ordinals[self.current_version] - self.ordinals.get(version, 0)

    def is_stale(self, oldest_version: int) -> bool:
        return self.max_staleness is not None and self.staleness(oldest_version) > self.max_staleness
