"""The paged attention kernel's PDL prologue with LaunchConfig.meta_early (below), and: its tiled launch (graphed
prefill) never reads `m_tiles` (its programs walk the tile map), so the launch passes it as 1 and the startup
compiles one specialization where Triton's int classes of m_tiles ('1', '', '16') made three (session 20's
timeline: ('paged', 64, 4, 3, False, 64, '1' / '' / '16', True)). Compiled for sm90 on the CPU where Triton is
installed (CI installs it): the three classes' PTX bodies are the same when tiled, and differ when not (there m_tiles
divides the program id, and its classes stay keyed). The key the startup's pass lists (kernel_cases.attention_key)
follows the launch: checked without Triton."""

from __future__ import annotations

import pytest

from engine import kernel_cases

from ..test_warmup_kernels import shapes


def test_the_tiled_launchs_key_has_one_m_tiles_class():
    s = shapes()
    tiled, untiled = set(), set()
    for max_rows in (1, 3, 17, 40, 64, 200, 1024, 2048):
        tiled.add(kernel_cases.attention_key(s, 4, max_rows, 4 * max_rows, tiles=8)[0][5])
        untiled.add(kernel_cases.attention_key(s, 4, max_rows, 4 * max_rows)[0][5])
    assert tiled == {"1"} and len(untiled) > 1


def _body(m_tiles: int, tiled: bool, **launch) -> list[str]:
    """The kernel's PTX lines, without parameters, comments and debug lines; `launch` overrides constexprs (META_EARLY,
    BLOCK_M, BLOCK_N) and options (num_warps, num_stages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.triton_attention import _paged_attention_kernel as kernel

    ints = ["stride_q_row", "stride_q_head", "stride_o_split", "stride_o_row", "stride_o_head", "stride_lse_split",
            "stride_lse_row", "stride_k_block", "stride_k_slot", "stride_k_head", "stride_bt"]
    ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", lse_ptr="*bf16", block_tables_ptr="*i32",
                context_lens_ptr="*i32", query_start_ptr="*i32", tiles_ptr="*i32")
    types = {**ptrs, "m_tiles": "constexpr" if m_tiles == 1 else "i32", **{n: "i32" for n in ints}, "qk_scale": "fp32"}
    options = {"num_warps": launch.pop("num_warps", 4), "num_stages": launch.pop("num_stages", 3)}
    constexprs = dict(GROUP=1, BLOCK_M=64, BLOCK_N=64, PAGE=16, HEAD_DIM=128, IEEE=False, SPLIT=False, TILED=tiled,
                      HEAD_MAJOR=False, META_EARLY=False, USE_PDL=True, **({"m_tiles": 1} if m_tiles == 1 else {}))
    constexprs.update(launch)
    signature = {**types, **{n: "constexpr" for n in constexprs}}
    names = list(signature)
    aligned = list(ptrs) + ints + (["m_tiles"] if m_tiles % 16 == 0 else [])
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    lines = [line.strip() for line in compiled.asm["ptx"].splitlines()]
    return [x for x in lines if "_param_" not in x and not x.startswith((".param", "//", ".file", ".loc"))]


def test_the_tiled_kernel_is_the_same_for_every_m_tiles_class():
    pytest.importorskip("triton")
    tiled = {m: _body(m, tiled=True) for m in (1, 3, 16)}
    assert tiled[1] == tiled[3] == tiled[16]
    untiled = {m: _body(m, tiled=False) for m in (1, 3)}
    assert untiled[1] != untiled[3]  # the comparison can tell kernels apart
    assert len(tiled[1]) > 1000


def _loads(lines: list[str]) -> list[str]:
    return [x for x in lines if "ld.global" in x or "cp.async.cg" in x or "cp.async.ca" in x]


@pytest.mark.parametrize("block_n, warps, stages", [(16, 1, 4), (32, 2, 2)])
def test_meta_early_loads_the_lengths_and_first_block_ids_before_the_pdl_wait(block_n, warps, stages):
    """LaunchConfig.meta_early (one-row decode calls): the three lengths and the first key tile's block ids load
    before griddepcontrol.wait, nothing else does (q and the keys and values come from the kernel before); without
    it, no load comes before the wait."""
    pytest.importorskip("triton")
    launch = dict(BLOCK_M=16, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    for early in (False, True):
        lines = _body(3, tiled=False, META_EARLY=early, **launch)
        wait = next(i for i, x in enumerate(lines) if x.startswith("griddepcontrol.wait"))
        before, after = _loads(lines[:wait]), _loads(lines[wait:])
        assert len(after) > 8  # q, the block ids again (L1), the keys and values
        if not early:
            assert before == []
            continue
        assert len(before) == 4 and all(".b32 " in x and ".v" not in x for x in before)  # scalars and block ids
        assert before[3].startswith("@")  # the block ids' load, masked to the request's keys
