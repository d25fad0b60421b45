"""ReadyGroups: the complete groups waiting to be handed over, oldest start first."""

from __future__ import annotations

from collections import deque
from typing import Callable

from .types import Group


class ReadyGroups:
    def __init__(self) -> None:
        self._groups: deque[tuple[int, Group]] = deque()  # (start seq, group)

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, seq: int, group: Group) -> None:
        self._groups.append((seq, group))

    def pop_stale(self, is_stale: Callable[[int], bool]) -> list[Group]:
        """Remove and return, in order, every group whose oldest token version `is_stale`."""
        kept: deque[tuple[int, Group]] = deque()
        stale: list[Group] = []
        for seq, group in self._groups:
            if is_stale(group.oldest_version):
                stale.append(group)
            else:
                kept.append((seq, group))
        self._groups = kept
        return stale

    def take(self, count: int) -> tuple[list[Group], int]:
        """The oldest `count` groups (fewer if fewer wait; at least one must) and the newest start seq
        among them."""
        taken = [self._groups.popleft() for _ in range(min(count, len(self._groups)))]
        return [g for _, g in taken], max(seq for seq, _ in taken)
