"""The add + norm carried into the 64-row GEMMs (engine/triton_norm_gemm.py) against the kernels path it replaces:
o_proj's (or down_proj's) split-K partials, the add + norm kernel, then gate_up + SiLU or qkv + RoPE + store
(`pytest -m gpu`); and an engine with OUROBATCH_CARRY_NORM=1 against one with it off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import gemm_dispatch
from engine.gemm_dispatch import GemmConfig
from ourobatch import EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint
from tests.gpu.test_gpu_gemm import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CARRY = [GemmConfig(block_n=64, block_n_gate=64, block_d_qkv=16, tma=2, carry_norm=True),
         GemmConfig(block_n=64, block_n_gate=64, block_d_qkv=16, tma=2, carry_norm=True, carry_block_k=256,
                    carry_stages=3),
         GemmConfig(block_n=64, block_n_gate=32, block_d_qkv=32, tma=2, carry_norm=True, carry_block_n=32)]


@pytest.mark.parametrize("rows", [1, 9, 40, 64])
@pytest.mark.parametrize("hidden,inter,kdim,heads", [(2048, 5632, 2048, 16), (256, 512, 512, 2)])
@pytest.mark.parametrize("cfg", CARRY)
def test_the_carried_add_norm_matches_the_kernels_path(rows, hidden, inter, kdim, heads, cfg):
    from engine import triton_gemm as tg
    from engine import triton_norm_gemm as tn
    from engine.pending_norm import carries

    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a, h = torch.randn(rows, kdim, generator=g, **bf), torch.randn(rows, hidden, generator=g, **bf)
    w_o = torch.randn(hidden, kdim, generator=g, **bf) / kdim**0.5
    wa, wb = (1 + 0.2 * torch.randn(hidden, generator=g, **bf) for _ in range(2))
    w_gu = torch.randn(2 * inter, hidden, generator=g, **bf) / hidden**0.5
    w_qkv = torch.randn(3 * heads * 128, hidden, generator=g, **bf) / hidden**0.5
    assert carries(cfg, h, w_o)
    ref_h, ref_x = tg.add_rms_norm2_partials(h, tg.linear_partials(a, w_o, cfg.splits_o, cfg), wa, wb, 1e-6)
    for _ in range(2):  # a second launch on the same buffers: nothing left over from the first
        pending = tn.linear_stats(a, w_o, h, wa, wb, 1e-6, cfg)
        m, got_h = tn.gate_up_silu_normed(pending, w_gu, cfg)
        assert rel_err(got_h, ref_h) < 1e-2 and rel_err(m, tg.gate_up_silu(ref_x, w_gu, cfg)) < 2e-2
    resolved_h, resolved_x = pending.resolve()
    assert rel_err(resolved_h, ref_h) < 1e-2 and rel_err(resolved_x, ref_x) < 1e-2
    pos = torch.randint(0, 4000, (rows,), generator=g, device="cuda")
    slots = torch.randperm(3 * rows, generator=g, device="cuda")[:rows]
    inv_freq = 10000.0 ** (-torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128)
    planes = {n: torch.zeros(3 * rows, heads, 128, **bf) for n in ("k_ref", "v_ref", "k", "v")}
    q_ref = tg.qkv_rope_store(ref_x, w_qkv, pos, slots, inv_freq, planes["k_ref"], planes["v_ref"], heads, heads,
                              128, cfg)
    q, got_h = tn.qkv_rope_store_normed(pending, w_qkv, pos, slots, inv_freq, planes["k"], planes["v"], heads,
                                        heads, 128, cfg)
    assert rel_err(q, q_ref) < 2e-2 and rel_err(got_h, ref_h) < 1e-2
    assert rel_err(planes["k"][slots], planes["k_ref"][slots]) < 2e-2
    assert rel_err(planes["v"][slots], planes["v_ref"][slots]) < 2e-2


def test_an_engine_carrying_the_add_norm_agrees_with_one_that_does_not(tmp_path, monkeypatch):
    ckpt = make_tiny_checkpoint(tmp_path / "m", seed=9, eos_token_id=None, hidden_size=256, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=128, intermediate_size=512, vocab_size=301)
    prompts = [[(5 * i + j) % 301 for j in range(4 + 7 * i)] for i in range(40)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True) for _ in prompts]
    base = dict(gemm_dispatch.GEMM_TABLE)[64]
    outs = {}
    for carry in (False, True):
        monkeypatch.setattr(gemm_dispatch, "GEMM_TABLE", ((64, dataclasses.replace(base, carry_norm=carry)),))
        cfg = EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", deep_interval=1, num_kv_blocks=512,
                           max_num_seqs=64, logprobs_mode="raw")
        with SyncEngine(cfg) as llm:
            outs[carry] = llm.generate_batch(prompts, params)
    for a, b in zip(outs[True], outs[False]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (p, q) in enumerate(zip(ta, tb)) if p != q), len(ta))
        assert n >= 3, (ta, tb)  # bf16 rounding may flip a near-tie late, never from the start
        diffs = [abs(p - q) for p, q in zip(a.outputs[0].logprobs[:n], b.outputs[0].logprobs[:n])]
        assert max(diffs) < 0.05, diffs
