"""Retained rows (deferred and verify modes): the loop-s readouts of fed positions whose deep loops have
not run yet, in one device buffer ``rows[table_row, i]`` (i < deep_interval).

The shallow call writes them (``next_slots`` says where, ``advance`` counts them), the deep call reads
them (``check`` first: a deep work must cover exactly what is held); a released request's rows are
simply forgotten. Like the KV pool, the buffer is freed while the engine sleeps (``release``) and
allocated again, zeroed, on wake-up (``reallocate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from scheduler.plan import DeepWork, ShallowWork


@dataclass
class RetainedSpan:
    start_position: int  # position of retained row 0
    count: int = 0  # rows held in the device buffer


class RetainedRows:
    def __init__(self, num_table_rows: int, max_rows: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = (num_table_rows, max_rows, hidden_size)  # [table rows (+ scratch), rows, hidden]
        self.dtype = dtype
        self.device = device
        self.spans: dict[str, RetainedSpan] = {}  # request id -> the positions it holds
        self.rows: torch.Tensor | None = None
        self.reallocate()

    def reallocate(self) -> None:
        self.rows = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def release(self) -> None:
        """Free the buffer and forget every request's rows (sleep, close)."""
        self.rows = None
        self.spans.clear()

    def forget(self, request_id: str) -> None:
        self.spans.pop(request_id, None)

    def next_slots(self, works: Sequence[ShallowWork]) -> list[int]:
        """The buffer slot each retaining shallow work writes: the row after its request's last."""
        slots = []
        for w in works:
            kept = self.spans.get(w.request_id)
            if kept is None:
                kept = self.spans[w.request_id] = RetainedSpan(w.position)
            if kept.start_position + kept.count != w.position:
                raise RuntimeError(f"req {w.request_id}: retained rows end at "
                                   f"{kept.start_position + kept.count}, fed position {w.position}")
            slots.append(kept.count)
        return slots

    def advance(self, works: Sequence[ShallowWork]) -> None:
        """The shallow call wrote one row per work at next_slots()."""
        for w in works:
            self.spans[w.request_id].count += 1

    def check(self, works: Sequence[DeepWork]) -> None:
        """Every deep work must cover exactly the rows held for its request."""
        for d in works:
            assert d.first_loop == works[0].first_loop, "one deep call runs one loop range"
            kept = self.spans.get(d.request_id)
            if kept is None or kept.start_position != d.start_position or kept.count != d.num_rows:
                have = None if kept is None else (kept.start_position, kept.count)
                raise RuntimeError(f"req {d.request_id}: deep work wants rows ({d.start_position}, "
                                   f"{d.num_rows}) but the engine retains {have}")
