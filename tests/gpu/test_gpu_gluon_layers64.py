"""engine/layers64.py on a Hopper GPU: decode loop passes of 9..64 requests as gluon_layers64.py's launches between
the Gluon decode attention calls (OUROBATCH_DECODE_LAYERS64=1), against the float64 reference path and the per-kernel
path they replace; repeated calls and a graph replay; an engine with the switch on against one with it off.
tests/test_gluon_layers64_emulated.py checks the same launches on the CPU (no acquire / release there)."""

from __future__ import annotations

import pytest
import torch

from engine import layers64_dispatch
from engine.kv_cache import KVPool
from engine.layer_stack import layers64_run
from engine.loader import load_model
from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

from .test_gpu_gluon_attention import _hopper
from .test_gpu_gluon_layers import PAGE, Decode, assert_a_replay_is_an_eager_call, fused_model, logprob_gap, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon"),
              pytest.mark.timeout(300)]

# 8 heads of 128 (hidden 1024: 2 K splits of 512), intermediate 3072 (6 splits): 132 SMs are a multiple of both
SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
             num_hidden_layers=3, total_ut_steps=2, vocab_size=97)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("layers64") / "m", seed=11, eos_token_id=None, **SHAPE)


@pytest.fixture(scope="module")
def models(ckpt):
    fast = fused_model(ckpt)
    ref = load_model(ckpt, torch.float64, "cuda")
    return fast, ref


@pytest.fixture
def switch_on(monkeypatch):
    monkeypatch.setenv(layers64_dispatch.ENV, "1")


def counted(monkeypatch) -> list:
    """engine/layers64.run_loops (Triton: imported where the GPU tests run) counting its calls."""
    from engine import layers64

    calls, real = [], layers64.run_loops
    monkeypatch.setattr(layers64, "run_loops", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def contexts_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(c) for c in torch.randint(1, 300, (n,), generator=g)]


@pytest.mark.parametrize("n", [64, 40, 9])
def test_a_loop_pass_matches_the_float64_reference(models, switch_on, monkeypatch, n):
    # as close to float64 as the per-kernel bf16 path it replaces, give or take half: readouts and every layer's
    # new key and value at the rows' slots
    fast, ref = models
    calls = counted(monkeypatch)
    d = Decode(fast.config, contexts_of(n, n), seed=n)
    assert layers64_run(fast.layer_stack, d.h, d.meta, d.pool)
    kernels_pool = KVPool.for_model(fast.config, d.pool.num_blocks, PAGE, torch.bfloat16, "cuda")
    kernels_pool.k.copy_(d.pool.k)
    kernels_pool.v.copy_(d.pool.v)
    got = fast.run_loops(d.h, d.meta, d.pool, 1, 2)
    assert len(calls) == 1
    monkeypatch.setenv(layers64_dispatch.ENV, "0")
    kernels = fast.run_loops(d.h, d.meta, kernels_pool, 1, 2)
    assert len(calls) == 1
    want = ref.run_loops(d.h.double(), d.meta, d.ref_pool, 1, 2)
    assert_as_close_as_the_kernels(got, kernels, want, d, kernels_pool)


def assert_as_close_as_the_kernels(got: list, kernels: list, want: list, d: Decode, kernels_pool: KVPool) -> None:
    """A pass from loop 1 (`got`, its keys and values in d.pool) as close to float64 (`want`, d.ref_pool) as the
    per-kernel bf16 path (`kernels`, kernels_pool), give or take half: readouts and every layer's new key and value
    at the rows' slots (1e-2 relative where the per-kernel path is closer than that)."""
    errors = [(rel(got[i], want[i]), rel(kernels[i], want[i])) for i in range(len(want))]
    for launches, per_kernel in errors:
        assert launches < max(1.5 * per_kernel, 1e-2), errors
    for loop in range(len(want)):
        for layer in range(d.pool.k.shape[1]):
            for name in ("k", "v"):
                a, b, c = (getattr(p, name)[loop, layer].flatten(0, 1)[d.meta.slots]
                           for p in (d.pool, d.ref_pool, kernels_pool))
                assert rel(a, b) < max(1.5 * rel(c, b), 1e-2), (loop, layer, name, rel(a, b), rel(c, b))


def test_repeated_calls_and_a_graph_replay_agree(models, switch_on):
    # the counts are zeroed once a pass; the sums run in split order: the same bits every time
    fast, _ = models
    d = Decode(fast.config, contexts_of(64, 3), seed=3)
    first = fast.run_loops(d.h, d.meta, d.pool, 1, 2)
    for _ in range(10):
        again = fast.run_loops(d.h, d.meta, d.pool, 1, 2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert_a_replay_is_an_eager_call(fast, d)


def test_calls_the_launches_do_not_serve_keep_the_kernels(models, switch_on):
    fast, _ = models
    small = Decode(fast.config, contexts_of(8, 5), seed=5)  # 8 requests: the loop-pass launch's
    assert not layers64_run(fast.layer_stack, small.h, small.meta, small.pool)


@pytest.fixture(scope="module")
def engine_ckpt(tmp_path_factory):  # the checkpoint's own loop count (4): the engine's default shallow loops need 3
    shape = {k: v for k, v in SHAPE.items() if k not in ("total_ut_steps", "num_hidden_layers")}
    return make_tiny_checkpoint(tmp_path_factory.mktemp("layers64_engine") / "m", seed=12, eos_token_id=None, **shape)


def test_engine_with_the_launches_agrees_with_the_engine_without(engine_ckpt, monkeypatch):
    # 40 sampled requests through bf16 engines with the switch on, then off: the launches served decode calls; the
    # log-probs stay as close to the kernels' as the kernels' are to a float32 engine's, give or take half
    requests = 40
    prompts = [[1 + i % 90, 2 + i % 90, 3] for i in range(requests)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(requests)]
    calls = counted(monkeypatch)
    outs = {}
    for value, dtype in (("1", "bfloat16"), ("0", "bfloat16"), ("0", "float32")):
        monkeypatch.setenv(layers64_dispatch.ENV, value)
        cfg = EngineConfig(model=str(engine_ckpt), device="cuda", dtype=dtype, num_kv_blocks=256, max_num_seqs=64)
        with SyncEngine(cfg) as llm:
            outs[value + dtype] = llm.generate_batch(prompts, params)
        if value == "1":
            assert calls, "the launches served the decode calls"
            seen = len(calls)
    assert len(calls) == seen
    on, off, fp32 = outs["1bfloat16"], outs["0bfloat16"], outs["0float32"]
    agree = sum(a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4] for a, b in zip(on, off))
    assert agree >= requests - 6, agree
    gaps = dict(launches=logprob_gap(on, off), bf16=logprob_gap(off, fp32))
    assert gaps["launches"] <= 1.5 * gaps["bf16"] + 0.01, gaps
