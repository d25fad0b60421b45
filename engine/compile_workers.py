"""Compiling the kernel warm-up in worker processes, so the compiles of a cold start run on every core.

Theory of operation. A Triton compile holds the GIL for much of its time (the Python code generator, the
MLIR passes), so the warm-up's threads (engine/kernel_warmup.py) reach only ~3x over eight threads: on the
H200 a cold start's 38 compiles took 25-29 s of thread time and 8.5-10 s of wall time, the longest phase
of a cold start. ``compile_in_workers`` instead splits the task list over worker processes
(``python -m engine.compile_worker``), each compiling its share one task after another into Triton's
on-disk cache; the parent's own threaded pass afterwards finds every kernel there and only loads it. A
worker pays an interpreter, torch's import and a CUDA context first (~2-3 s, beside the weight load), so
this is for a cold cache only: ourobatch/warmup.py skips it when a marker in the cache says this exact
list was compiled before.

``plan_shards`` keeps the launches of one specialization on one worker (their first key: the paged
kernel's specialization for an attention case), so that nothing but a small shared kernel (the split
combine) compiles in two processes; it balances the workers by the specializations each compiles. A
worker that fails, hangs past ``timeout`` or is stopped costs nothing but time: the parent's pass
compiles whatever is missing. Workers are killed, never left running, when the parent stops early.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

POLL_S = 0.05  # how often the parent looks at its workers and at should_stop
TIMEOUT_S = 600.0  # a worker still compiling after this is killed (the parent's pass compiles the rest)
ENV_VAR = "OUROBATCH_COMPILE_WORKERS"  # worker count; 0 compiles in threads only (docs/startup.md)


def default_num_workers() -> int:
    """$OUROBATCH_COMPILE_WORKERS, else the cores less two (the weight load's), at most 16; 0 below 4 cores."""
    value = os.environ.get(ENV_VAR)
    if value is not None and value.strip():
        try:
            workers = int(value)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a whole number of worker processes (0: none), "
                             f"got {value!r}") from None
        if workers < 0:
            raise ValueError(f"{ENV_VAR} must be >= 0 (0: compile in threads only), got {workers}")
        return workers
    cores = os.cpu_count() or 1
    return 0 if cores < 4 else min(16, cores - 2)


def plan_shards(keys: Sequence[Sequence[tuple]], num_workers: int) -> list[list[int]]:
    """Task indices per worker (no empty shard): a task joins the worker that owns its first key, else the
    least loaded one; a worker's load is the number of keys it compiles first."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    owner: dict[tuple, int] = {}
    shards: list[list[int]] = [[] for _ in range(num_workers)]
    load = [0] * num_workers
    for i, task_keys in enumerate(keys):
        first = task_keys[0] if task_keys else None
        w = owner[first] if first in owner else min(range(num_workers), key=lambda j: (load[j], j))
        for k in task_keys:
            if k not in owner:
                owner[k] = w
                load[w] += 1
        shards[w].append(i)
    return [s for s in shards if s]


@dataclass
class WorkersReport:
    """What the workers did: per worker its tasks, seconds and compiles; failures as text."""

    workers: int = 0
    seconds: float = 0.0  # wall time from the first spawn to the last exit
    tasks: int = 0
    compiled: int = 0  # kernels the workers compiled (Triton's listener; 0 where it is missing)
    ready_s: float = 0.0  # the slowest worker's start (spawn to its first task: interpreter, imports)
    longest_task_s: float = 0.0  # the slowest single task (its compiles)
    failures: list[str] = field(default_factory=list)
    stopped: bool = False  # should_stop turned true and the workers were killed


def compile_in_workers(shapes, device: str, names: list[str], keys: Sequence[Sequence[tuple]],
                       num_workers: int, should_stop: Callable[[], bool] | None = None,
                       timeout: float = TIMEOUT_S) -> WorkersReport:
    """Run the task list (`names`, `keys`: engine/kernel_warmup.task_list's, in order) in `num_workers`
    processes and wait for them; returns when every worker exited (or was killed)."""
    report = WorkersReport()
    shards = plan_shards(keys, num_workers)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ourobatch-compile-") as tmp:
        procs = []
        try:
            for w, indices in enumerate(shards):
                job = dict(shapes=shapes, device=device, names=names, indices=indices, spawned_at=time.time())
                procs.append(_spawn(job, Path(tmp) / f"worker{w}"))
            report.workers = len(procs)
            report.stopped = _wait(procs, should_stop, started + timeout, report)
        finally:
            for proc, _ in procs:  # nothing outlives this call
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        for w, (proc, out) in enumerate(procs):
            _read(w, proc.returncode, out, report)
    report.seconds = time.perf_counter() - started
    return report


def _spawn(job: dict, out: Path) -> tuple[subprocess.Popen, Path]:
    """Start one worker on `job` (its stdin), its stdout and stderr into files (a pipe nobody reads could
    fill and stall it). One intra-op thread each: the workers already use every core."""
    import engine

    root = str(Path(engine.__file__).resolve().parent.parent)  # where this process found `engine`
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    with open(out.with_suffix(".out"), "wb") as stdout, open(out.with_suffix(".err"), "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "engine.compile_worker"], stdin=subprocess.PIPE,
                                stdout=stdout, stderr=stderr, env=env)
    try:
        proc.stdin.write(pickle.dumps(job))
        proc.stdin.close()
    except OSError:  # it died at once; its exit code and stderr say why
        pass
    return proc, out


def _wait(procs, should_stop: Callable[[], bool] | None, deadline: float, report: WorkersReport) -> bool:
    """Until every worker exited; kills them all (returns True) when should_stop() turns true, and the ones
    past `deadline`."""
    while any(p.poll() is None for p, _ in procs):
        if should_stop is not None and should_stop():
            for p, _ in procs:
                p.kill()
            return True
        if time.perf_counter() > deadline:
            for w, (p, _) in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    report.failures.append(f"compile worker {w}: still running at the deadline, killed")
            return False
        try:
            next(p for p, _ in procs if p.poll() is None).wait(timeout=POLL_S)
        except (StopIteration, subprocess.TimeoutExpired):
            pass
    return False


def _read(w: int, returncode: int | None, out: Path, report: WorkersReport) -> None:
    """Fold worker `w`'s report line (or its exit code and stderr's last line) into `report`."""
    text = out.with_suffix(".out").read_text(errors="replace").strip()
    try:
        result = json.loads(text.splitlines()[-1]) if text else None
    except json.JSONDecodeError:
        result = None
    if result is None:
        err = out.with_suffix(".err").read_text(errors="replace").strip().splitlines()
        report.failures.append(f"compile worker {w}: exit {returncode}, no report"
                               + (f" ({err[-1][:300]})" if err else ""))
        return
    report.tasks += int(result.get("tasks", 0))
    report.compiled += int(result.get("compiled") or 0)
    report.ready_s = max(report.ready_s, float(result.get("ready_s") or 0.0))
    report.longest_task_s = max([report.longest_task_s, *map(float, result.get("task_seconds") or [])])
    report.failures += [f"compile worker {w}: {f}" for f in result.get("failures", [])]
