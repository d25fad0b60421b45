"""The calls the executor captures CUDA graphs for at startup (graph_calls, engine/graph_calls.py) are the
calls the scheduler's plans make it run: a real engine on CPU in every mode, each shallow and uniform deep
call recorded where the executor would replay a graph (_run_shallow / _run_deep)."""

from __future__ import annotations

import random

import pytest

from ourobatch.assembly import build_engine_core
from ourobatch import EngineConfig, SamplingParams
from engine.graph_calls import DeepCall, ShallowCall

from .test_generation_vs_oracle import run_staggered


@pytest.mark.parametrize("mode,B,s", [("deferred", 1, 2), ("deferred", 3, 1), ("deferred", 4, 3), ("eager", 1, 1),
                                      ("eager", 4, 2), ("verify", 3, 1), ("verify", 2, 3)])
def test_startup_calls_are_the_calls_the_plans_make(checkpoints, mode, B, s):
    core = build_engine_core(EngineConfig(model=str(checkpoints["kv1-L2-T4"]), dtype="float32", block_size=4,
                                          num_kv_blocks=256, mode=mode, deep_interval=B, shallow_loops=s))
    ex, seen = core.executor, set()
    run_shallow, run_deep = ex._run_shallow, ex._run_deep

    def shallow(token_ids, rows, positions, retain_slots, last_loop, works):
        seen.add(ShallowCall(last_loop, retain_slots is not None))
        return run_shallow(token_ids, rows, positions, retain_slots, last_loop, works)

    def deep(rows, starts, R, first_loop, works):
        seen.add(DeepCall(first_loop, R))
        return run_deep(rows, starts, R, first_loop, works)

    ex._run_shallow, ex._run_deep = shallow, deep
    rng = random.Random(B * 10 + s)
    prompts = [[rng.randrange(31) for _ in range(rng.randint(1, 7))] for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randint(5, 14), temperature=0.0, ignore_eos=True) for _ in prompts]
    run_staggered(core, prompts, params, [0, 0, 1, 3, 4, 9])
    core.close()
    calls = ex.graph_calls(mode, B, s)
    assert seen == set(calls) and len(calls) == len(seen)  # every call the plans made is captured, each used


def test_calls_keep_the_names_the_startup_log_gives_them():
    assert [str(ShallowCall(2, True)), str(DeepCall(3, 4))] == ["shallow:2:True", "deep:3:4"]
