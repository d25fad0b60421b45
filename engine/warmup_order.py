"""The order the startup warm-up's launches (engine/kernel_warmup.py) run in: the slowest compiles first where
they compile in forked children, else in stages that never compile one specialization twice at once."""

from __future__ import annotations

from dataclasses import dataclass
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
