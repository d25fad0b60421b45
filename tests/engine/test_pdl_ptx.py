"""The PDL prologue of the decode step's Triton kernels (engine/pdl.py), compiled for sm90 on the CPU: Triton
builds the PTX and ptxas the cubin without a GPU (where Triton is installed; CI has none). With USE_PDL a
kernel waits (``griddepcontrol.wait``) before its first global load, and lets the next kernel launch only
after that; without it there is no griddepcontrol at all. The kernels' results with PDL on are compared
with the torch references on the H200 (tests/gpu/test_gpu_gemm.py, test_gpu_attention_kernels.py)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import triton_gemm, triton_norm_gemm  # noqa: E402

PTR_BF16, PTR_F32, PTR_I32, I32, F32 = "*bf16", "*fp32", "*i32", "i32", "fp32"
# a PendingNorm input's arguments (triton_norm_gemm.py), and the constexprs with and without one
NORM_IN = dict(y_ptr=PTR_BF16, stats_ptr=PTR_F32, n_tiles=I32, wa_ptr=PTR_BF16, wb_ptr=PTR_BF16, h_out_ptr=PTR_BF16,
               eps=F32)
PLAIN, NORMED = dict(NORM_IN=False, TILES=1), dict(NORM_IN=True, TILES=64)

# (kernel, runtime arguments' types, constexprs) at the Ouro-1.4B decode shapes
KERNELS = {
    "linear_partials": (triton_gemm._linear_partials_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, out_ptr=PTR_F32, M=I32, N=I32, K=I32, k_per_split=I32, stride_xm=I32,
        stride_wn=I32), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)),
    **{f"gate_up_silu{tag}": (triton_gemm._gate_up_silu_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, out_ptr=PTR_BF16, M=I32, N=I32, K=I32, stride_xm=I32, stride_wn=I32,
        **NORM_IN), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, **norm)) for tag, norm in (("", PLAIN), ("_normed", NORMED))},
    **{f"qkv_rope_store{tag}": (triton_gemm._qkv_rope_store_kernel, dict(
        x_ptr=PTR_BF16, w_ptr=PTR_BF16, pos_ptr=PTR_I32, slot_ptr=PTR_I32, inv_freq_ptr=PTR_F32, q_ptr=PTR_BF16,
        k_cache_ptr=PTR_BF16, v_cache_ptr=PTR_BF16, M=I32, K=I32, stride_xm=I32, stride_wn=I32, n_q_heads=I32,
        n_kv_heads=I32, stride_slot=I32, stride_head=I32, **NORM_IN), dict(HALF=64, BLOCK_M=16, BLOCK_D=32,
                                                                            BLOCK_K=128, **norm))
       for tag, norm in (("", PLAIN), ("_normed", NORMED))},
    **{f"linear_stats_{splits}": (triton_norm_gemm._linear_stats_kernel, dict(
        a_ptr=PTR_BF16, w_ptr=PTR_BF16, h_ptr=PTR_BF16, wa_ptr=PTR_BF16, part_ptr=PTR_F32, count_ptr=PTR_I32,
        y_ptr=PTR_BF16, stats_ptr=PTR_F32, M=I32, N=I32, K=I32, k_per_split=I32, stride_am=I32, stride_wn=I32),
        dict(SPLITS=splits, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128)) for splits in (1, 4)},
}


def _ptx(name: str, use_pdl: bool) -> list[str]:
    fn, types, constexprs = KERNELS[name]
    constexprs = {**constexprs, "USE_PDL": use_pdl}
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
def test_the_wait_comes_before_every_load(name):
    lines = _ptx(name, use_pdl=True)
    wait, launch = _first(lines, "griddepcontrol.wait"), _first(lines, "griddepcontrol.launch_dependents")
    loads = [i for i, line in enumerate(lines) if "ld.global" in line or "cp.async" in line]  # maybe predicated
    assert loads and 0 <= wait < launch, (wait, launch)
    assert wait < loads[0]  # nothing the kernel before writes is read before the wait


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_no_griddepcontrol_without_pdl(name):
    assert _first(_ptx(name, use_pdl=False), "griddepcontrol") < 0


def test_the_last_split_reads_the_partials_only_after_every_split_stored_them():
    """linear_stats' tile counter (triton_norm_gemm.py): all threads' partial stores, then a CTA barrier, then
    one acq_rel atomic at GPU scope; the last split reads the partials after a barrier, past L1 (.cg)."""
    lines = _ptx("linear_stats_4", use_pdl=True)
    atom = [i for i, line in enumerate(lines) if line.lstrip("@%p0123456789 ").startswith("atom.")]
    assert len(atom) == 1 and ".acq_rel" in lines[atom[0]] and ".gpu" in lines[atom[0]], [lines[i] for i in atom]
    stores = [i for i, line in enumerate(lines) if "st.global" in line]
    barriers = [i for i, line in enumerate(lines) if line.startswith("bar.sync")]
    assert stores and stores[0] < atom[0]  # the partials
    assert any(stores[0] < b < atom[0] for b in barriers)  # ... all stored before the counter moves
    cg = [i for i, line in enumerate(lines) if "ld.global.cg" in line]
    assert cg and any(atom[0] < b < cg[0] for b in barriers)
