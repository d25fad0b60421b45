"""The skinny-batch GEMMs of engine/triton_gemm.py against the cuBLAS path they replace (`pytest -m gpu`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from engine import gemm_dispatch
from engine.gemm_dispatch import GemmConfig
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


CONFIGS = [GemmConfig(), GemmConfig(block_n=32, block_k=64, splits_o=1, splits_down=8, block_n_gate=16),
           GemmConfig(block_n=32, block_k=64, splits_o=8), *(cfg for _, cfg in gemm_dispatch.GEMM_TABLE),
           # TMA loads (GemmConfig.tma): the weights, then the activations too
           GemmConfig(tma=1), GemmConfig(block_n=32, block_k=64, splits_o=8, block_n_gate=16, tma=2),
           *(dataclasses.replace(cfg, tma=2) for _, cfg in gemm_dispatch.GEMM_TABLE),
           # gate_up's own K step (step_profile.py --gemm tiles64's candidate)
           GemmConfig(block_n=32, block_k=256, splits_o=2, splits_down=2, block_n_gate=32, block_k_gate=64, tma=2)]


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 100])
@pytest.mark.parametrize("hidden,inter,kdim", [(2048, 5632, 2048), (64, 128, 128), (96, 200, 72)])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_fused_gemms_match_the_cublas_path(rows, hidden, inter, kdim, cfg):
    from engine import triton_fused as fused
    from engine import triton_gemm as tg

    g = torch.Generator(device="cuda").manual_seed(rows * 7 + hidden)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, generator=g, **bf)
    a = torch.randn(rows, kdim, generator=g, **bf)
    h = torch.randn(rows, hidden, generator=g, **bf)
    w_gu = torch.randn(2 * inter, hidden, generator=g, **bf) / hidden**0.5
    w_o = torch.randn(hidden, kdim, generator=g, **bf) / kdim**0.5
    wa, wb = (1 + 0.2 * torch.randn(hidden, generator=g, **bf) for _ in range(2))
    ref_m = fused.silu_mul(F.linear(x, w_gu))
    got_m = tg.gate_up_silu(x, w_gu, cfg)
    assert got_m.shape == ref_m.shape and rel_err(got_m, ref_m) < 1e-2
    for splits in (1, cfg.splits_o, cfg.splits_down):
        partials = tg.linear_partials(a, w_o, splits, cfg)
        assert partials.shape == (splits, rows, hidden)
        # the fp32 sum against a float64 GEMM: only the accumulation order differs
        exact = a.double() @ w_o.double().T
        assert rel_err(partials.sum(0), exact) < 1e-5
        ref_h, ref_x = fused.add_rms_norm2(h, F.linear(a, w_o), wa, wb, 1e-6)
        got_h, got_x = tg.add_rms_norm2_partials(h, partials, wa, wb, 1e-6)
        assert rel_err(got_h, ref_h) < 1e-2 and rel_err(got_x, ref_x) < 1e-2


# block_k 256 only at <= 16 rows (a 16-row tile), as the table has it: a 64-row tile's 4 stages of 256-wide
# blocks need 256 KiB of shared memory, more than the H200's 227
def qkv_inputs(rows: int, Hq: int, Hkv: int, d: int, hidden: int, seed: int) -> tuple:
    """Random bf16 x [rows, hidden] and w [(Hq + 2 Hkv) d, hidden], positions, distinct slots, inv_freq, slot count."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, generator=g, **bf)
    w = torch.randn((Hq + 2 * Hkv) * d, hidden, generator=g, **bf) / hidden**0.5
    n_slots = 3 * rows + 16
    pos = torch.randint(0, 8000, (rows,), generator=g, device="cuda")
    slots = torch.randperm(n_slots, generator=g, device="cuda")[:rows]
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    return x, w, pos, slots, inv_freq, n_slots


QKV_CASES = [(rows, *cfg) for rows in (1, 5, 16, 33, 64, 100)
             for cfg in [(16, 128), (32, 128), (64, 128)] + [(32, 256)] * (rows <= 16)]


@pytest.mark.parametrize("tma", [0, 1, 2])
@pytest.mark.parametrize("Hq,Hkv,d,hidden", [(16, 16, 128, 2048), (4, 2, 64, 256), (8, 1, 32, 96)])
@pytest.mark.parametrize("rows,block_d,block_k", QKV_CASES)
def test_qkv_rope_store_matches_the_cublas_path(rows, Hq, Hkv, d, hidden, block_d, block_k, tma):
    from engine import triton_fused as fused
    from engine import triton_gemm as tg

    assert gemm_dispatch.qkv_block_d(GemmConfig(block_d_qkv=block_d), d)  # capped at the half head: always a tile
    x, w, pos, slots, inv_freq, n_slots = qkv_inputs(rows, Hq, Hkv, d, hidden, rows * 11 + d + block_d)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    planes = {name: torch.zeros(n_slots, Hkv, d, **bf) for name in ("k_ref", "v_ref", "k", "v")}
    ref = fused.rope_store_kv(F.linear(x, w), pos, slots, inv_freq, planes["k_ref"], planes["v_ref"], Hq, Hkv, d)
    got = tg.qkv_rope_store(x, w, pos, slots, inv_freq, planes["k"], planes["v"], Hq, Hkv, d,
                            GemmConfig(block_d_qkv=block_d, block_k_qkv=block_k, tma=tma))
    assert rel_err(got, ref) < 1e-2
    assert rel_err(planes["k"][slots], planes["k_ref"][slots]) < 1e-2
    assert rel_err(planes["v"][slots], planes["v_ref"][slots]) < 1e-2
    rest = torch.ones(n_slots, dtype=torch.bool, device="cuda")
    rest[slots] = False
    assert not planes["k"][rest].any() and not planes["v"][rest].any()


@pytest.mark.parametrize("rows,splits", [(64, 4), (9, 2), (100, 8)])
def test_linear_partials_into_slices_of_one_buffer_equal_the_call_alone(rows, splits):
    """Two calls over the two halves of K writing into the halves of one partials buffer (head_split_probe's use)
    give, where their K splits meet at the halves, the one call's partials to the bit; a wrong `out` is refused."""
    from engine import triton_gemm as tg

    cfg, k, n = dataclasses.replace(gemm_dispatch.GEMM_TABLE[-1][1], splits_o=splits), 2048, 1024
    g = torch.Generator(device="cuda").manual_seed(rows + splits)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    whole = tg.linear_partials(x, w, splits, cfg)
    part = torch.full((splits, rows, n), float("nan"), device="cuda")
    half = k // 2
    for j in range(2):
        tg.linear_partials(x[:, j * half:(j + 1) * half].contiguous(), w[:, j * half:(j + 1) * half].contiguous(),
                           splits // 2, cfg, part[j * splits // 2:(j + 1) * splits // 2])
    assert torch.equal(part, whole)
    torch.testing.assert_close(part.sum(0), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for bad in (torch.empty(splits, rows, n + 1, device="cuda"), torch.empty(splits, rows, n, device="cuda").half(),
                torch.empty(splits, n, rows, device="cuda").transpose(1, 2)):
        with pytest.raises(ValueError, match="out must be a contiguous float32"):
            tg.linear_partials(x, w, splits, cfg, bad)


def test_engine_with_the_fused_gemms_agrees_with_cublas(tmp_path, monkeypatch):
    ckpt = make_tiny_checkpoint(tmp_path / "m", seed=5, eos_token_id=None, hidden_size=256, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, intermediate_size=704, vocab_size=301)
    prompts = [[(7 * i + j) % 301 for j in range(3 + 5 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True) for _ in prompts]
    outs = {}
    stream = GemmConfig(block_d_qkv=32, tma=2, stream_gate=True, stream_qkv=True)  # engine/triton_streamk.py
    tables = (("triton", ((64, GemmConfig()),)), ("triton_qkv", ((64, GemmConfig(block_d_qkv=32)),)),
              ("triton_tma", ((64, GemmConfig(block_d_qkv=32, tma=2)),)), ("triton_stream", ((64, stream),)),
              ("cublas", ()))
    for name, table in tables:
        monkeypatch.setattr(gemm_dispatch, "GEMM_TABLE", table)
        cfg = EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", deep_interval=4, num_kv_blocks=256,
                           max_num_seqs=8, logprobs_mode="raw")
        with SyncEngine(cfg) as llm:
            outs[name] = llm.generate_batch(prompts, params)
    for a, b in [pair for name in ("triton", "triton_qkv", "triton_tma", "triton_stream")
                 for pair in zip(outs[name], outs["cublas"])]:
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (p, q) in enumerate(zip(ta, tb)) if p != q), len(ta))
        assert n >= 3, (ta, tb)  # bf16 rounding may flip a near-tie late, never from the start
        diffs = [abs(p - q) for p, q in zip(a.outputs[0].logprobs[:n], b.outputs[0].logprobs[:n])]
        assert max(diffs) < 0.05, diffs
