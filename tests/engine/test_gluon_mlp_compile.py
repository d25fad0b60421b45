"""engine/gluon_mlp.py's kernel (the decode step's MLP in one launch) compiled for sm90 on the CPU (where Triton is
installed: CI installs it). Its results are checked on the H200 (tests/gpu/test_gpu_gluon_mlp.py). Here: the shapes
the rule allows compile, load every weight box through TMA and SiLU x up's rows with cp.async, run the expected
MMAs, and fit the shared memory that mlp_dispatch.mlp_smem counts."""

from __future__ import annotations

import pytest

from engine.mlp_dispatch import HOPPER_SMEM_PER_CTA, MLP_WARPS, chunk_split, mlp_fold_applies, mlp_smem

pytest.importorskip("triton.experimental.gluon")


def compile_mlp(hidden: int, inter: int, dtype: str = "bf16", use_pdl: int = 1, stages: int = 8,
                warps: int = MLP_WARPS) -> dict:
    import torch

    from benchmarks.ws_chain import compile_sm90
    from engine.gluon_mlp import mlp_kernel, smem_layouts

    w_layout, x_layout, chunk_layout = smem_layouts({"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], hidden)
    box = f"tensordesc<{dtype}[16, 256],{w_layout!r}>"
    signature = {"wgu_desc": box, "wd_desc": box, "po_ptr": "*fp32", "h_ptr": f"*{dtype}", "wa_ptr": f"*{dtype}",
                 "wb_ptr": f"*{dtype}", "h_out_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "pd_ptr": "*fp32",
                 "bar_ptr": "*i32", "split_stride": "i32", "splits": "i32", "rows": "i32", "eps": "fp32"}
    constexprs = {"x_layout": x_layout, "chunk_layout": chunk_layout, "H": hidden, "I": inter,
                  "CHUNKS_A": chunk_split(inter)[0], "CHUNKS_B": chunk_split(inter)[1], "STAGES": stages,
                  "USE_PDL": use_pdl, "num_warps": warps}
    # the launcher specializes these as 16-byte aligned (torch's allocations)
    aligned = ("po_ptr", "h_ptr", "wa_ptr", "wb_ptr", "h_out_ptr", "act_ptr", "pd_ptr")
    return compile_sm90(mlp_kernel, signature, constexprs, aligned)


@pytest.mark.parametrize("hidden,inter,dtype", [(2048, 5632, "bf16"), (2048, 5632, "fp16"), (256, 512, "bf16"),
                                                (1024, 2816, "bf16")])
def test_mlp_compiles_with_its_loads_and_fits(hidden, inter, dtype):
    assert mlp_fold_applies(8, hidden, inter)
    built = compile_mlp(hidden, inter, dtype)
    # three box loads in the code (gate, up, down), each four 128-byte-wide TMA copies (the swizzle's span); the
    # compiler may peel a loop of one K step (hidden 256) into more copies of them
    assert built["tma_loads"] >= 3 * 4 and built["tma_loads"] % 4 == 0, built
    # SiLU x up's rows: per 256-column chunk of 8 rows (4 KB), 16-byte copies spread over the stager's lanes
    assert built["cp_async"] == (inter // 256) * 8 // MLP_WARPS, built
    # m16n8k16 over K: gate and up per hidden column, down per intermediate column
    assert built["mma"] == 2 * hidden // 16 + inter // 16, built
    assert mlp_smem(hidden, inter) <= built["shared"] <= min(mlp_smem(hidden, inter) + 1024, HOPPER_SMEM_PER_CTA), built


@pytest.mark.parametrize("warps", [4, 8])
def test_stager_warps(warps):
    built = compile_mlp(2048, 5632, warps=warps)
    assert built["cp_async"] == 22 * 8 // warps and built["mma"] == 2 * 2048 // 16 + 5632 // 16, built


def test_pdl_waits_only_with_pdl():
    assert compile_mlp(256, 512, use_pdl=1)["gdc_wait"] == 1
    assert compile_mlp(256, 512, use_pdl=0)["gdc_wait"] == 0
