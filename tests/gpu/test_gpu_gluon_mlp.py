"""The decode step's MLP as one Gluon launch (engine/gluon_mlp.py) against float64 references.

CUDA on Hopper only; tests/engine/test_gluon_mlp_compile.py compiles it for sm90 without a GPU. The reference
runs the add + norm + norm after attention, gate_up, SiLU x up and down_proj in float64 from the same 16-bit
inputs and weights.
"""

from __future__ import annotations

import pytest
import torch

from engine.mlp_dispatch import new_counters
from ourobatch.testing import make_tiny_checkpoint

from .test_gpu_attention_kernels import capture
from .test_gpu_gluon_attention import _hopper
from .test_gpu_gluon_attention_o import assert_bf16_agreement, outputs_on_and_off

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon"),
              pytest.mark.timeout(120)]

EPS = 1e-6


class Mlp:
    """A call's inputs (o_proj's float32 partials, the residual rows) and weights, on the GPU and in float64."""

    def __init__(self, rows: int, hidden: int, inter: int, splits: int, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.partials = torch.randn(splits, rows, hidden, generator=g) / splits
        self.h = torch.randn(rows, hidden, generator=g).to(dtype)
        self.wa, self.wb = ((1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype) for _ in range(2))
        self.gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
        self.down = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(dtype)
        self.dtype = dtype
        self.dev = {k: getattr(self, k).cuda() for k in ("partials", "h", "wa", "wb", "gate_up", "down")}

    def refresh(self, seed: int) -> None:
        """New partials and residual rows, in place (a captured graph reads them at its replay)."""
        g = torch.Generator().manual_seed(seed)
        self.partials.copy_(torch.randn(self.partials.shape, generator=g) / self.partials.shape[0])
        self.h.copy_(torch.randn(self.h.shape, generator=g).to(self.dtype))
        self.dev["partials"].copy_(self.partials)
        self.dev["h"].copy_(self.h)

    def launch(self, barrier: torch.Tensor, **kwargs):
        from engine.gluon_mlp import launch_mlp

        d = self.dev
        return launch_mlp(d["h"], d["partials"], d["wa"], d["wb"], d["gate_up"], d["down"], barrier, EPS, **kwargs)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        def rms(x):
            return x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()

        o = self.partials.double().sum(0)
        h_mid = self.h.double() + rms(o) * self.wa.double()
        x = rms(h_mid) * self.wb.double()
        gate, up = (x @ self.gate_up.double().T).chunk(2, dim=-1)
        return h_mid, (torch.nn.functional.silu(gate) * up) @ self.down.double().T

    def check(self, got) -> None:
        h_mid, down = got
        rows, hidden = self.h.shape
        assert h_mid.shape == (rows, hidden) and h_mid.dtype == self.dtype
        assert down.shape == (1, rows, hidden) and down.dtype == torch.float32
        for out, ref in zip((h_mid, down[0]), self.reference()):
            out = out.cpu().double()
            assert torch.isfinite(out).all()
            err = float((out - ref).norm() / ref.norm())
            assert err < 1.5e-2, err  # 16-bit normed rows, gate, up and SiLU x up, as in the engine


SHAPES = [(2048, 5632), (256, 512), (512, 1536), (1024, 2816)]  # hidden, intermediate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows,splits", [(8, 1), (3, 4), (1, 1)])
def test_mlp_matches_reference(dtype, shape, rows, splits):
    from engine.mlp_dispatch import mlp_fold_applies

    hidden, inter = shape
    assert mlp_fold_applies(rows, hidden, inter)
    call = Mlp(rows, hidden, inter, splits, dtype, seed=hidden + inter + rows)
    barrier = new_counters("cuda")
    call.check(call.launch(barrier))
    assert barrier[0].item() == 0 and barrier[1].item() == 1  # reset by the last CTA; one generation a launch
    assert barrier[2:].tolist() == _group_tiles(inter)  # every gate_up tile counted in its chunk group


def _group_tiles(inter: int) -> list[int]:
    from engine.mlp_dispatch import MLP_GROUP_CHUNKS, MLP_MAX_GROUPS

    tiles = [min(MLP_GROUP_CHUNKS * 16, inter // 16 - MLP_GROUP_CHUNKS * 16 * g) for g in range(MLP_MAX_GROUPS)]
    return [max(0, t) for t in tiles]


@pytest.mark.parametrize("shape", [(2048, 5632), (256, 512)], ids=str)
def test_the_whole_grid_barrier_variant(shape):
    # groups=0: SiLU x up's rows staged after a grid barrier instead of group by group (a measuring control)
    hidden, inter = shape
    call = Mlp(8, hidden, inter, 1, torch.bfloat16, seed=inter)
    barrier = new_counters("cuda")
    call.check(call.launch(barrier, groups=0))
    assert barrier[:2].tolist() == [0, 1] and barrier[2:].tolist() == _group_tiles(inter)  # counted all the same


def test_barrier_serves_many_launches_eager_and_graphed():
    # the counters persist across launches (eager ones and a graph's replays with fresh inputs): every launch
    # must pass the barrier, stage every CTA's SiLU x up columns and leave the count at zero
    call = Mlp(8, 2048, 5632, 1, torch.bfloat16, seed=3)
    barrier = new_counters("cuda")
    for _ in range(50):
        out = call.launch(barrier)
    call.check(out)
    graph, out = capture(lambda: call.launch(barrier))
    for i in range(20):
        call.refresh(100 + i)
        graph.replay()
        call.check(out)
    torch.cuda.synchronize()
    assert barrier[0].item() == 0 and barrier[1].item() == 50 + 1 + 20  # capture() runs it once first
    assert barrier[2:].tolist() == [71 * t for t in _group_tiles(5632)]


def test_dispatch(monkeypatch):
    from engine import mlp_dispatch

    call = Mlp(8, 2048, 5632, 1, torch.bfloat16, seed=4)
    d = call.dev
    monkeypatch.delenv("OUROBATCH_DECODE_FOLD_MLP", raising=False)
    monkeypatch.setattr(mlp_dispatch, "_FOLD_MLP", {})
    assert not mlp_dispatch.mlp_folds(d["h"], d["gate_up"], d["down"])  # off by default
    monkeypatch.setenv("OUROBATCH_DECODE_FOLD_MLP", "1")
    monkeypatch.setattr(mlp_dispatch, "_FOLD_MLP", {})
    assert mlp_dispatch.mlp_folds(d["h"], d["gate_up"], d["down"])
    nine = torch.zeros(9, 2048, dtype=torch.bfloat16, device="cuda")
    assert not mlp_dispatch.mlp_folds(nine, d["gate_up"], d["down"])
    assert not mlp_dispatch.mlp_folds(d["h"].float(), d["gate_up"], d["down"])
    monkeypatch.setenv("OUROBATCH_DECODE_FOLD_MLP", "0")
    monkeypatch.setattr(mlp_dispatch, "_FOLD_MLP", {})
    assert not mlp_dispatch.mlp_folds(d["h"], d["gate_up"], d["down"])
    monkeypatch.setenv("OUROBATCH_DECODE_FOLD_MLP", "yes")
    monkeypatch.setattr(mlp_dispatch, "_FOLD_MLP", {})
    with pytest.raises(ValueError, match="OUROBATCH_DECODE_FOLD_MLP must be 0"):
        mlp_dispatch.mlp_folds(d["h"], d["gate_up"], d["down"])


@pytest.fixture(scope="module")
def mlp_ckpt(tmp_path_factory):
    # 8 heads of 128 and hidden 1024: at 8 requests the decode kernel folds o_proj too (64 output tiles)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mlp") / "m", seed=5, eos_token_id=None, hidden_size=1024,
                                num_attention_heads=8, num_key_value_heads=8, head_dim=128, intermediate_size=2816,
                                vocab_size=97)


@pytest.mark.parametrize("requests", [8, 3])
def test_engine_with_the_mlp_launch_agrees_with_the_engine_without(mlp_ckpt, monkeypatch, requests):
    # 8 requests: o_proj's partials from the folded decode kernel; 3: from attention and the split-K partials
    from engine import gluon_mlp, mlp_dispatch

    def switch(value: str) -> None:
        monkeypatch.setenv(mlp_dispatch.FOLD_ENV, value)
        monkeypatch.setattr(mlp_dispatch, "_FOLD_MLP", {})

    outs = outputs_on_and_off(mlp_ckpt, requests, monkeypatch, gluon_mlp, "launch_mlp", switch)
    # float32 sums in another order: bf16 roundings differ now and then and the tiny model's loops amplify them
    assert_bf16_agreement(outs["1"], outs["0"], min_agree=requests - 2)
