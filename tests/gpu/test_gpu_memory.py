"""Issue 10.3 on the GPU: engines opened and closed in one process give their memory back."""

from __future__ import annotations

import gc

import anyio
import pytest
import torch

from ourobatch import Engine, EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MiB = 2**20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # big enough that a leak is visible: ~300 MB of bf16 weights, and the pool takes the rest of the GPU
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mem") / "m", hidden_size=1024, intermediate_size=2816,
                                num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                                vocab_size=8192, max_position_embeddings=8192, dtype=torch.bfloat16)


def _config(ckpt) -> EngineConfig:
    return EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", mode="deferred", deep_interval=4,
                        max_num_seqs=256, max_model_len=8192, gpu_memory_utilization=0.9)


def test_three_async_engines_in_one_process_return_their_memory(ckpt):
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1)
    outs = []

    async def one_engine():
        async with Engine(_config(ckpt)) as engine:  # each sizes its KV pool from what the GPU has free
            assert engine.stats()["kv_pool_bytes"] > 10 * 2**30
            res = await engine.generate_batch([[1, 2, 3]] * 8, params)
            outs.append([o.outputs[0].token_ids for o in res])

    for _ in range(3):
        anyio.run(one_engine)
        gc.collect()
        after = torch.cuda.memory_allocated()
        assert after - before <= 256 * MiB, f"{(after - before) / MiB:.0f} MiB still allocated after close"
    assert outs[0] == outs[1] == outs[2]


def test_sync_engines_in_one_process_return_their_memory(ckpt):
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        llm = SyncEngine(_config(ckpt))
        llm.generate([1, 2], SamplingParams(max_tokens=20, seed=0))
        llm.close()
        gc.collect()
        assert torch.cuda.memory_allocated() - before <= 256 * MiB
