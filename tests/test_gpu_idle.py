"""benchmarks/gpu_idle.py on the CPU (host clocks stand in for CUDA events): the gap arithmetic against hand
values, every step of a real engine seen with async scheduling on (steps launched ahead never pass through
execute()), and host time put between steps on purpose showing up as idle time."""

from __future__ import annotations

import time

import pytest

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint
from tests.benchmark_scripts import load_benchmark

gpu_idle = load_benchmark("gpu_idle")

N, P, M = 3, 6, 10


def test_idle_between_sums_the_gaps_and_ignores_back_to_back_steps():
    span, idle, gaps = gpu_idle.idle_between([(0.0, 1.0), (1.5, 2.0), (2.0, 3.0), (3.25, 4.0)])
    assert span == 4.0 and gaps == [0.5, 0.0, 0.25] and idle == 0.75
    assert gpu_idle.idle_between([(0.0, 1.0), (0.9, 2.0)])[1] == 0.0  # an overlap is no idle time
    assert gpu_idle.idle_between([]) == (0.0, 0.0, [])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("idle") / "m", seed=3, vocab_size=61, hidden_size=32,
                                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16))


def run(ckpt: str, async_scheduling: bool, delay_s: float = 0.0) -> tuple[dict, list]:
    cfg = EngineConfig(model=ckpt, device="cpu", dtype="float32", mode="deferred", deep_interval=1, max_num_seqs=N,
                       max_model_len=P + M, async_scheduling=async_scheduling)
    with SyncEngine(cfg) as engine:
        core = engine.core
        executes = []
        inner_execute = core.executor.execute  # who ran through execute(): a probe hooked there sees these
        core.executor.execute = lambda plan: executes.append(plan) or inner_execute(plan)
        if delay_s:
            inner_update = core.update

            def slow_update(plan, result):  # host work between one step's device work and the next one's
                time.sleep(delay_s)
                return inner_update(plan, result)
            core.update = slow_update
        gaps = gpu_idle.StepGaps(core.executor, cuda=False)
        gaps.install()
        outs = engine.generate_batch([[1 + i + j for j in range(P)] for i in range(N)],
                                     [SamplingParams(max_tokens=M, seed=i, ignore_eos=True) for i in range(N)])
        gaps.remove()
        assert "launch" not in vars(core.executor)  # removed: the class's method again
    assert all(len(o.outputs[0].token_ids) == M for o in outs)
    return gaps.summary(), executes


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_step_is_seen_with_and_without_lookahead(ckpt, async_scheduling):
    summary, executes = run(ckpt, async_scheduling)
    assert summary["steps"] == M  # one prefill step (all prompts), then one step per token
    assert len(executes) == (0 if async_scheduling else M)  # lookahead launches: execute() never sees a step
    assert summary["clock"] == "host" and 0 <= summary["idle_s"] <= summary["span_s"]
    assert 0 <= summary["gpu_idle_share"] < 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_host_time_between_steps_is_idle_time(ckpt, async_scheduling):
    delay = 0.03
    summary, _ = run(ckpt, async_scheduling, delay)
    # every gap between two launches holds an update, except (with lookahead) the one after the first
    # step, launched with the second before anything was read; on the CPU the step's work runs inside
    # launch, so lookahead overlaps nothing here. Updates after the last launch fall outside the span.
    assert summary["idle_s"] >= (M - 2) * delay
    assert summary["gap_ms_p50"] >= 1e3 * delay
