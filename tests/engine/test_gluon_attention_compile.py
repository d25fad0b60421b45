"""engine/gluon_attention.py's decode kernel compiled for sm90 on the CPU (Triton builds the PTX, ptxas the
cubin; where Triton is installed: CI installs it). Triton's interpreter cannot run Gluon, so its results are
checked on the H200 (tests/gpu/test_gpu_gluon_attention.py). Here: every ring shape the benchmarks and the
dispatch use compiles, loads its pages as TMA boxes (one K and one V box per page of a slot), fits the H200's
shared memory, and waits for the kernel before (griddepcontrol.wait) only when launched with PDL."""

from __future__ import annotations

import pytest

from engine.attention_dispatch import DecodeConfig, decode_config

pytest.importorskip("triton.experimental.gluon")

H200_SHARED = 232448  # bytes of shared memory one CTA may use on the H200 (sm90)


def compile_decode(config: DecodeConfig, page: int = 16, head_dim: int = 128, use_pdl: int = 1) -> dict:
    from benchmarks.ws_chain import compile_sm90
    from engine.gluon_attention import decode_attention_kernel, smem_layout

    box = f"tensordesc<bf16[{page}, {head_dim}],{smem_layout()!r}>"
    split = config.splits > 1
    signature = {"k_desc": box, "v_desc": box, "q_ptr": "*bf16", "o_ptr": "*fp32" if split else "*bf16",
                 "lse_ptr": "*fp32", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
                 "query_start_ptr": "*i32", **{name: "i32" for name in (
                     "stride_q_row", "stride_q_head", "stride_o_split", "stride_o_row", "stride_o_head",
                     "stride_lse_split", "stride_lse_row", "stride_bt")}, "qk_scale": "fp32", "kv_heads": "i32",
                 "items": "i32"}
    constexprs = {"PAGE": page, "HEAD_DIM": head_dim, "BLOCK_N": config.block_n, "STAGES": config.stages,
                  "SPLIT": split, "USE_PDL": use_pdl, "PERSIST": config.ctas_per_sm > 0}
    return compile_sm90(decode_attention_kernel, signature, constexprs, ())


@pytest.mark.parametrize("config", [DecodeConfig(32, 6, 1), DecodeConfig(64, 3, 4), DecodeConfig(16, 12, 1),
                                    DecodeConfig(32, 3, 2), decode_config(8, 16, 132),
                                    DecodeConfig(32, 6, ctas_per_sm=2), DecodeConfig(32, 3, ctas_per_sm=1)],
                         ids=lambda c: f"n{c.block_n}s{c.stages}k{c.splits}p{c.ctas_per_sm}")
def test_ring_shapes_compile_with_tma_pages_and_fit(config):
    built = compile_decode(config)
    assert built["cubin_bytes"] > 0 and built["mma"] == 0 and built["cp_async"] == 0
    # a K and a V box per page of a slot, written once in the kernel (static loop over the slot's pages)
    assert built["tma_loads"] == 2 * (config.block_n // 16), built
    ring = 2 * config.stages * config.block_n * 128 * 2
    assert ring <= built["shared"] <= H200_SHARED, built


@pytest.mark.parametrize("page,head_dim", [(16, 64), (32, 128), (16, 256)])
def test_other_pages_and_head_sizes_compile(page, head_dim):
    config = DecodeConfig(max(32, page), 4, 1)
    built = compile_decode(config, page, head_dim)
    assert built["tma_loads"] == 2 * (config.block_n // page) and built["shared"] <= H200_SHARED, built


def test_the_pdl_wait_is_compiled_in_only_with_pdl():
    # with PDL: the loader's wait before the new row's tile (or, USE_PDL 2, before its first) and the
    # consumer's before the query row
    assert compile_decode(DecodeConfig(), use_pdl=1)["gdc_wait"] == 2
    assert compile_decode(DecodeConfig(), use_pdl=2)["gdc_wait"] == 2
    assert compile_decode(DecodeConfig(), use_pdl=0)["gdc_wait"] == 0
