"""engine/kv_prefetch.py on a Hopper GPU: a fused decode pass (engine/fused_pass.py) with OUROBATCH_KV_PREFETCH set
equals the same pass without it to the bit (a prefetch is a hint; the launch must keep the PDL chain's order),
eagerly, and a graph replay equals the eager call, at every point and page choice, with contexts shorter than the
pages asked for;
and it launches one prefetch per attention of the pass. Its schedule: tests/engine/test_kv_prefetch_dispatch.py."""

from __future__ import annotations

import pytest
import torch

from engine import kv_prefetch_dispatch as kvp
from ourobatch.testing import make_tiny_checkpoint

from .test_gpu_gluon_attention import _hopper
from .test_gpu_gluon_layers import Decode, assert_a_replay_is_an_eager_call, fused_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU"),
              pytest.mark.timeout(300)]

SHAPE = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=128, intermediate_size=1536,
             num_hidden_layers=3, total_ut_steps=2, vocab_size=97)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fused_model(make_tiny_checkpoint(tmp_path_factory.mktemp("kv_prefetch") / "m", seed=5, eos_token_id=None,
                                            **SHAPE))


def contexts_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(c) for c in torch.randint(1, 400, (n,), generator=g)]


def passes(model, d: Decode, setting: str, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setenv(kvp.ENV, setting)
    return model.run_loops(d.h, d.meta, d.pool, 1, 2)


@pytest.mark.parametrize("n", [64, 9, 40])
@pytest.mark.parametrize("setting", ["3", "1:qkv", "5:gate_up:end", "32:norm:normal", "3:line",
                                     "2:qkv:end:normal:line"])
def test_a_pass_with_prefetches_equals_one_without_to_the_bit(model, monkeypatch, n, setting):
    d = Decode(model.config, contexts_of(n, n), seed=n)
    off = passes(model, d, "0", monkeypatch)
    keys = d.pool.k.clone(), d.pool.v.clone()
    on = passes(model, d, setting, monkeypatch)
    for a, b in zip(on, off):
        assert torch.equal(a, b)
    assert torch.equal(d.pool.k, keys[0]) and torch.equal(d.pool.v, keys[1])  # the same keys and values written


def test_a_graph_replay_with_prefetches_is_an_eager_call(model, monkeypatch):
    # and an eager call with them equals one without (above): the replay equals the pass without prefetches
    monkeypatch.setenv(kvp.ENV, "4")
    assert_a_replay_is_an_eager_call(model, Decode(model.config, contexts_of(64, 3), seed=3))


@pytest.mark.parametrize("setting,launches", [("0", 0), ("2", 6), ("2:qkv", 6), ("2:gate_up", 6), ("2:line", 6)])
def test_one_launch_per_attention(model, monkeypatch, setting, launches):  # the bulk way's kernel or the line way's
    from torch.profiler import ProfilerActivity, profile

    d = Decode(model.config, contexts_of(16, 7), seed=7)
    passes(model, d, setting, monkeypatch)  # compiled before the count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        passes(model, d, setting, monkeypatch)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    line = setting.endswith(":line")
    kernel, other = ("_kv_line_kernel", "_kv_prefetch_kernel") if line else ("_kv_prefetch_kernel", "_kv_line_kernel")
    assert sum(kernel in name for name in names) == launches  # 2 loops x 3 layers
    assert not any(other in name for name in names)


def test_calls_it_does_not_serve_launch_nothing(model, monkeypatch):
    calls = []
    from engine import kv_prefetch

    monkeypatch.setattr(kv_prefetch, "prefetch_pages", lambda *a, **k: calls.append(a))
    d = Decode(model.config, contexts_of(kvp.MIN_ROWS - 1, 1), seed=1)  # the loop-pass launch's rows
    passes(model, d, "3", monkeypatch)
    assert calls == []
    d = Decode(model.config, contexts_of(kvp.MIN_ROWS, 1), seed=1)
    passes(model, d, "3", monkeypatch)
    assert len(calls) == 6
