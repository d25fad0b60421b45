"""The skinny GEMMs' PDL prologue (engine/triton_gemm.py, engine/pdl.py) compiled for sm90 on the CPU: Triton
builds the PTX and ptxas the cubin without a GPU (where Triton is installed; CI has none). With PREFETCH
each program issues its weight rows' bulk L2 prefetches before ``griddepcontrol.wait``, and only then
loads; without it, or without PDL, there is no prefetch at all. The kernels' results with PDL on are
compared with the torch references on the H200 (tests/gpu/test_gpu_gemm.py under OUROBATCH_PDL=1)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import triton_gemm  # noqa: E402

PTR_BF16, PTR_F32, PTR_I32, I32 = "*bf16", "*fp32", "*i32", "i32"

# (kernel, runtime arguments' types, constexprs) at the Ouro-1.4B decode shapes
KERNELS = {
    "linear_partials": (triton_gemm._linear_partials_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, out_ptr=PTR_F32, M=I32, N=I32, K=I32, k_per_split=I32, stride_xm=I32,
        stride_wn=I32), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)),
    "gate_up_silu": (triton_gemm._gate_up_silu_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, out_ptr=PTR_BF16, M=I32, N=I32, K=I32, stride_xm=I32, stride_wn=I32),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)),
    "qkv_rope_store": (triton_gemm._qkv_rope_store_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, pos_ptr=PTR_I32, slot_ptr=PTR_I32, inv_freq_ptr=PTR_F32, q_ptr=PTR_BF16,
        k_cache_ptr=PTR_BF16, v_cache_ptr=PTR_BF16, M=I32, K=I32, stride_xm=I32, stride_wn=I32, n_q_heads=I32,
        n_kv_heads=I32, stride_slot=I32, stride_head=I32), dict(HALF=64, BLOCK_M=16, BLOCK_D=32, BLOCK_K=128)),
}


def _ptx(name: str, use_pdl: bool, prefetch: bool) -> list[str]:
    fn, types, constexprs = KERNELS[name]
    constexprs = {**constexprs, "USE_PDL": use_pdl, "PREFETCH": prefetch}
    signature = {**types, **{k: "constexpr" for k in constexprs}}
    names = list(signature)  # as at the decode shapes, Triton knows the pointers and K, N, strides are 16-aligned
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in types.items()
             if t.startswith("*") or n in ("N", "K", "k_per_split") or n.startswith("stride")}
    compiled = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]  # ptxas accepted it
    return [line.strip() for line in compiled.asm["ptx"].splitlines()]


def _first(lines: list[str], token: str) -> int:
    return next((i for i, line in enumerate(lines) if token in line), -1)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_prefetch_comes_before_the_wait_and_the_loads(name):
    lines = _ptx(name, use_pdl=True, prefetch=True)
    prefetch, wait = _first(lines, "cp.async.bulk.prefetch.L2.global"), _first(lines, "griddepcontrol.wait")
    launch = _first(lines, "griddepcontrol.launch_dependents")
    loads = [i for i, line in enumerate(lines) if "ld.global" in line or "cp.async.c" in line]  # maybe predicated
    assert loads
    assert 0 <= prefetch < wait < launch, (prefetch, wait, launch)
    assert wait < loads[0]  # nothing the kernel before writes is read before the wait


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_no_prefetch_without_it(name):
    with_pdl = _ptx(name, use_pdl=True, prefetch=False)
    assert _first(with_pdl, "griddepcontrol.wait") >= 0
    assert _first(with_pdl, "prefetch") < 0
    plain = _ptx(name, use_pdl=False, prefetch=False)
    assert _first(plain, "griddepcontrol") < 0 and _first(plain, "prefetch") < 0

