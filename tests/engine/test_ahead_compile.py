"""engine/ahead_compile.py: the loop-pass kernel's compile forked ahead of the startup's compile pass.

Without Triton (CI): the parent's side with children that report, fail or hang: the pass's launch of that kernel
waits for the child and counts its compile, others do not wait, a failed or stuck child costs only the wait, a
child nobody waited for is killed and reaped, and run_pass puts the child in its timeline and report. Where
Triton is installed: the real child compiles gluon_layers.warm_compile for sm90 with no GPU, and a second child
finds it on disk with the stored key; a process that then compiles the same launch through the JIT path (as the
pass does, its driver naming sm90) loads it from the cache, and warm_compile hands the kernel what warm_launch
launches it with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import ahead_compile, fork_compile, warmup_pass
from engine.ahead_compile import AheadCompile
from engine.warmup_order import Task

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def child_reporting(text: str, delay: float = 0.0, fail: bool = False) -> AheadCompile:
    def report() -> str:
        time.sleep(delay)
        if fail:
            raise RuntimeError("the compile broke")
        return text

    forked_at = time.perf_counter()
    return AheadCompile(fork_compile.fork_report(report), forked_at)


def reaped(ahead: AheadCompile) -> bool:
    try:
        os.waitpid(ahead._child[0], os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_kernels_launch_waits_for_the_child_and_counts_its_compile():
    ahead = child_reporting("1 2.5 hashed 1", delay=0.3)
    seen = []
    layers = ahead.wrap(Task("gemm", lambda: seen.append((time.perf_counter(), fork_compile.child_result())),
                             frozenset({"gluon_layers"}), (("gluon_layers", ""),)))
    other = Task("gemm", lambda: None, frozenset({"qkv"}), (("qkv",),))
    assert ahead.wrap(other) is other
    layers.launch()
    r = ahead.join()
    assert (r.ok, r.compiled, r.seconds, r.key, r.launcher) == (True, True, 2.5, "hashed", True)
    assert seen[0][0] >= r.reported_at and r.waited >= 0.2  # launched once the child had reported
    assert seen[0][1] == (True, 2.5) and fork_compile.child_result() is None  # counted inside the launch only
    assert reaped(ahead)


def test_the_wait_tells_the_pass_its_child_is_forked_and_lets_the_parent_slot_go(tmp_path):
    # the pass's head launches run alone until their child is forked, and a launch waiting on a child holds no
    # parent slot: the child here reports only once another thread has taken the only slot
    go = tmp_path / "go"

    def report() -> str:
        while not go.exists():
            time.sleep(0.01)
        return "1 1.0 hashed 1"

    ahead = AheadCompile(fork_compile.fork_report(report), time.perf_counter())
    order, forked, slots = [], threading.Event(), threading.Semaphore(1)
    layers = ahead.wrap(Task("gemm", lambda: order.append("launch"), frozenset({"gluon_layers"}), ()))

    def pass_thread() -> None:
        with fork_compile.recording(lambda: order.append("forked") or forked.set()), fork_compile.parent_slot(slots):
            layers.launch()

    t = threading.Thread(target=pass_thread)
    t.start()
    assert forked.wait(10)
    took = slots.acquire(timeout=5)  # taken while the launch waits for the child
    order.append("slot" if took else "no slot")
    go.touch()
    if took:
        slots.release()
    t.join(10)
    assert order == ["forked", "slot", "launch"] and ahead.join().ok


@pytest.mark.parametrize("case", ["raises", "says nothing useful", "hangs"])
def test_a_child_that_fails_costs_only_the_wait(case):
    ahead = {"raises": lambda: child_reporting("", fail=True), "says nothing useful": lambda: child_reporting("x"),
             "hangs": lambda: child_reporting("1 1.0 hashed 1", delay=60)}[case]()
    t = time.perf_counter()
    r = ahead.join(timeout=0.5)
    assert not r.ok and not r.compiled and time.perf_counter() - t < 5
    seen = []
    ahead.wrap(Task("gemm", lambda: seen.append(fork_compile.child_result()), frozenset({"gluon_layers"}),
                    ())).launch()
    assert seen == [None]  # the launch compiles (and counts) as it would without the child
    assert reaped(ahead)


def test_a_child_nobody_waited_for_is_killed_and_reaped_at_close():
    ahead = child_reporting("1 1.0 hashed 1", delay=60)
    t = time.perf_counter()
    ahead.close()
    assert time.perf_counter() - t < 5 and reaped(ahead) and not ahead.join().ok


def test_the_pass_puts_the_child_in_its_timeline_and_report():
    order = []
    setup = warmup_pass.PassSetup(torch.device("cpu"))
    setup.ahead = child_reporting("1 3.25 stored 0", delay=0.2)
    tasks = [Task("gemm", lambda: order.append("layers"), frozenset({"gluon_layers"}), (("gluon_layers", ""),)),
             Task("fused", lambda: order.append("other"), frozenset({"add_norm"}), (("add_norm",),))]
    with setup:
        report = warmup_pass.run_pass(lambda: tasks, torch.device("cpu"), threads=2, setup=setup)
    assert sorted(order) == ["layers", "other"] and not report.failures
    a = report.ahead
    assert a["ok"] and a["compiled"] and a["seconds"] == 3.25 and a["key"] == "stored" and not a["launcher"]
    line = [e for e in report.timeline if e["task"] == "ahead"]
    assert len(line) == 1 and line[0]["queued"] < 0 < line[0]["end"]  # forked before the pass, reported in it
    assert line[0]["children"] == [(line[0]["queued"], line[0]["end"], 3.25)]


def test_the_switch(monkeypatch):
    default = ahead_compile.DEFAULT == "1"
    for value, on in (("", default), ("1", True), ("on", True), ("0", False), ("off", False)):
        monkeypatch.setenv(ahead_compile.ENV, value)
        assert ahead_compile.enabled() is (on and fork_compile.enabled())
    monkeypatch.delenv(ahead_compile.ENV)
    assert ahead_compile.enabled() is (default and fork_compile.enabled())
    monkeypatch.setenv(ahead_compile.ENV, "maybe")
    with pytest.raises(ValueError, match="OUROBATCH_AHEAD_COMPILE must be 1"):
        ahead_compile.enabled()
    monkeypatch.setenv(ahead_compile.ENV, "1")
    assert AheadCompile.start(None, torch.device("cpu")) is None  # CUDA devices only


SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_heads=8, num_kv_heads=8, head_dim=128, block_size=16,
             table_width=48, eps=1e-6)
LAUNCH_KWARGS = {"USE_PDL": True, "launch_pdl": True}

JIT_CHILD = """
import json, sys, types
import torch, triton
from triton.backends.compiler import GPUTarget
from engine import gluon_layers
from engine.ahead_compile import _Target

triton.runtime.driver.set_active(_Target(GPUTarget("cuda", 90, 32), None))
hits = []
triton.knobs.compilation.listener = lambda **kw: hits.append(bool(kw.get("cache_hit")))
s = types.SimpleNamespace(dtype=torch.bfloat16, **json.loads(sys.argv[1]))
gluon_layers.warm_compile(s, 1, 2, 132, json.loads(sys.argv[2]))
print(json.dumps(hits))
"""


def test_the_real_child_compiles_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    pytest.importorskip("triton.experimental.gluon")
    from types import SimpleNamespace

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    s = SimpleNamespace(dtype=torch.bfloat16, **SHAPE)
    first = AheadCompile.fork(s, 1, 2, 90, 132, LAUNCH_KWARGS).join()
    assert first.ok and first.compiled and first.key == "hashed", first
    second = AheadCompile.fork(s, 1, 2, 90, 132, LAUNCH_KWARGS).join()
    assert second.ok and not second.compiled and second.key == "stored", second
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", JIT_CHILD, json.dumps(SHAPE), json.dumps(LAUNCH_KWARGS)],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [True]  # the JIT path's compile: a cache hit
    other = subprocess.run([sys.executable, "-c", JIT_CHILD, json.dumps({**SHAPE, "table_width": 49}),
                            json.dumps(LAUNCH_KWARGS)], capture_output=True, text=True, timeout=300, cwd=root,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])})
    assert other.returncode == 0 and json.loads(other.stdout.strip().splitlines()[-1]) == [False]  # can fail


def test_the_compile_ahead_passes_the_warm_launchs_arguments(monkeypatch):
    # what makes the child's kernel the pass's: warm_compile hands layers_kernel what warm_launch launches it with
    # (tensors by dtype and shape, descriptors by box, layout and shape, numbers by value, the same constexprs)
    pytest.importorskip("triton.experimental.gluon")
    from types import SimpleNamespace

    from engine import gluon_layers, pdl

    calls = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.__setitem__("launch", (grid, args, kw))

        def warmup(self, *args, grid, **kw):
            calls["compile"] = ((grid[0],), args, kw)

    def described(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dtype, tuple(x.shape), x.data_ptr() % 16 == 0)
        if hasattr(x, "block_shape"):
            return ("descriptor", tuple(x.block_shape), repr(x.layout), tuple(x.shape))
        return x

    monkeypatch.setattr(gluon_layers, "layers_kernel", Recorder())
    s = SimpleNamespace(dtype=torch.bfloat16, **SHAPE)
    cpu = torch.device("cpu")
    gluon_layers.warm_launch(s, 3, 2, cpu)
    gluon_layers.warm_compile(s, 3, 2, pdl.num_sms(cpu), pdl.launch_kwargs(cpu))
    (g1, a1, k1), (g2, a2, k2) = calls["launch"], calls["compile"]
    assert g1 == g2 and k1 == k2 and len(a1) == len(a2) == 36
    assert [described(x) for x in a1] == [described(x) for x in a2]


def test_the_benchmark_compiles_then_finds_it_on_disk(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "ahead_compile.py"), "--out", str(tmp_path),
                          "--children", "2", "--hidden", "1024", "--inter", "2816", "--heads", "8", "--layers", "3"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "ahead_compile.json").read_text())["rows"]
    assert [(r["compiled"], r["key"]) for r in rows] == [(True, "hashed"), (False, "stored")]
    assert rows[0]["child_s"] > rows[1]["child_s"] > 0
    assert "| 2 | False | stored |" in (tmp_path / "ahead_compile.md").read_text()
