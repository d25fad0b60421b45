"""Issue 11 on the GPU: shared prompt blocks and preemption through the Triton path match unshared runs."""

from __future__ import annotations

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.runtime.engine_core import child_seed
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv") / "m", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=256,
                                eos_token_id=None)


def cfg(ckpt, **kw) -> EngineConfig:
    base = dict(model=str(ckpt), device="cuda", dtype="float32", mode="deferred", deep_interval=4, block_size=16,
                num_kv_blocks=512, max_model_len=512, max_num_seqs=64)
    base.update(kw)
    return EngineConfig(**base)


@pytest.mark.parametrize("prompt_len", [64, 71])  # a multiple of the block size, and not
def test_n_samples_sharing_prompt_blocks_equal_unshared_runs_on_cuda(ckpt, prompt_len):
    prompt = [(7 * i) % 250 + 1 for i in range(prompt_len)]
    params = SamplingParams(n=6, max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    with SyncEngine(cfg(ckpt)) as llm:
        shared = llm.generate(prompt, params).outputs
        stats = llm.stats()
    assert stats["attention_backend"] == "triton" and stats["prefix_cache_hits"] > 0
    with SyncEngine(cfg(ckpt, enable_prefix_caching=False)) as llm:
        for i, c in enumerate(shared):
            ref = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=child_seed(5, i),
                                                      ignore_eos=True)).outputs[0]
            assert c.token_ids == ref.token_ids
            assert max(abs(a - b) for a, b in zip(c.logprobs, ref.logprobs)) < 1e-3


def test_preemption_on_cuda_keeps_greedy_full_depth_outputs(ckpt):
    prompts = [[(3 * i + j) % 250 + 1 for j in range(20 + i)] for i in range(12)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    outs = {}
    for blocks in (512, 24):
        with SyncEngine(cfg(ckpt, deep_interval=1, num_kv_blocks=blocks)) as llm:
            outs[blocks] = [o.outputs[0].token_ids for o in llm.generate_batch(prompts, params)]
            assert (llm.stats()["preemptions"] > 0) == (blocks == 24)
    assert outs[512] == outs[24]
