"""engine/gluon_layers.py's loop-pass kernel compiled for sm90 on the CPU (where Triton is installed: CI installs
it). Its results are checked on the H200 (tests/gpu/test_gpu_gluon_layers.py). Here: the shapes the rule
allows compile, stream weights and key / value pages through TMA, run the expected MMAs, wait for the kernel
before only with PDL, and fit the shared memory layers_dispatch.smem_bytes counts."""

from __future__ import annotations

import pytest

from engine import layers_dispatch as ld

pytest.importorskip("triton.experimental.gluon")


def compile_layers(hidden: int = 2048, inter: int = 5632, use_pdl: int = 1, trace: int = 0) -> dict:
    from triton.experimental.gluon import language as gl

    from benchmarks.ws_chain import compile_sm90
    from engine.gluon_layers import layers_kernel

    w_layout = gl.NVMMASharedLayout.get_default_for([ld.BLOCK_N, ld.BLOCK_K], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    x_layout = gl.NVMMASharedLayout.get_default_for([ld.ROWS, ld.BLOCK_K], gl.bfloat16)
    box = f"tensordesc<bf16[{ld.BLOCK_N}, {ld.BLOCK_K}],{w_layout!r}>"
    page = f"tensordesc<bf16[{ld.PAGE}, {ld.HEAD_DIM}],{kv_layout!r}>"
    signature = {n: box for n in ("wq", "wo", "wgu", "wd")}
    signature.update(k_desc=page, v_desc=page)
    bf16 = ("h_in_ptr", "out_ptr", "k_ptr", "v_ptr", "hq_ptr", "hm_ptr", "qkv_ptr", "attn_ptr", "o_ptr", "act_ptr",
            "d_ptr", "n_in", "n_in2", "n_post", "n_post2", "n_final")
    signature.update({n: "*bf16" for n in bf16})
    signature.update(inv_freq_ptr="*fp32", pos_ptr="*i64", slots_ptr="*i64", tables_ptr="*i32", stride_bt="i32",
                     ctx_ptr="*i32", cnt_ptr="*i32", sums_ptr="*fp32", trace_ptr="*i64", num_layers="i32", M="i32",
                     layer_rows="i32", eps="fp32", qk_scale="fp32")
    heads = hidden // ld.HEAD_DIM
    constexprs = {"H": hidden, "QKV": 3 * hidden, "INTER": inter, "HEADS": heads, "D": ld.HEAD_DIM, "PAGE": ld.PAGE,
                  "XCHUNKS": ld.staged_chunks(hidden, inter), "x_layout": x_layout, "STAGES": ld.STAGES,
                  "USE_PDL": use_pdl, "TRACE": trace, "num_warps": 4}
    return compile_sm90(layers_kernel, signature, constexprs, bf16 + ("inv_freq_ptr", "pos_ptr", "slots_ptr",
                                                                       "tables_ptr", "ctx_ptr", "cnt_ptr", "sums_ptr",
                                                                       "trace_ptr"))


@pytest.mark.parametrize("hidden,inter", [(2048, 5632), (1024, 2816)])
def test_the_kernel_compiles_streams_through_tma_and_fits(hidden, inter):
    assert ld.shape_fits(hidden, inter, hidden // 128, hidden // 128, 128, 16, 132)
    built = compile_layers(hidden, inter)
    assert built["tma_loads"] > 0 and built["mma"] > 0, built
    # smem_bytes bounds what the kernel takes (the ring and staging buffer exactly, the rest within its 4 KB)
    assert ld.smem_bytes(hidden, inter) - 4096 <= built["shared"] <= ld.smem_bytes(hidden, inter), built
    assert built["shared"] <= ld.HOPPER_SMEM_PER_CTA


def test_the_measuring_build_stamps_and_the_engine_build_does_not():
    assert compile_layers(trace=1)["globaltimer"] > 0
    assert compile_layers()["globaltimer"] == 0


def test_the_rows_are_not_specialized():
    # kernel_cases.layers_keys compiles one kernel for 1-8 requests: Triton must not key M (== 1) apart
    from engine.gluon_layers import layers_kernel

    kept = {p.name: p.do_not_specialize for p in layers_kernel.params}
    assert kept["M"] and not kept["num_layers"]


def test_pdl_waits_only_with_pdl():
    assert compile_layers(use_pdl=1)["gdc_wait"] >= 2  # the stager before the loop's input, the loader before meta
    assert compile_layers(use_pdl=0)["gdc_wait"] == 0


def test_the_launch_builds_the_layouts_the_kernel_is_compiled_for():
    # launch_layers takes its weight-box and page layouts from gluon_mlp and gluon_attention, its staged chunk's
    # from X_LAYOUT: they must be the ones compile_layers names above
    from triton.experimental.gluon import language as gl

    import torch

    from engine.gluon_attention import smem_layout
    from engine.gluon_layers import X_LAYOUT
    from engine.gluon_mlp import smem_layouts

    assert smem_layouts(torch.bfloat16, ld.BLOCK_K)[0] == gl.NVMMASharedLayout.get_default_for(
        [ld.BLOCK_N, ld.BLOCK_K], gl.bfloat16)
    assert smem_layout() == gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    assert X_LAYOUT == gl.NVMMASharedLayout.get_default_for([ld.ROWS, ld.BLOCK_K], gl.bfloat16)
