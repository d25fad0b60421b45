"""KVPool owns its geometry and memory: the bytes it says a block takes are the bytes it allocates, and
release / reallocate give the same shape back."""

from __future__ import annotations

import pytest
import torch

from engine.config import OuroConfig
from engine.kv_cache import KVPool


def _config(**kw) -> OuroConfig:
    fields = dict(vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, rope_theta=10000.0, rms_norm_eps=1e-6, total_ut_steps=4,
                  max_position_embeddings=64, tie_word_embeddings=False, early_exit_threshold=1.0,
                  eos_token_ids=(), bos_token_id=None, torch_dtype=None)
    return OuroConfig(**{**fields, **kw})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bytes_per_block_is_what_the_pool_allocates(dtype):
    cfg = _config()
    pool = KVPool.for_model(cfg, 5, 8, dtype, "cpu")
    # every loop plane and layer, K and V, at the checkpoint's kv heads x head_dim, plus the scratch block
    assert pool.k.shape == (4, 3, 6, 8, 2, 4) and pool.k.dtype == dtype
    assert pool.num_bytes == 6 * KVPool.bytes_per_block(cfg, 8, dtype)
    assert KVPool.bytes_per_block(cfg, 8, dtype) == 2 * 4 * 3 * 8 * 2 * 4 * torch.empty((), dtype=dtype).element_size()


def test_release_and_reallocate_keep_the_geometry():
    pool = KVPool.for_model(_config(), 3, 4, torch.float32, "cpu")
    shape, num_bytes = pool.k.shape, pool.num_bytes
    pool.release()
    assert pool.k is None and pool.v is None and pool.num_bytes == 0
    assert (pool.num_blocks, pool.block_size, pool.scratch_block) == (3, 4, 3)
    pool.reallocate()
    assert pool.k.shape == shape == pool.v.shape and pool.num_bytes == num_bytes
