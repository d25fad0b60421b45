"""Startup graph capture (GPU): every bucket of the mode's calls is captured before the first request,
and the graphs captured at startup give the same tokens as an engine without graphs, whether only each
call's first bucket gets an eager warm-up run (the default) or every bucket (OUROBATCH_CAPTURE_WARMUP=all)."""

from __future__ import annotations

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("startup"), vocab_size=257, hidden_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.mark.parametrize("mode,B,warmup", [("deferred", 1, ""), ("deferred", 4, ""), ("eager", 4, ""),
                                           ("verify", 4, ""), ("deferred", 4, "all")])
def test_startup_captures_every_bucket_and_requests_capture_nothing(ckpt, mode, B, warmup, monkeypatch):
    monkeypatch.setenv("OUROBATCH_CAPTURE_WARMUP", warmup)
    prompts = [[1 + (7 * i) % 200, 2, 3 + i % 5] for i in range(11)]
    params = SamplingParams(max_tokens=13, ignore_eos=True, temperature=0.0)
    cfg = dict(model=str(ckpt), device="cuda", dtype="float32", mode=mode, deep_interval=B, max_num_seqs=16,
               max_model_len=64, num_kv_blocks=128, block_size=8)
    with SyncEngine(EngineConfig(**cfg)) as engine:
        graphs = engine.core.executor.graphs
        calls = engine.core.executor.graph_calls(mode, B, 2)
        # decode buckets 1, 2, 4, 8, 16 per call, and every prefill bucket (16 .. 2048 tokens)
        assert graphs.num_captures == len(calls) * len(graphs.buckets) + len(graphs.prefill_layouts)
        captured_at_start = graphs.num_captures
        with_graphs = [o.outputs[0].token_ids for o in engine.generate_batch(prompts, params)]
        assert graphs.num_captures == captured_at_start  # 11 requests finishing at once: buckets 8 .. 16
    with SyncEngine(EngineConfig(**cfg, cuda_graphs=False)) as engine:
        without = [o.outputs[0].token_ids for o in engine.generate_batch(prompts, params)]
    assert with_graphs == without
