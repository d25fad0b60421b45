"""engine/warmup_pass.PassSetup: Triton's driver and key started before the compile pass (the engine's startup
starts them beside its checks). A pass given one takes its driver, forking answer and key instead of starting its
own; on a machine without a GPU (or without Triton) one forks nothing, and its exit joins its threads; the
startup's machine check runs before any of it starts. The GPU side (the key hashed, then stored, in the
startup's second process): tests/gpu/test_gpu_warmup.py."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import warmup_pass
from engine.warmup_order import Task
from ourobatch import EngineConfig, assembly
from ourobatch.testing import make_tiny_checkpoint


class FakeSetup:
    """PassSetup's interface, recording what the pass asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def forking(self, report) -> bool:
        self.asked.append("forking")
        report.driver_seconds = 0.25
        return False  # the launches run in this process (a CPU pass)

    def key_into(self, report) -> None:
        self.asked.append("key")
        report.key_seconds, report.key_source = 0.5, "given"


def test_a_pass_given_a_setup_takes_its_answers_and_starts_none_of_its_own(monkeypatch):
    ran, started = [], []
    init = warmup_pass.PassSetup.__init__
    monkeypatch.setattr(warmup_pass.PassSetup, "__init__", lambda self, device: started.append(device)
                        or init(self, device))
    tasks = [Task("gemm", lambda i=i: ran.append(i), frozenset({"x"}), ((i,),)) for i in range(3)]
    setup = FakeSetup()
    report = warmup_pass.run_pass(lambda: tasks, torch.device("cpu"), 2, setup=setup)
    assert sorted(ran) == [0, 1, 2] and setup.asked == ["forking", "key"] and started == []
    assert (report.driver_seconds, report.key_seconds, report.key_source) == (0.25, 0.5, "given")
    warmup_pass.run_pass(lambda: tasks, torch.device("cpu"), 2)  # without one: its own
    assert started == [torch.device("cpu")]


def test_a_setup_without_a_gpu_forks_nothing_and_its_exit_joins_its_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # where Triton is installed, its key goes here
    before = set(threading.enumerate())
    report = warmup_pass.KernelReport()
    with warmup_pass.PassSetup(torch.device("cuda")) as setup:
        assert setup.driver is not None and setup.key is not None  # started (fork is on)
        assert setup.forking(report) is False  # no CUDA device here: the driver is not ready
        setup.key_into(report)
    assert report.key_source in ("", "hashed", "stored", "memory")  # "": no Triton here
    assert set(threading.enumerate()) <= before
    with warmup_pass.PassSetup(torch.device("cpu")) as setup:  # a CPU engine starts nothing
        assert setup.driver is None and setup.key is None and setup.forking(report) is False


def test_the_startup_checks_the_machine_before_it_starts_the_setup(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(assembly, "PassSetup", lambda device: started.append(device))
    ckpt = make_tiny_checkpoint(tmp_path / "m")
    with pytest.raises(ValueError, match="device='cuda:7'"):
        assembly.build_engine_core(EngineConfig(model=str(ckpt), device="cuda:7"))
    assert started == []
