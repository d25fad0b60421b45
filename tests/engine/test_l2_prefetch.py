"""engine/l2_prefetch.py: what is asked for, by whom, and where the bulk prefetch sits in the sm90 PTX of the
two kernels that issue it (compiled on the CPU where Triton is installed; CI has none). That turning it on
changes no result is checked on the H200 (tests/gpu/test_gpu_gemm.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import gemm_dispatch, l2_prefetch
from engine.l2_prefetch import Prefetch, next_layer_prefetch


def test_args_clamp_k_to_the_row_and_count_bytes():
    w = torch.zeros(96, 64, dtype=torch.bfloat16)
    assert Prefetch(w, 32).args()[1:] == (96, 64, 64)  # rows, stride, bytes
    assert Prefetch(w, 1000).args()[1:] == (96, 64, 128)  # whole rows at most
    assert Prefetch(w, 0).args()[1] == 0


@pytest.mark.parametrize("shape,k", [((96, 60), 60), ((96, 64), 4)])
def test_unaligned_rows_or_sizes_prefetch_nothing(shape, k):
    # a row stride of 120 bytes, or 8 bytes asked per row: the bulk prefetch needs 16-byte multiples
    assert Prefetch(torch.zeros(shape, dtype=torch.bfloat16), k).args()[1] == 0


def test_a_column_slice_prefetches_nothing():
    w = torch.zeros(64, 128, dtype=torch.bfloat16)[:, :64]  # rows are still 16-byte aligned; stride(-1) == 1
    assert Prefetch(w, 64).args()[1:] == (64, 128, 128)
    assert Prefetch(w.t(), 8).args()[1] == 0  # column-major: no contiguous row


def test_kernel_args_on_cpu_are_off():
    w = torch.zeros(16, 16, dtype=torch.bfloat16)
    args = l2_prefetch.kernel_args(Prefetch(w, 16), w)
    assert args["PREFETCH"] is False and args["pf_rows"] == 0


def _layers(n):
    return [SimpleNamespace(self_attn=SimpleNamespace(qkv_weight=torch.full((1,), float(i)))) for i in range(n)]


def test_the_add_norm_after_down_proj_prefetches_the_layer_that_runs_next():
    layers = _layers(3)
    assert next_layer_prefetch(layers, 0, 1, 3, 64).weight is layers[1].self_attn.qkv_weight
    assert next_layer_prefetch(layers, 2, 1, 3, 64).weight is layers[0].self_attn.qkv_weight  # the next loop
    assert next_layer_prefetch(layers, 2, 3, 3, 64) is None  # after the last loop: the readout
    assert next_layer_prefetch(layers, 0, 1, 3, 0) is None


def test_the_table_rows_name_valid_amounts():
    for _, cfg in gemm_dispatch.GEMM_TABLE:
        assert cfg.prefetch_k_gate_up >= 0 and cfg.prefetch_k_qkv >= 0 and isinstance(cfg.prefetch_o, bool)


# ------------------------------------------------------------------------------------- sm90 PTX on the CPU

def _ptx(kernel, types: dict, constexprs: dict) -> list[str]:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**types, **{k: "constexpr" for k in constexprs}}
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]  # ptxas accepted it
    return [line.strip() for line in compiled.asm["ptx"].splitlines()]


B, F, I = "*bf16", "*fp32", "i32"


def _norm_ptx(prefetch: bool) -> list[str]:
    pytest.importorskip("triton")
    from engine import triton_gemm

    types = dict(h_ptr=B, p_ptr=F, wa_ptr=B, wb_ptr=B, h_out_ptr=B, x_out_ptr=B, rows=I, n_cols=I, eps="fp32",
                 pf_ptr=B, pf_rows=I, pf_stride=I, pf_bytes=I)
    return _ptx(triton_gemm._add_rms_norm2_partials_kernel, types,
                dict(SPLITS=4, BLOCK=2048, USE_PDL=True, PREFETCH=prefetch, PF_BLOCK=256))


def _combine_ptx(prefetch: bool) -> list[str]:
    pytest.importorskip("triton")
    from engine import triton_attention

    types = dict(part_ptr=F, lse_ptr=F, o_ptr=B, num_splits=I, stride_p_split=I, stride_p_row=I, stride_p_head=I,
                 stride_lse_split=I, stride_lse_row=I, stride_o_row=I, stride_o_head=I, pf_ptr=B, pf_rows=I,
                 pf_stride=I, pf_bytes=I)
    return _ptx(triton_attention._combine_kernel, types,
                dict(HEAD_DIM=128, SPLITS_P2=4, USE_PDL=True, PREFETCH=prefetch))


def _index(lines, token):
    return [i for i, line in enumerate(lines) if token in line]


def test_the_combine_asks_before_it_waits():
    lines = _combine_ptx(True)
    prefetches, waits = _index(lines, "cp.async.bulk.prefetch.L2.global"), _index(lines, "griddepcontrol.wait")
    loads = _index(lines, "ld.global")
    assert prefetches and waits and max(prefetches) < waits[0] < loads[0]


def test_the_add_norm_prefetches_only_in_programs_that_never_wait():
    lines = _norm_ptx(True)
    prefetches, waits = _index(lines, "cp.async.bulk.prefetch.L2.global"), _index(lines, "griddepcontrol.wait")
    assert prefetches and len(waits) == 1
    assert max(prefetches) < waits[0] or min(prefetches) > waits[0]  # two branches: never one after the other


@pytest.mark.parametrize("ptx", [_norm_ptx, _combine_ptx])
def test_no_prefetch_when_off(ptx):
    assert not _index(ptx(False), "cp.async.bulk.prefetch")
