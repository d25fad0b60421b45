"""benchmarks/stacked_decode.py's loop pass (the stacked norm way, attention the engine's) on the GPU against the
model's float64 pass and the engine's per-kernel bf16 path (engine/fused_pass.py) on the same weights and paged
history: readouts and every layer's stored keys and values, at 64, 40 and 9 rows; a graph replay of it (as the
engine captures the decode step, the harness's runs) equal to an eager call. The interpreter check on the CPU:
tests/test_stacked_decode.py."""

from __future__ import annotations

import pytest
import torch

from engine import fused_pass, layers64_dispatch
from engine.kv_cache import KVPool
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint
from tests.benchmark_scripts import load_benchmark

from .test_gpu_gluon_attention import _hopper
from .test_gpu_gluon_layers import PAGE, Decode, assert_a_replay_is_an_eager_call, fused_model
from .test_gpu_gluon_layers64 import SHAPE, assert_as_close_as_the_kernels, contexts_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (TMA descriptors)"),
              pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("stacked") / "m", seed=11, eos_token_id=None, **SHAPE)
    return fused_model(ckpt), load_model(ckpt, torch.float64, "cuda")


@pytest.mark.parametrize("n", [64, 40, 9])
def test_the_stacked_pass_is_as_close_to_float64_as_the_per_kernel_path(models, n):
    fast, ref = models
    sd = load_benchmark("stacked_decode")
    d = Decode(fast.config, contexts_of(n, n), seed=n)
    kernels_pool = KVPool.for_model(fast.config, d.pool.num_blocks, PAGE, torch.bfloat16, "cuda")
    kernels_pool.k.copy_(d.pool.k)
    kernels_pool.v.copy_(d.pool.v)
    got = sd.stacked_run_loops(fast, d.h, d.meta, d.pool, 1, 2)
    kernels = fused_pass.run_loops(fast, d.h, d.meta, kernels_pool, 1, 2)
    want = ref.run_loops(d.h.double(), d.meta, d.ref_pool, 1, 2)
    assert_as_close_as_the_kernels(got, kernels, want, d, kernels_pool)


def test_a_graph_replay_of_the_installed_pass_is_an_eager_call(models, monkeypatch):
    fast, _ = models
    sd = load_benchmark("stacked_decode")
    monkeypatch.setattr(fused_pass, "run_loops", fused_pass.run_loops)  # restored after the test
    monkeypatch.setenv(layers64_dispatch.ENV, "0")  # 40 rows: the per-kernel path's
    calls = sd.install((16, 128), 3)
    d = Decode(fast.config, contexts_of(40, 3), seed=3)
    assert_a_replay_is_an_eager_call(fast, d)
    assert calls["stacked"] >= 2 and calls["original"] == 0, calls
