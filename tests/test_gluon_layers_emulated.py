"""The engine's loop-pass launch (engine/gluon_layers.py: every layer of a decode loop pass, attention included, as
one warp-specialized Gluon kernel) run on the CPU by tests/gluon_emulator.py, against the model's reference path in
float64 on the same weights and the same paged key / value history, as tests/gpu/test_gpu_gluon_layers.py checks
it on the H200. Here at a small shape (2 heads of 128, hidden 256: 16 CTAs), so a session without a GPU can change
the kernel and see its protocol, arithmetic and shared-memory proxy fences hold. Where Triton is installed (CI installs
it); acquire / release ordering is the GPU test's."""

from __future__ import annotations

import pytest
import torch

from engine import layers_dispatch
from engine.kv_cache import KVPool
from engine.layer_stack import stack_layers
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint
from tests.paged_decode import scattered_meta

pytest.importorskip("triton.experimental.gluon")
emulator = pytest.importorskip("tests.gluon_emulator")

SHAPE = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128, intermediate_size=512,
             num_hidden_layers=2, total_ut_steps=2, vocab_size=97)
PAGE = layers_dispatch.PAGE
CTAS = 16  # >= rows x heads (an attention item each) and >= hidden / 16 (a residual share each)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("layers_emulated") / "m", seed=5, eos_token_id=None, **SHAPE)


@pytest.fixture
def models(ckpt):  # per test: a launch that failed leaves the stack's never-reset counts where it stopped
    fast = load_model(ckpt, torch.bfloat16, "cpu")
    fast.fuse_projections()
    stack = stack_layers(fast)  # the CPU has no launch: the stack is made here, the model keeps its torch path
    return fast, stack, load_model(ckpt, torch.float64, "cpu")


def decode(cfg, contexts: list[int], seed: int):
    """`contexts[i]` positions for request i (its new row the last) on scattered pages of random history, in a bf16
    pool and a float64 one; the requests' input rows."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-c // PAGE) for c in contexts) + 4
    pools = [KVPool.for_model(cfg, blocks, PAGE, dtype, "cpu") for dtype in (torch.bfloat16, torch.float64)]
    for name in ("k", "v"):
        getattr(pools[0], name).copy_(torch.randn(pools[0].shape, generator=g))
        getattr(pools[1], name).copy_(getattr(pools[0], name))
    meta, spans = scattered_meta(contexts, pools[0], seed)
    h = torch.randn(len(contexts), cfg.hidden_size, generator=g).to(torch.bfloat16)
    return pools, meta, h, spans


def emulated_loops(fast, stack, h, meta, pool, loops: int = 2) -> list[torch.Tensor]:
    from engine import gluon_layers

    cfg, readouts = fast.config, []
    for loop in range(loops):
        args, constexprs, out = gluon_layers.layers_args(h, stack, pool.k[loop], pool.v[loop], meta, stack.inv_freq,
                                                          cfg.rms_norm_eps, cfg.head_dim**-0.5)
        emulator.emulate(gluon_layers.layers_kernel, CTAS, *args, USE_PDL=False, **constexprs)
        readouts.append(out)
        h = out
    return readouts


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("contexts", [[1, 16, 17, 40, 33, 3, 5, 31], [47], [2, 16, 18]])
def test_the_launch_matches_the_float64_reference(models, contexts):
    # as on the GPU: as close to float64 as the bf16 path it replaces (here the CPU's torch path), give or take half
    fast, stack, ref = models
    (pool, ref_pool), meta, h, spans = decode(fast.config, contexts, seed=len(contexts))
    bf16_pool = KVPool.for_model(fast.config, pool.num_blocks, PAGE, torch.bfloat16, "cpu")
    bf16_pool.k.copy_(pool.k)
    bf16_pool.v.copy_(pool.v)
    got = emulated_loops(fast, stack, h, meta, pool)
    bf16 = fast.run_loops(h, meta, bf16_pool, 1, 2)
    want = ref.run_loops(h.double(), meta, ref_pool, 1, 2)
    errors = [(rel(got[i], want[i]), rel(bf16[i], want[i])) for i in range(2)]
    for launch, torch_bf16 in errors:
        assert launch < max(1.5 * torch_bf16, 1e-2), errors
    for loop in range(2):  # every layer's new key and value at the rows' slots (after RoPE), taken together: one
        # slot alone is a few hundred values, whose error ratio to the torch path's wanders (0.9-1.7 seen)
        slots = [(span.block_ids[(span.context_len - 1) // PAGE], (span.context_len - 1) % PAGE) for span in spans]

        def written(p, loop=loop, slots=slots):
            return torch.stack([getattr(p, n)[loop, :, blk, off] for blk, off in slots for n in ("k", "v")])

        launch, torch_bf16 = rel(written(pool), written(ref_pool)), rel(written(bf16_pool), written(ref_pool))
        assert launch < max(1.5 * torch_bf16, 1e-2), (loop, launch, torch_bf16)


def test_repeated_launches_find_the_generation_the_last_one_left(models):
    # the counters are never reset: each launch adds the grid to every count and waits for its own totals
    fast, stack, _ = models
    (pool, _), meta, h, _ = decode(fast.config, [20, 9], seed=3)
    before = int(stack.counters[0])
    first = emulated_loops(fast, stack, h, meta, pool)
    again = emulated_loops(fast, stack, h, meta, pool)
    assert int(stack.counters[0]) == before + 4  # one generation per launch
    for a, b in zip(first, again):
        assert torch.equal(a, b)
