"""ourobatch.LLM's RL calls between generate calls (ourobatch/llm_control.py): vLLM's sleep / wake_up /
reset_prefix_cache, weight updates, num_cached_tokens and seed=None, on a tiny random checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from ourobatch.llm import LLM, SamplingParams
from ourobatch.testing import make_tiny_checkpoint
from scheduler.errors import EngineAsleepError, InconsistentWeightsError
from scheduler.params import MAX_SEED

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5, 6]]
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=11, logprobs=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llm_rl")
    return (make_tiny_checkpoint(root / "a", seed=0, eos_token_id=None),
            make_tiny_checkpoint(root / "b", seed=1, eos_token_id=None))


def _tokens(llm: LLM, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.token_logprobs) for o in llm.generate(prompts, PARAMS, use_tqdm=False)
            for c in o.outputs]


def test_sleep_refuses_generate_and_wake_up_restores_the_same_outputs(ckpts):
    a, _ = ckpts
    with LLM(str(a), num_kv_blocks=64, block_size=4) as llm:
        before = _tokens(llm)
        for level in (1, 2):
            llm.sleep(level)
            assert llm.is_sleeping
            with pytest.raises(EngineAsleepError):  # never a loop that steps forever
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            llm.wake_up(tags=["weights"])  # vLLM's tags: any wakes both
            assert not llm.is_sleeping
            if level == 2:  # the weights were dropped: nothing runs until they are loaded again
                with pytest.raises(InconsistentWeightsError):
                    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
                assert llm.load_weights(a) == 1
            assert _tokens(llm) == before
        with pytest.raises(ValueError, match=r"tags must be None or a list of \['weights', 'kv_cache'\]"):
            llm.wake_up(tags="weights")


def test_weight_updates_serve_the_new_checkpoints_policy(ckpts):
    a, b = ckpts
    with LLM(str(b), num_kv_blocks=64, block_size=4) as fresh:
        want = _tokens(fresh)
    with LLM(str(a), num_kv_blocks=64, block_size=4) as llm:
        old = _tokens(llm)
        assert old != want  # the two checkpoints differ where it shows
        version = llm.update_weights(load_file(str(b / "model.safetensors")).items(), version=7)
        assert version == 7
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [(c.token_ids, c.token_logprobs) for o in outs for c in o.outputs] == want
        assert {c.weight_version for o in outs for c in o.outputs} == {7}
        assert llm.load_weights(a) == 8
        assert _tokens(llm) == old


def test_num_cached_tokens_counts_the_prompt_blocks_the_prefix_cache_served(ckpts):
    a, _ = ckpts
    prompt = list(range(1, 11))  # 10 tokens: two whole blocks of 4 can be shared
    with LLM(str(a), num_kv_blocks=64, block_size=4) as llm:
        hits = llm.stats()["prefix_cache_hits"]
        first = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        second = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
        assert second.num_cached_tokens == 8 == llm.stats()["prefix_cache_hits"] - hits
        assert llm.reset_prefix_cache() is True
        assert llm.generate([prompt], PARAMS, use_tqdm=False)[0].num_cached_tokens == 0


def test_seed_none_draws_an_engine_seed_as_vllm_does(ckpts):
    a, _ = ckpts
    with LLM(str(a), seed=None, num_kv_blocks=16) as llm:
        assert isinstance(llm.config.seed, int) and 0 <= llm.config.seed <= MAX_SEED
