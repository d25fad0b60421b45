"""The kernel warm-up in worker processes (engine/compile_workers.py, engine/compile_worker.py) and the
warm-cache marker that decides whether a startup spawns them (ourobatch/compile_cache.py, warmup.py).

The workers here are real processes (``python -m engine.compile_worker``) on the CPU: what they report is
compared with the same tasks run in this process (kernel_warmup._run). Where Triton is missing the GPU
kernels' launches fail and the sampler's CPU path succeeds, in both. Compiling on the GPU and loading the
workers' kernels from the cache: tests/gpu/test_gpu_warmup.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from engine import compile_workers, kernel_cases, kernel_warmup
from ourobatch import compile_cache
from ourobatch.warmup import StartupClock, prefetch_kernels

CPU = torch.device("cpu")


def tiny_shapes(**kw) -> kernel_cases.KernelShapes:
    base = kernel_cases.KernelShapes(4, 2, 32, 64, 128, 67, 1e-6, torch.float32, torch.float32, 8, 8, 4, 24, 64,
                                     "deferred", 2, 132, (1, 2, 4), True, (16, 24))
    return kernel_cases.KernelShapes(**{**base.__dict__, **kw})


def run_in_workers(s, num_workers, **kw) -> compile_workers.WorkersReport:
    tasks = kernel_warmup.task_list(s, CPU)
    return compile_workers.compile_in_workers(s, "cpu", [t.name for t in tasks], [t.keys for t in tasks],
                                              num_workers, **kw)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 8), min_size=1, max_size=3, unique=True), min_size=1, max_size=20),
       st.integers(1, 6))
def test_shards_cover_every_task_once_and_keep_a_specialization_on_one_worker(keys, workers):
    tasks = [tuple(("k", k) for k in ks) for ks in keys]
    shards = compile_workers.plan_shards(tasks, workers)
    flat = sorted(i for shard in shards for i in shard)
    assert flat == list(range(len(tasks))) and 1 <= len(shards) <= workers and all(shards)
    assert all(shard == sorted(shard) for shard in shards)  # each worker keeps the list's order
    where = {i: w for w, shard in enumerate(shards) for i in shard}
    owner = {}  # key -> the worker of the first task that lists it
    leaders = 0
    for i, ks in enumerate(tasks):
        if ks[0] in owner:  # a task whose specialization another task compiles goes where that one went
            assert where[i] == owner[ks[0]]
        else:
            leaders += 1
        for k in ks:
            owner.setdefault(k, where[i])
    assert len(shards) == min(workers, leaders)  # every worker busy where there is work for it


def test_plan_shards_refuses_no_workers():
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        compile_workers.plan_shards([(("a",),)], 0)


def test_workers_report_what_the_same_launches_report_in_this_process():
    s = tiny_shapes()
    tasks = kernel_warmup.task_list(s, CPU)
    here = [kernel_warmup._run(t.name, t.launch, CPU)[2] for t in tasks]
    report = run_in_workers(s, 3)
    assert report.workers == 3 and report.tasks == len(tasks) and not report.stopped
    expected = sorted(e for e in here if e is not None)
    got = sorted(f.split(": ", 1)[1] for f in report.failures)
    assert got == expected  # same failures (no Triton: the GPU kernels') and the same successes
    assert report.seconds > 0


def test_a_worker_that_lists_other_tasks_refuses_the_job():
    s = tiny_shapes()
    tasks = kernel_warmup.task_list(s, CPU)
    names = [t.name for t in tasks][::-1]
    report = compile_workers.compile_in_workers(s, "cpu", names, [t.keys for t in tasks], 1)
    assert report.tasks == 0 and len(report.failures) == 1 and "task list differs" in report.failures[0]


def test_a_worker_that_dies_is_reported_and_nothing_is_left_running(monkeypatch):
    monkeypatch.setattr(compile_workers.sys, "executable", "/bin/false")
    report = run_in_workers(tiny_shapes(), 2)
    assert report.workers == 2 and report.tasks == 0
    assert len(report.failures) == 2 and all("exit 1, no report" in f for f in report.failures)


def test_stop_kills_the_workers_and_waits_for_them(monkeypatch):
    spawned = []
    real = compile_workers._spawn
    monkeypatch.setattr(compile_workers, "_spawn", lambda job, out: spawned.append(real(job, out)) or spawned[-1])
    report = run_in_workers(tiny_shapes(), 2, should_stop=lambda: bool(spawned))  # stop at the first look
    assert report.stopped and len(spawned) == 2
    assert all(proc.returncode is not None for proc, _ in spawned)  # reaped: no process outlives the call
    assert all(proc.returncode != 0 for proc, _ in spawned)  # killed before they could finish


@pytest.mark.parametrize("value, workers", [("0", 0), ("3", 3), (" 5 ", 5)])
def test_the_worker_count_comes_from_the_environment(monkeypatch, value, workers):
    monkeypatch.setenv(compile_workers.ENV_VAR, value)
    assert compile_workers.default_num_workers() == workers


@pytest.mark.parametrize("value, match", [("two", "whole number"), ("-1", ">= 0")])
def test_a_bad_worker_count_names_the_variable(monkeypatch, value, match):
    monkeypatch.setenv(compile_workers.ENV_VAR, value)
    with pytest.raises(ValueError, match=f"OUROBATCH_COMPILE_WORKERS.*{match}"):
        compile_workers.default_num_workers()


def test_by_default_the_workers_leave_two_cores_and_need_four(monkeypatch):
    monkeypatch.delenv(compile_workers.ENV_VAR, raising=False)
    for cores, workers in ((2, 0), (3, 0), (4, 2), (16, 14), (64, 16)):
        monkeypatch.setattr(compile_workers.os, "cpu_count", lambda c=cores: c)
        assert compile_workers.default_num_workers() == workers


def test_the_marker_names_the_list_and_the_code(tmp_path):
    a = compile_cache.warm_marker(str(tmp_path), tiny_shapes(), "cpu")
    assert a == compile_cache.warm_marker(str(tmp_path), tiny_shapes(), "cpu") and a.parent.parent == tmp_path
    assert a != compile_cache.warm_marker(str(tmp_path), tiny_shapes(max_num_seqs=8), "cpu")
    assert not a.exists()
    compile_cache.mark_warm(a)
    assert a.exists()


def test_a_cold_cache_compiles_in_workers_and_a_marked_one_does_not(monkeypatch, tmp_path):
    """prefetch_kernels: no marker -> workers, then the pass here; a pass without failures writes the
    marker, and the next startup spawns no worker. A pass with failures writes none."""
    monkeypatch.setenv(compile_workers.ENV_VAR, "2")
    ok = tiny_shapes(triton_attention=False, buckets=None, prefill_buckets=(), max_num_batched_tokens=200)
    assert [t.name for t in kernel_warmup.task_list(ok, CPU)] == ["sampler"] * 2  # runs on the CPU without Triton

    def start(s) -> list[str]:
        with capture_logs() as logs, prefetch_kernels(lambda: s, "cpu", StartupClock(), triton_dir=str(tmp_path)):
            pass
        return [e["event"] for e in logs]

    assert "warmup_kernels_workers" in start(ok)
    assert compile_cache.warm_marker(str(tmp_path), ok, "cpu").exists()
    assert "warmup_kernels_workers" not in start(ok)
    failing = tiny_shapes()  # the GPU kernels' launches fail on CPU tensors (no Triton, or no interpreter)
    assert "warmup_kernels_workers" in start(failing)
    assert not compile_cache.warm_marker(str(tmp_path), failing, "cpu").exists()
    monkeypatch.setenv(compile_workers.ENV_VAR, "0")  # 0: threads only, even on a cold cache
    assert "warmup_kernels_workers" not in start(tiny_shapes(max_num_seqs=3))

