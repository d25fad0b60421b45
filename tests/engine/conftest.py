from __future__ import annotations

import pytest

from ourobatch.testing import make_tiny_checkpoint

# Model shapes the engine is checked on: GQA with 1, 2 and equal kv heads; 2 and 3 layers;
# T = 4 and another T; head_dim both equal to and different from hidden / heads.
SHAPES = {
    "kv1-L2-T4": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                      total_ut_steps=4),
    "kv2-L3-T4-hd16": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           total_ut_steps=4, hidden_size=48, intermediate_size=80),
    "kv4-L2-T3": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=None,
                      total_ut_steps=3, vocab_size=37),
    "kv2-L2-T5": dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                      total_ut_steps=5),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_tiny_checkpoint(root / name, seed=i + 1, eos_token_id=None, **shape)
            for i, (name, shape) in enumerate(SHAPES.items())}
