"""engine/gluon_attention_o.py's kernel (decode attention with o_proj and its add + norm folded in) compiled for
sm90 on the CPU (where Triton is installed: CI installs it). Its results are checked on the H200
(tests/gpu/test_gpu_gluon_attention_o.py). Here: the rings the dispatch allows compile, load the o weights as
TMA boxes and the attention rows with cp.async, run the expected MMAs, and fit the shared memory that
attention_dispatch.o_fold_applies assumes."""

from __future__ import annotations

import pytest

from engine.attention_dispatch import HOPPER_SMEM_PER_CTA, DecodeConfig, FoldConfig, o_fold_applies, parse_fold

pytest.importorskip("triton.experimental.gluon")


def compile_fold(config: DecodeConfig, head_dim: int = 128, heads: int = 16, hidden: int = 2048,
                 use_pdl: int = 1, fold: FoldConfig = FoldConfig()) -> dict:
    from benchmarks.ws_chain import compile_sm90
    from engine.gluon_attention import smem_layout
    from engine.gluon_attention_o import decode_attention_o_kernel, smem_layouts

    page, K = 16, heads * head_dim
    w_layout, a_layout = smem_layouts(8, K)
    box = f"tensordesc<bf16[{page}, {head_dim}],{smem_layout()!r}>"
    signature = {"k_desc": box, "v_desc": box, "wo_desc": f"tensordesc<bf16[16, 256],{w_layout!r}>",
                 "q_ptr": "*bf16", "o_ptr": "*bf16", "po_ptr": "*fp32", "bar_ptr": "*i32", "block_tables_ptr": "*i32",
                 "context_lens_ptr": "*i32", "query_start_ptr": "*i32", "h_ptr": "*bf16", "wa_ptr": "*bf16",
                 "wb_ptr": "*bf16", "h_out_ptr": "*bf16", "x_out_ptr": "*bf16", **{name: "i32" for name in (
                     "stride_q_row", "stride_q_head", "stride_o_head", "stride_bt")},
                 "qk_scale": "fp32", "kv_heads": "i32", "rows": "i32", "eps": "fp32"}
    constexprs = {"a_layout": a_layout, "PAGE": page, "HEAD_DIM": head_dim, "BLOCK_N": config.block_n,
                  "STAGES": config.stages, "USE_PDL": use_pdl, "TILES": hidden // 16, "K": K, "BM": 8,
                  "BLOCK_H": hidden, "NORM": fold.norm, "STAGER": fold.stager}
    # the launcher specializes these as 16-byte aligned (torch's allocations)
    aligned = ("q_ptr", "o_ptr", "po_ptr", "h_ptr", "wa_ptr", "wb_ptr", "h_out_ptr", "x_out_ptr")
    return compile_sm90(decode_attention_o_kernel, signature, constexprs, aligned)


@pytest.mark.parametrize("config", [DecodeConfig(32, 6), DecodeConfig(64, 3), DecodeConfig(16, 4)],
                         ids=lambda c: f"n{c.block_n}s{c.stages}")
@pytest.mark.parametrize("fold", ["1", "1:cta", "2", "2:warp"])
def test_fold_compiles_with_its_loads_and_fits(config, fold):
    assert o_fold_applies(config, 8, 8, 16, 128, 2048, 132)
    fold = parse_fold(fold)
    built = compile_fold(config, fold=fold)
    # K / V: a box per page of a slot; o: 8 boxes of 16 x 256, each four 128-byte-wide TMA copies (the swizzle's span)
    assert built["tma_loads"] == 2 * (config.block_n // 16) + 8 * 4, built
    # 8 rows x 2048 staged: by one warp 64 16-byte copies per lane, by 4 warps 16
    assert built["cp_async"] == (16 if fold.stager else 64), built
    assert built["mma"] == 2048 // 16  # m16n8k16 over K = 2048: one output tile of 16 columns x 8 rows
    ring = 2 * config.stages * config.block_n * 128 * 2
    assert ring + 24 * 2048 * 2 <= built["shared"] <= HOPPER_SMEM_PER_CTA, built


def test_smaller_heads_compile():
    built = compile_fold(DecodeConfig(32, 6), head_dim=64, heads=4, hidden=512)
    assert built["mma"] == 256 // 16 and built["shared"] <= HOPPER_SMEM_PER_CTA, built


def test_pdl_waits_only_with_pdl():
    assert compile_fold(DecodeConfig(), use_pdl=1)["gdc_wait"] == 2
    assert compile_fold(DecodeConfig(), use_pdl=0)["gdc_wait"] == 0

