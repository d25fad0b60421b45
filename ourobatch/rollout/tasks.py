"""TaskSource: the tasks the collector generates, in order, each with its index in the caller's iterable.

Tasks handed back to be generated again (a group that went stale before hand-over, surplus aborted at a
hand-over) come first and keep their index; then the caller's iterable, sync or async, until it ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterable, Sized
from typing import Any, AsyncIterator, Iterable


class TaskSource:
    def __init__(self, tasks: Iterable[Any] | AsyncIterator[Any]) -> None:
        self._tasks = tasks
        self.total = len(tasks) if isinstance(tasks, Sized) else None  # for the progress bar
        self._iter: Any = None
        self._is_async = isinstance(tasks, AsyncIterable)
        self.exhausted = False  # the caller's iterable has ended
        self._requeued: deque[tuple[int, Any]] = deque()
        self._next_index = 0

    def open(self) -> None:
        """Start iterating the caller's tasks (the collector's ``async with``)."""
        self._iter = self._tasks.__aiter__() if self._is_async else iter(self._tasks)

    def has_tasks(self) -> bool:
        return bool(self._requeued) or not self.exhausted

    def requeue(self, task_index: int, task: Any) -> None:
        """Generate `task` again (before any new one), under its own index."""
        self._requeued.append((task_index, task))

    async def next(self) -> tuple[int, Any] | None:
        """(index, task) of the next task, or None when the caller's iterable has just ended."""
        if self._requeued:
            return self._requeued.popleft()
        try:
            task = await self._iter.__anext__() if self._is_async else next(self._iter)
        except (StopIteration, StopAsyncIteration):
            self.exhausted = True
            return None
        self._next_index += 1
        return self._next_index - 1, task
