"""Async scheduling on the GPU (bf16, CUDA graphs): the same tokens and log-probs as without it, and
ModelExecutor.launch never waits for the device (torch.cuda.set_sync_debug_mode("error") around it).

With ignore_eos nothing is wasted, so both runs replay the same graphs over the same batches and agree
bitwise; with eos stops a wasted row can change a batch's bucket, so only the tokens are compared there
(greedy ties in bf16 could differ in principle; the check is on plain temperature sampling)."""

from __future__ import annotations

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async_sched"), vocab_size=257, hidden_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                intermediate_size=256, dtype=torch.bfloat16, eos_token_id=3)


def config(ckpt, mode: str, B: int, async_scheduling: bool) -> EngineConfig:
    return EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", mode=mode, deep_interval=B,
                        max_num_seqs=16, max_model_len=160, num_kv_blocks=256, block_size=8,
                        async_scheduling=async_scheduling)


def workload(ignore_eos: bool, plain: bool = False):
    prompts = [[(7 * i + 3 * t) % 250 + 4 for t in range(1 + (5 * i) % 23)] for i in range(12)]
    options = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8)]
    if not plain:
        options += [dict(temperature=0.9, top_k=20), dict(temperature=1.0, logprobs=2), dict(temperature=1.0, n=2),
                    dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.05),
                    dict(temperature=0.8, min_tokens=6)]
    stops = [] if ignore_eos else [5, 7, 11, 13, 17, 19]  # with eos 3: ~7 / 257 per token, so some stop early
    params = [SamplingParams(max_tokens=24 + i % 9, seed=i, ignore_eos=ignore_eos, stop_token_ids=stops,
                             **options[i % len(options)]) for i in range(len(prompts))]
    return prompts, params


def run(ckpt, mode, B, async_scheduling, prompts, params):
    with SyncEngine(config(ckpt, mode, B, async_scheduling)) as llm:
        outs = llm.generate_batch(prompts, params)
        stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert (stats["lookahead_steps"] > 0) == async_scheduling
    return [[(c.token_ids, c.logprobs, c.readout_loops, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("eager", 4)])
def test_async_scheduling_gives_the_same_tokens_and_logprobs(ckpt, mode, B):
    prompts, params = workload(ignore_eos=True)
    assert run(ckpt, mode, B, True, prompts, params) == run(ckpt, mode, B, False, prompts, params)
    prompts, params = workload(ignore_eos=False)
    got, expected = run(ckpt, mode, B, True, prompts, params), run(ckpt, mode, B, False, prompts, params)
    assert [[c[0] for c in o] for o in got] == [[c[0] for c in o] for o in expected]
    assert any(c[3] == "stop" for o in expected for c in o), "no eos stop: the wasted rows went untested"


@pytest.mark.parametrize("plain", [True, False])
def test_launch_never_waits_for_the_device(ckpt, plain):
    """Every launch (prefills, shallow and deep graphs, the sampler: its one-kernel path, and with `plain`
    False the full one (top-k / top-p / min-p, min_tokens, top log-probs), the token buffer, the copies to
    pinned memory) under sync debug mode "error": a synchronizing call in it raises."""
    prompts, params = workload(ignore_eos=False, plain=plain)
    with SyncEngine(config(ckpt, "deferred", 4, True)) as llm:
        executor = llm.core.executor
        launch = type(executor).launch
        launches = []

        def checked(plan):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(executor, plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                launches.append(plan.step_id)

        executor.launch = checked
        outs = llm.generate_batch(prompts, params)
    errors = [c.error for o in outs for c in o.outputs if c.finish_reason not in ("stop", "length")]
    assert launches and not errors, errors[:3]  # a phase that synchronized failed its requests
