"""The decode kernel with o_proj and its add + norm folded in (engine/gluon_attention_o.py) against float64 references.

CUDA on Hopper only; tests/engine/test_gluon_attention_o_compile.py compiles it for sm90 without a GPU. The
reference is the float64 paged attention (test_gpu_attention_kernels.Case) times the weights, then the add + norm +
norm, in float64.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention_dispatch import DecodeConfig, FoldConfig, o_fold_applies, parse_fold
from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

from .test_gpu_attention_kernels import Case, capture
from .test_gpu_gluon_attention import _hopper

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Gluon"),
              pytest.mark.timeout(300)]


def _weights(hidden: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hidden, k, generator=g) / k**0.5).to(dtype).cuda()


EPS = 1e-6


class Residual:
    """The residual rows and the two norm weights of a fold's add + norm, on the GPU and in float64."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.h = torch.randn(rows, hidden, generator=g).to(dtype)
        self.wa, self.wb = ((1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype) for _ in range(2))
        self.dev = [t.cuda() for t in (self.h, self.wa, self.wb)]

    def reference(self, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def rms(x):
            return x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()

        h_new = self.h.double() + rms(o) * self.wa.double()
        return h_new, rms(h_new) * self.wb.double()


def _fold(case: Case, wo: torch.Tensor, barrier: torch.Tensor, config: DecodeConfig, res: Residual,
          fold: FoldConfig = FoldConfig()):
    from engine.gluon_attention_o import launch_decode_attention_o

    tables, ctx, starts, max_rows, scale = case.args
    return launch_decode_attention_o(case.q, case.k, case.v, tables, ctx, starts, scale, config, wo, barrier,
                                     *res.dev, EPS, fold)


def _check(case: Case, wo: torch.Tensor, res: Residual, got, ref_attention: torch.Tensor | None = None) -> None:
    ref_attention = case.ref if ref_attention is None else ref_attention
    o = ref_attention.reshape(ref_attention.shape[0], -1) @ wo.double().cpu().T
    for out, ref in zip(got, res.reference(o)):
        assert out.shape == ref.shape and out.dtype == case.dtype
        out = out.cpu().double()
        assert torch.isfinite(out).all()
        err = float((out - ref).norm() / ref.norm())
        assert err < 1.5e-2, err  # 16-bit attention rows, o and h, as in the engine


SHAPES = [(16, 128, 2048), (2, 128, 256), (4, 64, 512), (8, 64, 1024)]  # heads, head_dim, hidden


FOLDS = ["1", "1:cta", "2", "2:cta"]


CASES = ([(dtype, shape, config, "1") for dtype in (torch.bfloat16, torch.float16) for shape in SHAPES
          for config in (DecodeConfig(32, 6), DecodeConfig(64, 3), DecodeConfig(16, 4, early=False))]
         + [(torch.bfloat16, shape, DecodeConfig(32, 6), fold) for shape in SHAPES for fold in FOLDS[1:]])


@pytest.mark.parametrize("dtype,shape,config,fold", CASES, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_fold_matches_reference(dtype, shape, config, fold):
    heads, d, hidden = shape
    fold = parse_fold(fold)
    ctx = [1, 15, 16, 17, 33, 100, 640, 1000]
    assert o_fold_applies(config, 8, 8, heads, d, hidden, torch.cuda.get_device_properties(0).multi_processor_count)
    case = Case(ctx, [1] * 8, heads, heads, d, dtype, seed=heads * d + hidden)
    wo = _weights(hidden, heads * d, dtype, seed=hidden)
    res = Residual(8, hidden, dtype, seed=d)
    barrier = torch.zeros(2, dtype=torch.int32, device="cuda")
    _check(case, wo, res, _fold(case, wo, barrier, config, res, fold))
    passes = 2 if fold.norm else 1  # the add + norm's pass
    assert barrier[0].item() == 0 and barrier[1].item() == passes  # reset by the last CTA; one generation a pass


@pytest.mark.parametrize("fold", FOLDS)
def test_rows_of_requests_without_a_row(fold):
    # a bucket's padding: 8 requests, two of them without a new row (6 query rows)
    rows = [1, 0, 1, 1, 0, 1, 1, 1]
    case = Case([50, 70, 90, 3, 5, 700, 16, 17], rows, 16, 16, 128, torch.bfloat16, seed=5)
    wo = _weights(2048, 2048, torch.bfloat16, seed=6)
    res = Residual(6, 2048, torch.bfloat16, seed=6)
    barrier = torch.zeros(2, dtype=torch.int32, device="cuda")
    _check(case, wo, res, _fold(case, wo, barrier, DecodeConfig(), res, parse_fold(fold)))


@pytest.mark.parametrize("fold", ["1", "2:cta"])
def test_barrier_serves_many_launches_eager_and_graphed(fold):
    # the counters persist across launches (eager ones and a CUDA graph's replays, with fresh queries each
    # time): every launch must pass the barrier, read every CTA's rows and leave the count at zero
    case = Case([300, 20, 129, 7, 64, 65, 1, 500], [1] * 8, 16, 16, 128, torch.bfloat16, seed=7)
    wo = _weights(2048, 2048, torch.bfloat16, seed=8)
    res = Residual(8, 2048, torch.bfloat16, seed=8)
    barrier = torch.zeros(2, dtype=torch.int32, device="cuda")
    fold = parse_fold(fold)
    for _ in range(50):
        out = _fold(case, wo, barrier, DecodeConfig(), res, fold)
    _check(case, wo, res, out)
    graph, out = capture(lambda: _fold(case, wo, barrier, DecodeConfig(), res, fold))
    g = torch.Generator().manual_seed(9)
    for _ in range(20):
        fresh = torch.randn(case.q.shape, generator=g).to(case.q.dtype)
        case.q.copy_(fresh.cuda())
        case.q_ref = fresh.double()
        graph.replay()
        _check(case, wo, res, out, case.reference([300, 20, 129, 7, 64, 65, 1, 500]))
    torch.cuda.synchronize()
    passes = 2 if fold.norm else 1
    assert barrier[0].item() == 0 and barrier[1].item() == passes * (50 + 1 + 20)  # capture() runs it once first


def test_dispatch_folds_only_where_it_applies(monkeypatch):
    from engine import triton_attention

    monkeypatch.setenv(triton_attention.DECODE_ENV, "gluon")
    monkeypatch.setattr(triton_attention, "_GLUON", {})
    barrier = torch.zeros(2, dtype=torch.int32, device="cuda")
    wo = _weights(2048, 2048, torch.bfloat16, seed=10)
    eight = Case([40] * 8, [1] * 8, 16, 16, 128, torch.bfloat16, seed=11)
    res8, res4 = Residual(8, 2048, torch.bfloat16, seed=11), Residual(4, 2048, torch.bfloat16, seed=12)

    def call(case, res):
        return triton_attention.decode_attention_o(case.q, case.k, case.v, *case.args[:3], 1, case.scale, None, wo,
                                                   barrier, *res.dev, EPS)

    _check(eight, wo, res8, call(eight, res8))
    four = Case([40] * 4, [1] * 4, 16, 16, 128, torch.bfloat16, seed=12)  # 64 CTAs for 128 output tiles
    assert call(four, res4) is None
    monkeypatch.setenv(triton_attention.FOLD_ENV, "0")
    monkeypatch.setattr(triton_attention, "_GLUON", {})
    assert call(eight, res8) is None
    monkeypatch.setenv(triton_attention.FOLD_ENV, "yes")
    monkeypatch.setattr(triton_attention, "_GLUON", {})
    with pytest.raises(ValueError, match="OUROBATCH_DECODE_FOLD_O must be 0, 1 or 2"):
        triton_attention.gluon_decode(eight.q.device)


@pytest.fixture(scope="module")
def fold_ckpt(tmp_path_factory):
    # 8 heads of 128 and hidden 1024: 64 output tiles, so a decode call of 8 requests (64 CTAs, one key share
    # each: 64 pairs leave no SMs idle enough to split) folds o_proj
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fold") / "m", seed=4, eos_token_id=None, hidden_size=1024,
                                num_attention_heads=8, num_key_value_heads=8, head_dim=128, intermediate_size=2048,
                                vocab_size=97)


def test_engine_with_the_fold_agrees_with_the_engine_without(fold_ckpt, monkeypatch):
    from engine import gluon_attention_o, triton_attention

    def switch(value: str) -> None:
        monkeypatch.setenv(triton_attention.FOLD_ENV, value)
        monkeypatch.setattr(triton_attention, "_GLUON", {})

    outs = outputs_on_and_off(fold_ckpt, 8, monkeypatch, gluon_attention_o, "launch_decode_attention_o", switch)
    # o's float32 sums run in another order, so bf16 roundings differ now and then, and the tiny model's
    # loops amplify them (as in test_gpu.py's bf16 test)
    assert_bf16_agreement(outs["1"], outs["0"], min_agree=6)


def outputs_on_and_off(ckpt, requests: int, monkeypatch, module, launcher: str, switch) -> dict:
    """`requests` sampled requests through a bf16 SyncEngine of ckpt with switch("1"), then switch("0"): their
    outputs by value; `module.launcher`, the launch the switch turns on, must have served calls with "1" only."""
    prompts = [[1 + i, 2 + i, 3] for i in range(requests)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(requests)]
    outs, launches = {}, []
    real = getattr(module, launcher)
    monkeypatch.setattr(module, launcher, lambda *a, **k: launches.append(1) or real(*a, **k))
    for value in ("1", "0"):
        switch(value)
        cfg = EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", num_kv_blocks=128, max_num_seqs=8)
        with SyncEngine(cfg) as llm:
            outs[value] = llm.generate_batch(prompts, params)
        if value == "1":
            assert launches, f"{launcher} served the decode calls"
            seen = len(launches)
    assert len(launches) == seen  # none with it off
    return outs


def assert_bf16_agreement(outs_a, outs_b, min_agree: int) -> None:
    """Two engines' outputs of the same requests whose float32 sums run in another order: at least `min_agree`
    requests draw the same first 4 tokens (bf16 may flip a near-tie of a draw), and up to their first different
    token the log-probs agree closely on the first token and on average."""
    agree, first, diffs = 0, [], []
    for a, b in zip(outs_a, outs_b):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        agree += ta[:4] == tb[:4]
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        d = [abs(x - y) for x, y in zip(a.outputs[0].logprobs[:n], b.outputs[0].logprobs[:n])]
        first += d[:1]
        diffs += d
    assert agree >= min_agree, agree
    assert max(first) < 0.05 and sum(diffs) / len(diffs) < 0.05, (first, diffs)
