"""Every layer of a decode loop pass as one Gluon launch (engine/gluon_layers.py) against the model's reference
path in float64 (OuroForCausalLM.run_loops with the torch backend: the path the CPU tests hold to the dense
float64 oracle), on the same weights and the same paged key / value history.

CUDA on Hopper only; tests/engine/test_gluon_layers_compile.py compiles the kernel for sm90 without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine import layers_dispatch
from engine.kv_cache import KVPool
from engine.loader import load_model
from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint
from tests.paged_decode import scattered_meta

from .test_gpu_attention_kernels import capture
from .test_gpu_gluon_attention import _hopper
from .test_gpu_gluon_attention_o import outputs_on_and_off

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon"),
              pytest.mark.timeout(120)]

# 8 heads of 128: the launch's head size; 3 layers, 2 loops; the vocabulary does not matter here
SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=128, intermediate_size=2816,
             num_hidden_layers=3, total_ut_steps=2, vocab_size=97)
PAGE = layers_dispatch.PAGE


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("layers") / "m", seed=5, eos_token_id=None, **SHAPE)


def fused_model(ckpt):
    """`ckpt` loaded as the engine runs it on the GPU: bf16, fused projections, the Triton backend."""
    fast = load_model(ckpt, torch.bfloat16, "cuda")
    fast.fuse_projections()
    fast.set_attention_backend("triton")
    return fast


@pytest.fixture(scope="module")
def models(ckpt):
    fast = fused_model(ckpt)
    assert fast.layer_stack is not None, "the launch applies to this shape on this GPU"
    ref = load_model(ckpt, torch.float64, "cuda")  # the torch backend: the reference path
    return fast, ref


class Decode:
    """`contexts[i]` positions for request i (its new row the last), scattered pages of random history in both
    pools (bf16, and the same values in float64), random input rows."""

    def __init__(self, cfg, contexts: list[int], seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        blocks = sum(-(-c // PAGE) for c in contexts) + 8
        self.pool = KVPool.for_model(cfg, blocks, PAGE, torch.bfloat16, "cuda")
        self.pool.k.copy_(torch.randn(self.pool.shape, generator=g, device="cuda"))
        self.pool.v.copy_(torch.randn(self.pool.shape, generator=g, device="cuda"))
        self.ref_pool = KVPool.for_model(cfg, blocks, PAGE, torch.float64, "cuda")
        self.ref_pool.k.copy_(self.pool.k)
        self.ref_pool.v.copy_(self.pool.v)
        self.meta, self.spans = scattered_meta(contexts, self.pool, seed)
        self.h = torch.randn(len(contexts), cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("contexts", [[1, 16, 17, 200, 33, 64, 5, 130], [47], [300, 2, 16]])
def test_a_loop_pass_launch_matches_the_float64_reference(models, contexts, monkeypatch):
    from engine import gluon_layers  # (Triton: imported where the GPU tests run)

    # bounded by the error of the engine's per-kernel bf16 path on the same inputs (its own roundings, another
    # summation order): the launch must be as close to float64 as the path it replaces, give or take half
    fast, ref = models
    calls = []
    real = gluon_layers.launch_layers
    monkeypatch.setattr(gluon_layers, "launch_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    d = Decode(fast.config, contexts, seed=len(contexts))
    kernels_pool = KVPool.for_model(fast.config, d.pool.num_blocks, PAGE, torch.bfloat16, "cuda")
    kernels_pool.k.copy_(d.pool.k)
    kernels_pool.v.copy_(d.pool.v)
    got = fast.run_loops(d.h, d.meta, d.pool, 1, 2)
    assert len(calls) == 2  # one launch per loop pass
    stack, fast.layer_stack = fast.layer_stack, None
    try:
        kernels = fast.run_loops(d.h, d.meta, kernels_pool, 1, 2)
    finally:
        fast.layer_stack = stack
    assert len(calls) == 2
    want = ref.run_loops(d.h.double(), d.meta, d.ref_pool, 1, 2)
    errors = [(rel(got[i], want[i]), rel(kernels[i], want[i])) for i in range(2)]
    for launch, per_kernel in errors:
        assert launch < max(1.5 * per_kernel, 1e-2), errors
    for loop in range(2):  # every layer's new key and value at the rows' slots (after RoPE)
        for span in d.spans:
            pos = span.context_len - 1
            blk, off = span.block_ids[pos // PAGE], pos % PAGE
            for layer in range(fast.config.num_hidden_layers):
                for name in ("k", "v"):
                    a = getattr(d.pool, name)[loop, layer, blk, off]
                    b = getattr(d.ref_pool, name)[loop, layer, blk, off]
                    c = getattr(kernels_pool, name)[loop, layer, blk, off]
                    assert rel(a, b) < max(1.5 * rel(c, b), 1e-2), (loop, layer, name, span.context_len, rel(a, b),
                                                                    rel(c, b))


def test_repeated_launches_and_a_graph_replay_agree(models):
    # the counters are never reset: each launch must find the generation the last one left
    fast, _ = models
    d = Decode(fast.config, [40, 9, 100], seed=7)
    before = int(fast.layer_stack.counters[0])
    first = fast.run_loops(d.h, d.meta, d.pool, 1, 2)
    for _ in range(20):
        again = fast.run_loops(d.h, d.meta, d.pool, 1, 2)
    torch.cuda.synchronize()
    assert int(fast.layer_stack.counters[0]) == before + 42
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert_a_replay_is_an_eager_call(fast, d)


def assert_a_replay_is_an_eager_call(fast, d: Decode) -> None:
    """Two loops of d's rows captured in a graph, replayed on fresh input rows: the eager call's readouts to the bit."""
    graph, out = capture(lambda: fast.run_loops(d.h, d.meta, d.pool, 1, 2))
    fresh = torch.randn_like(d.h.float()).to(d.h.dtype)
    d.h.copy_(fresh)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    eager = fast.run_loops(fresh, d.meta, d.pool, 1, 2)
    for a, b in zip(out, eager):
        assert torch.equal(a, b)


def test_calls_the_launch_does_not_serve_take_the_kernels():
    assert layers_dispatch.call_fits(8, 1, False, False)
    assert not layers_dispatch.call_fits(9, 1, False, False)  # more rows than the MMA holds
    assert not layers_dispatch.call_fits(4, 2, False, False)  # a deep call's rows per request
    assert not layers_dispatch.call_fits(4, 1, True, False)  # prefill


@pytest.fixture(scope="module")
def engine_ckpt(tmp_path_factory):  # the checkpoint's own loop count (4): the engine's default shallow loops need 3
    shape = {k: v for k, v in SHAPE.items() if k not in ("total_ut_steps", "num_hidden_layers")}
    return make_tiny_checkpoint(tmp_path_factory.mktemp("layers_engine") / "m", seed=6, eos_token_id=None, **shape)


def logprob_gap(outs_a, outs_b) -> float:
    """Mean |log-prob difference| of two runs' sampled tokens, each request up to its first different token."""
    diffs = []
    for a, b in zip(outs_a, outs_b):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        diffs += [abs(x - y) for x, y in zip(a.outputs[0].logprobs[:n], b.outputs[0].logprobs[:n])]
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize("requests", [8, 3])
def test_engine_with_the_launch_agrees_with_the_engine_without(engine_ckpt, monkeypatch, requests):
    # the launch rounds in other places than the kernels (qkv before RoPE, the norms' chains in float32), and
    # the tiny model's loops amplify bf16 roundings: its log-probs must stay as close to the kernels' as the
    # kernels' are to a float32 engine's, give or take half
    from engine import gluon_layers

    def switch(value: str) -> None:
        monkeypatch.setenv(layers_dispatch.ENV, value)

    outs = outputs_on_and_off(engine_ckpt, requests, monkeypatch, gluon_layers, "launch_layers", switch)
    prompts = [[1 + i, 2 + i, 3] for i in range(requests)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(requests)]
    cfg = EngineConfig(model=str(engine_ckpt), device="cuda", dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    with SyncEngine(cfg) as llm:
        fp32 = llm.generate_batch(prompts, params)
    agree = sum(a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4] for a, b in zip(outs["1"], outs["0"]))
    assert agree >= requests - 2, agree
    gaps = dict(launch=logprob_gap(outs["1"], outs["0"]), bf16=logprob_gap(outs["0"], fp32))
    assert gaps["launch"] <= 1.5 * gaps["bf16"] + 0.01, gaps


@pytest.mark.parametrize("contexts", [[1, 16, 17, 200, 33, 64, 5, 130], [47, 2]])
def test_slots_nothing_wrote_do_not_reach_the_output(models, contexts):
    # The launch streams whole pages: past each row's context (its new position's slot too, merged from
    # registers) a slot holds whatever the memory held (an engine's pool on memory another one freed). NaN there,
    # and in every block no row owns, must leave every loop's readout and every written key and value as they were.
    fast, _ = models
    clean, poisoned = Decode(fast.config, contexts, seed=9), Decode(fast.config, contexts, seed=9)
    stale = torch.ones(poisoned.pool.k.shape[2], PAGE, dtype=torch.bool)  # the scratch block too
    for span in poisoned.spans:
        for p in range(span.context_len - 1):
            stale[span.block_ids[p // PAGE], p % PAGE] = False
    stale = stale.cuda()
    for plane in (poisoned.pool.k, poisoned.pool.v):
        plane[:, :, stale] = float("nan")
    want = fast.run_loops(clean.h, clean.meta, clean.pool, 1, 2)
    got = fast.run_loops(poisoned.h, poisoned.meta, poisoned.pool, 1, 2)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    written = ~stale
    for span in clean.spans:
        written[span.block_ids[(span.context_len - 1) // PAGE], (span.context_len - 1) % PAGE] = True
    for name in ("k", "v"):
        assert torch.equal(getattr(poisoned.pool, name)[:, :, written], getattr(clean.pool, name)[:, :, written])
