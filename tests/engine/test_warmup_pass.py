"""engine/warmup_pass.py on the CPU: in the forked pass the slowest kernels' launches start alone, each until its
child is forked, and every other launch then starts at once without waiting for their compiles; the report's
timeline lists every launch with its children."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import fork_compile, warmup_pass
from engine.warmup_order import KernelReport, Task, head_first
from tests.engine.test_fork_compile import GatedChild, compiled_true

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_head_first_takes_the_slowest_kernels_launches_in_their_order():
    def t(name: str, kernel: str) -> Task:
        return Task(name, lambda: None, frozenset({kernel}), ((kernel, name),))

    tasks = [t("a", "paged"), t("b", "gluon_o"), t("c", "gemm"), t("d", "gluon_layers"), t("e", "gluon_o")]
    head, rest = head_first(tasks)
    assert [x.name for x in head] == ["d", "b", "e"] and [x.name for x in rest] == ["a", "c"]


def test_the_rest_starts_once_the_heads_child_is_forked_not_once_it_compiled():
    gate = GatedChild(block_s=30.0)
    forked_at: list[float] = []
    started: dict[str, float] = {}

    def head() -> None:
        time.sleep(0.2)  # its Python work before the compile
        forked_at.append(time.perf_counter())
        fork_compile.compile_in_child(gate.fn, in_child=compiled_true)

    def other(name: str):
        def launch() -> None:
            started[name] = time.perf_counter()
        return launch

    tasks = [Task(f"t{i}", other(f"t{i}"), frozenset({"gemm"}), (("gemm", i),)) for i in range(5)]
    tasks.insert(2, Task("layers", head, frozenset({"gluon_layers"}), (("gluon_layers", ""),)))
    report = KernelReport()
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            ps = warmup_pass._Pass(torch.device("cpu"), 0.0, threading.Semaphore(4))
            done = threading.Thread(target=warmup_pass._forked, args=(pool, tasks, ps, lambda: False, report))
            done.start()
            os.read(gate.started, 1)  # the head's child is compiling (and stays so until released)
            deadline = time.monotonic() + 10
            while len(started) < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(started) == 5  # all the others ran while the head's compile was still under way
            assert min(started.values()) >= forked_at[0]  # ... and none before the head reached its fork
            gate.release()
            done.join(timeout=30)
    finally:
        gate.close()
    assert not done.is_alive() and report.cases == {"t0": 1, "t1": 1, "t2": 1, "t3": 1, "t4": 1, "layers": 1}
    line = {e["task"]: e for e in report.timeline}
    (fork, reported, seconds), = line["layers"]["children"]
    assert fork <= min(line[f"t{i}"]["queued"] for i in range(5)) and seconds is not None and reported >= fork


def test_a_head_that_never_forks_holds_the_others_back_no_longer_than_it_runs():
    ran: list[str] = []
    tasks = [Task("slow", lambda: time.sleep(0.3) or ran.append("slow"), frozenset({"gluon_o"}), (("o", 1),)),
             Task("other", lambda: ran.append("other"), frozenset({"gemm"}), (("g", 1),))]
    report = KernelReport()
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        warmup_pass._forked(pool, tasks, warmup_pass._Pass(torch.device("cpu"), t, threading.Semaphore(2)),
                            lambda: False, report)
    assert ran == ["slow", "other"] and time.perf_counter() - t < warmup_pass.HEAD_WAIT_S  # its end let them go
