"""The PDL prologue of the decode step's Triton kernels (engine/pdl.py), compiled for sm90 on the CPU: Triton
builds the PTX and ptxas the cubin without a GPU (where Triton is installed; CI installs it). With USE_PDL a
kernel waits (``griddepcontrol.wait``) before its first global load, and lets the next kernel launch only
after that; without it there is no griddepcontrol at all. The kernels' results with PDL on are compared
with the torch references on the H200 (tests/gpu/test_gpu_gemm.py, test_gpu_attention_kernels.py)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import triton_gemm, triton_streamk  # noqa: E402

PTR_BF16, PTR_F32, PTR_I32, I32 = "*bf16", "*fp32", "*i32", "i32"

STREAM_K = dict(x_ptr=PTR_BF16, w_ptr=PTR_BF16, out_ptr=PTR_BF16, part_ptr=PTR_F32, flag_ptr=PTR_I32, M=I32, N=I32,
                K=I32, n_tiles=I32, stride_xm=I32, stride_wn=I32, pos_ptr=PTR_I32, slot_ptr=PTR_I32,
                inv_freq_ptr=PTR_F32, k_cache_ptr=PTR_BF16, v_cache_ptr=PTR_BF16, n_q_heads=I32, n_kv_heads=I32,
                stride_slot=I32, stride_head=I32)

# (kernel, runtime arguments' types, constexprs) at the Ouro-1.4B decode shapes
KERNELS = {
    "linear_partials": (triton_gemm._linear_partials_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, out_ptr=PTR_F32, M=I32, N=I32, K=I32, k_per_split=I32, stride_xm=I32,
        stride_wn=I32), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)),
    "gate_up_silu": (triton_gemm._gate_up_silu_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, out_ptr=PTR_BF16, M=I32, N=I32, K=I32, stride_xm=I32, stride_wn=I32),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)),
    "gate_up_silu_stream": (triton_streamk._stream_k_kernel, STREAM_K, dict(HALF=64, BLOCK_M=64, BLOCK_N=64,
                                                                             BLOCK_K=128, ASM=True, OP="gate")),
    "qkv_rope_store_stream": (triton_streamk._stream_k_kernel, STREAM_K, dict(HALF=64, BLOCK_M=64, BLOCK_N=16,
                                                                               BLOCK_K=128, ASM=True, OP="qkv")),
    "qkv_rope_store": (triton_gemm._qkv_rope_store_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, pos_ptr=PTR_I32, slot_ptr=PTR_I32, inv_freq_ptr=PTR_F32, q_ptr=PTR_BF16,
        k_cache_ptr=PTR_BF16, v_cache_ptr=PTR_BF16, M=I32, K=I32, stride_xm=I32, stride_wn=I32, n_q_heads=I32,
        n_kv_heads=I32, stride_slot=I32, stride_head=I32), dict(HALF=64, BLOCK_M=16, BLOCK_D=32, BLOCK_K=128)),
}


def _source(name: str, use_pdl: bool, tma: int = 0) -> ASTSource:
    """The kernel's source as the engine's launch specializes it; with tma (GemmConfig.tma) 1 its weights, with 2
    also its activations, come in as TMA descriptors of the kernel's boxes (benchmarks/triton_key.py uses it)."""
    fn, types, constexprs = KERNELS[name]
    rows = constexprs.get("BLOCK_N", constexprs.get("BLOCK_D"))
    boxes = {"w_ptr": (rows, constexprs["BLOCK_K"]), "x_ptr": (constexprs["BLOCK_M"], constexprs["BLOCK_K"])}
    types = {**types, **{arg: "tensordesc<bf16[%d, %d]>" % boxes[arg] for arg in ("w_ptr", "x_ptr")[:tma]}}
    constexprs = {**constexprs, "TMA": tma, "USE_PDL": use_pdl}
    signature = {**types, **{k: "constexpr" for k in constexprs}}
    names = list(signature)  # as at the decode shapes, Triton knows the pointers and K, N, strides are 16-aligned
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in types.items()
             if t.startswith("*") or n in ("N", "K", "k_per_split") or n.startswith("stride")}
    return ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _ptx(name: str, use_pdl: bool, tma: int = 0) -> list[str]:
    """The kernel's PTX (`_source`'s)."""
    compiled = triton.compile(_source(name, use_pdl, tma), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]  # ptxas accepted it
    return [line.strip() for line in compiled.asm["ptx"].splitlines()]


def _first(lines: list[str], token: str) -> int:
    return next((i for i, line in enumerate(lines) if token in line), -1)


@pytest.mark.parametrize("tma", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_wait_comes_before_every_load(name, tma):
    lines = _ptx(name, use_pdl=True, tma=tma)
    wait, launch = _first(lines, "griddepcontrol.wait"), _first(lines, "griddepcontrol.launch_dependents")
    loads = [i for i, line in enumerate(lines) if "ld.global" in line or "cp.async" in line]  # maybe predicated
    assert loads and 0 <= wait < launch, (wait, launch)
    assert any("cp.async.bulk.tensor" in lines[i] for i in loads) == (tma > 0)  # TMA loads only with TMA
    assert wait < loads[0]  # nothing the kernel before writes is read before the wait


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_no_griddepcontrol_without_pdl(name):
    assert _first(_ptx(name, use_pdl=False), "griddepcontrol") < 0


def test_the_row_counts_are_not_specialized():
    # kernel_cases.gemm_keys compiles one kernel per config and tile height: Triton must not key the rows apart
    kernels = {fn: "M" for fn, _, _ in KERNELS.values()}
    kernels[triton_gemm._add_rms_norm2_partials_kernel] = "rows"
    for fn, rows in kernels.items():
        kept = {p.name: p.do_not_specialize for p in fn.params}
        assert kept[rows] and not any(v for name, v in kept.items() if name != rows), (fn.__name__, kept)
