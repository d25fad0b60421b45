"""The order the startup warm-up's launches (engine/kernel_warmup.py) run in: the slowest compiles first where
they compile in forked children (each of those alone until its child is forked), else in stages that never compile
one specialization twice at once; and the pass's report, with a timeline of every launch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Task:
    """One warm-up launch: the kernels it uses (each builds a per-device cache on its first launch) and the
    specializations its launch compiles, the one it exists for first."""

    name: str  # its family: attention, fused, sampler, gemm
    launch: Callable[[], None]
    kernels: frozenset[str]
    keys: tuple[tuple, ...]


SLOWEST = ("gluon_layers", "gluon_mlp", "gluon_o")  # compiles of ~3-4 s (the loop-pass launch on the CPU: 3.5 s)


def longest_first(tasks: list[Task]) -> list[Task]:
    """The forked compiles' order: the slowest kernels' first (they started last, the loop-pass launch's compile
    ended ~4 s after the others: startup 10.7 s against 6.1), then the list's."""
    return sorted(tasks, key=lambda t: min((SLOWEST.index(k) for k in t.kernels if k in SLOWEST), default=len(SLOWEST)))


def head_first(tasks: list[Task]) -> tuple[list[Task], list[Task]]:
    """The forked pass's order split in two: the head, the slowest kernels' launches (SLOWEST's order), each to
    start alone until its child is forked; then the rest, in the list's order."""
    ordered = longest_first(tasks)
    head = [t for t in ordered if t.kernels & set(SLOWEST)]
    return head, [t for t in ordered if not t.kernels & set(SLOWEST)]


@dataclass
class KernelReport:
    """What warm_kernels launched, how long it took and what failed (a failure only costs a compile later)."""

    cases: dict[str, int] = field(default_factory=dict)  # family -> launches
    seconds: float = 0.0  # wall time
    task_seconds: float = 0.0  # the launches' times summed (the sequential cost: / seconds = the speed-up)
    failures: list[str] = field(default_factory=list)
    threads: int = 0  # threads it ran in
    driver_seconds: float = 0.0  # before the first launch: Triton's driver (warmup_pass._driver), in a thread
    list_seconds: float = 0.0  # listing the launches (kernel_cases), beside it (from the pass's start)
    prepare_seconds: float = 0.0  # and the kernels' per-device caches (warmup_pass._prepare)
    key_seconds: float = 0.0  # Triton's own key, made known beside all three (fork_compile.prime_key)
    key_source: str = ""  # how: "hashed", "stored" (engine/triton_key.py), "memory"; "" not asked, "none"
    timeline: list[dict] = field(default_factory=list)  # per launch (`entry`), by its end

    def add(self, results: list[tuple[str, float, str | None, dict]]) -> None:
        """Launches' (name, seconds, error or None, timeline entry)."""
        for name, seconds, error, line in results:
            self.cases[name] = self.cases.get(name, 0) + 1
            self.task_seconds += seconds
            self.timeline.append(line)
            if error is not None:
                self.failures.append(error)


def entry(task: Task, times: dict[str, float], children: list, zero: float) -> dict:
    """A launch's line in the timeline: its task and key, when it was queued, got its parent slot and ended, and its
    children's (forked, reported, compile seconds or None), all seconds from the pass's start (`zero`)."""
    at = lambda t: round(t - zero, 3)  # noqa: E731
    return dict(task=task.name, key=str(task.keys[0]) if task.keys else "", queued=at(times["queued"]),
                slot=at(times.get("slot", times["queued"])), end=at(times["end"]),
                children=[(at(a), at(b), None if s is None else round(s, 3)) for a, b, s in children])


def staged(tasks: list[Task]) -> list[list[Task]]:
    """Stages (each runs after the one before ends) in which the first launch of every kernel and of every
    specialization ends before any other launch of it starts (later ones find it compiled and may share a
    stage); the very first launch alone. Greedy, in task order. (Forked compiles need none of it: `_prepare`
    and fork_compile's per-key claim guard the same.)"""
    stages: list[list[Task]] = []
    first: dict[object, int] = {}  # kernel or specialization -> the stage of its first launch
    for i, task in enumerate(tasks):
        names = (*task.kernels, *task.keys)
        stage = 0 if i == 0 else 1 + max((first[k] for k in names if k in first), default=0)
        for k in names:
            first.setdefault(k, stage)
        stages += [[] for _ in range(stage + 1 - len(stages))]
        stages[stage].append(task)
    return stages
