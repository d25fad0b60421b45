"""engine/fork_compile.py on the CPU: a forked child runs the compile first (for what it leaves on disk),
the parent runs it again; a child that fails or hangs costs only the parent's own run; children forked
from several threads at once all report; the compile counter counts a kernel a child compiled as compiled.
The Triton side (AsyncCompileMode routing real compiles through it) runs in tests/gpu/test_gpu_warmup.py."""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

import pytest

from engine import fork_compile
from ourobatch.compile_cache import CompileCounter

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def recorder(path: Path):
    """fn: appends this process's pid to `path` and returns it."""
    def fn() -> int:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return os.getpid()
    return fn


def compiled_true(fn) -> bool:
    fn()
    return True


def pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()]


class GatedChild:
    """fn for compile_in_child whose child says it started (`started`: readable then) and blocks until
    `release()`; in the parent it returns at once. `close()` closes the pipes."""

    def __init__(self, block_s: float) -> None:
        self.parent = os.getpid()
        self.go_r, self.go_w = os.pipe()
        self.started, self.started_w = os.pipe()
        self.block_s = block_s

    def fn(self) -> int:
        if os.getpid() != self.parent:
            os.write(self.started_w, b"1")
            select.select([self.go_r], [], [], self.block_s)
        return os.getpid()

    def release(self) -> None:
        os.write(self.go_w, b"go")

    def close(self) -> None:
        for fd in (self.go_r, self.go_w, self.started, self.started_w):
            os.close(fd)


def test_the_child_runs_it_first_then_the_parent(tmp_path):
    before = fork_compile.STATS.children
    out = fork_compile.compile_in_child(recorder(tmp_path / "log"), in_child=compiled_true)
    first, second = pids(tmp_path / "log")
    assert out == second == os.getpid() and first != os.getpid()
    assert fork_compile.STATS.children == before + 1
    assert fork_compile.child_result() is None  # only while the parent's run is under way


def test_a_failing_child_costs_only_the_parents_run(tmp_path):
    parent = os.getpid()

    def fn() -> str:
        if os.getpid() != parent:
            raise RuntimeError("compile failed in the child")
        return "compiled here"

    failed = fork_compile.STATS.failed
    assert fork_compile.compile_in_child(fn, in_child=compiled_true) == "compiled here"
    assert fork_compile.STATS.failed == failed + 1


def test_recording_lists_each_child_with_its_times(tmp_path):
    parent = os.getpid()

    def fails_in_the_child() -> int:
        if os.getpid() != parent:
            raise RuntimeError("compile failed in the child")
        return parent

    t0 = time.perf_counter()
    with fork_compile.recording() as children:
        fork_compile.compile_in_child(recorder(tmp_path / "log"), in_child=compiled_true)
        fork_compile.compile_in_child(fails_in_the_child, in_child=compiled_true)
    fork_compile.compile_in_child(recorder(tmp_path / "log2"), in_child=compiled_true)  # after the block: not listed
    assert len(children) == 2
    (f1, r1, s1), (f2, r2, s2) = children
    assert t0 <= f1 <= r1 <= f2 <= r2 <= time.perf_counter()
    assert s1 is not None and 0 <= s1 <= r1 - f1 and s2 is None  # a failed child reports no compile seconds


def test_a_hung_child_is_killed_after_the_timeout(tmp_path):
    parent = os.getpid()
    log = recorder(tmp_path / "log")

    def fn() -> int:
        if os.getpid() != parent:
            select.select([], [], [])  # blocks forever
        return log()

    failed = fork_compile.STATS.failed
    assert fork_compile.compile_in_child(fn, in_child=compiled_true, timeout=0.5) == parent
    assert pids(tmp_path / "log") == [parent] and fork_compile.STATS.failed == failed + 1


def test_children_forked_from_several_threads_all_report(tmp_path):
    results: dict[int, int] = {}

    def run(i: int) -> None:
        results[i] = fork_compile.compile_in_child(recorder(tmp_path / f"log{i}"), in_child=compiled_true)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {i: os.getpid() for i in range(6)}
    for i in range(6):
        child, parent = pids(tmp_path / f"log{i}")
        assert parent == os.getpid() and child != parent


@pytest.mark.parametrize("child_compiled", [True, False])
def test_the_counter_counts_what_a_child_compiled_as_compiled(child_compiled):
    counter = CompileCounter()

    class Times:
        total = 1_000  # us: the parent's load

    def fn() -> None:  # Triton's listener call for this kernel, in the child's copy and then here
        counter(src=None, times=Times(), cache_hit=os.getpid() == parent)

    parent = os.getpid()
    fork_compile.compile_in_child(fn, in_child=lambda f: (f(), child_compiled)[1])
    counts = counter.snapshot()
    assert (counts.compiled, counts.loaded) == ((1, 0) if child_compiled else (0, 1))
    assert counts.seconds >= 0.001  # the parent's load (plus the child's compile time when it compiled)


def test_off_by_env_or_flag(monkeypatch):
    with fork_compile.compiles_in_children(False) as on:
        assert on is False
    monkeypatch.setenv(fork_compile.ENV, "0")
    assert not fork_compile.enabled()
    with fork_compile.compiles_in_children(True) as on:
        assert on is False
    monkeypatch.setenv(fork_compile.ENV, "1")
    assert fork_compile.enabled()
    try:
        import triton
        has_mode = hasattr(triton, "AsyncCompileMode")
    except ImportError:
        has_mode = False
    with fork_compile.compiles_in_children(True) as on:
        assert on is has_mode
    assert fork_compile.available() is has_mode
    monkeypatch.setenv(fork_compile.ENV, "off")
    assert not fork_compile.available()


def test_one_thread_per_key_at_a_time():
    """fork_compile.one_at_a_time: threads with one key never overlap in the block; another key runs beside."""
    events: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def run(i: int) -> None:
        barrier.wait(timeout=30)
        with fork_compile.one_at_a_time("same key"):
            with lock:
                events.append("in")
            with fork_compile.one_at_a_time("another key"):  # not blocked by the key held
                pass
            with lock:
                events.append("out")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert events == ["in", "out"] * 8
    assert not fork_compile._IN_FLIGHT


def test_a_parent_slot_is_let_go_while_the_child_compiles(tmp_path):
    """Two threads, one slot: while one waits on its child the other runs in the slot (it would wait
    for the first thread's whole compile otherwise); the child's run blocks until the second thread has
    been inside its slot."""
    slots = threading.Semaphore(1)
    inside = threading.Event()
    child = GatedChild(block_s=30)  # once it has started, the first thread holds a slot no more

    def first() -> None:
        with fork_compile.parent_slot(slots):
            fork_compile.compile_in_child(child.fn, in_child=compiled_true, timeout=60)

    def second() -> None:
        with fork_compile.parent_slot(slots):
            inside.set()

    t1 = threading.Thread(target=first)
    t1.start()
    assert select.select([child.started], [], [], 30)[0]
    t2 = threading.Thread(target=second)
    t2.start()
    assert inside.wait(timeout=30)  # got the slot while the first thread's child still runs
    child.release()
    t1.join(timeout=60)
    t2.join(timeout=60)
    child.close()
    assert not t1.is_alive() and not t2.is_alive()


def test_a_thread_waiting_for_a_kernel_lets_its_slot_go(monkeypatch):
    """One slot, one kernel: B compiles it (its child blocked), A holds the slot and waits for the kernel;
    when B's child ends, B needs the slot back to finish. A must have let it go while it waits (else both
    wait until the 120 s timeout)."""
    monkeypatch.setattr(fork_compile, "CHILD_TIMEOUT_S", 600.0)
    slots = threading.Semaphore(1)
    child = GatedChild(block_s=60)
    a_in_slot, done = threading.Event(), []

    def b() -> None:
        with fork_compile.parent_slot(slots), fork_compile.one_at_a_time("K"):
            fork_compile.compile_in_child(child.fn, in_child=compiled_true, timeout=60)
        done.append("b")

    def a() -> None:
        with fork_compile.parent_slot(slots):
            a_in_slot.set()
            with fork_compile.one_at_a_time("K"):
                done.append("a")

    tb = threading.Thread(target=b, daemon=True)
    tb.start()
    assert select.select([child.started], [], [], 30)[0]  # B owns K and waits on its child, slot let go
    ta = threading.Thread(target=a, daemon=True)
    ta.start()
    assert a_in_slot.wait(timeout=30)
    child.release()
    tb.join(timeout=30)
    ta.join(timeout=30)
    child.close()
    assert sorted(done) == ["a", "b"]


def test_no_fork_to_be_had_compiles_here(monkeypatch, tmp_path):
    """os.fork failing (memory, process limits): fn() runs here, counted as failed, nothing left open."""
    def refuse():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(fork_compile.os, "fork", refuse)
    failed, fds = fork_compile.STATS.failed, len(os.listdir("/proc/self/fd"))
    assert fork_compile.compile_in_child(recorder(tmp_path / "log"), in_child=compiled_true) == os.getpid()
    assert pids(tmp_path / "log") == [os.getpid()]
    assert fork_compile.STATS.failed == failed + 1 and len(os.listdir("/proc/self/fd")) == fds
