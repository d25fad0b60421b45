"""What the asyncio Engine's tests share (tests/test_async_engine.py, tests/test_async_engine_faults.py): their
tiny checkpoint (no EOS), the engine config they start from and the sampling params they vary."""

from __future__ import annotations

from ourobatch import EngineConfig, SamplingParams
from ourobatch.testing import make_tiny_checkpoint


def make_ckpt(root):
    """The tiny checkpoint (seed 9, no EOS) under root, for a module-scoped fixture."""
    return make_tiny_checkpoint(root / "m", seed=9, eos_token_id=None)


def config(ckpt, **kw) -> EngineConfig:
    base = dict(model=str(ckpt), dtype="float64", deep_interval=3, block_size=4, num_kv_blocks=128,
                max_model_len=256)
    base.update(kw)
    return EngineConfig(**base)


def sp(max_tokens=10, seed=0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)
