"""engine/kv_prefetch.py's kernel compiled for sm90 on the CPU (where Triton is installed; CI installs it): one
predicated bulk L2 prefetch of a page's keys and one of its values under the policy the setting names; with PDL
it lets the next kernel launch before any of them and waits for the kernel before only after the last, so the
chain's order holds (the pass's values with it on: tests/gpu/test_gpu_kv_prefetch.py)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import kv_prefetch  # noqa: E402

TYPES = dict(k_base="i64", v_base="i64", tables_ptr="*i32", lens_ptr="*i32", stride_bt="i32", block_bytes="i32",
             max_block="i32", pages="i32")


def _ptx(use_pdl: bool, evict: str) -> list[str]:
    constexprs = dict(PAGE=16, FROM_END=False, ASM=kv_prefetch._ASM.replace("EVICT", evict), USE_PDL=use_pdl)
    source = ASTSource(kv_prefetch._kv_prefetch_kernel, signature={**TYPES, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]  # ptxas accepted it
    return [line.strip() for line in compiled.asm["ptx"].splitlines() if not line.strip().startswith(("//", ".loc"))]


@pytest.mark.parametrize("evict", ["evict_last", "evict_normal"])
def test_two_predicated_bulk_prefetches_under_the_policy(evict):
    lines = _ptx(True, evict)
    prefetches = [i for i, line in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in line]
    assert len(prefetches) == 2 and all(lines[i].startswith("@") for i in prefetches)
    assert sum(f"createpolicy.fractional.L2::{evict}.b64" in line for line in lines) == 1
    launch = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert len(launch) == len(wait) == 1 and launch[0] < prefetches[0] and prefetches[-1] < wait[0]
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    assert loads and max(loads) < wait[0]  # it reads only the tables and lengths, which no kernel of a pass writes


def test_no_griddepcontrol_without_pdl():
    lines = _ptx(False, "evict_last")
    assert not any("griddepcontrol" in line for line in lines)
    assert sum("cp.async.bulk.prefetch.L2.global" in line for line in lines) == 2


LINE_TYPES = dict(k_base="i64", v_base="i64", tables_ptr="*i32", lens_ptr="*i32", stride_bt="i32", max_block="i32",
                  pages="i32")


@pytest.mark.parametrize("evict_last", [True, False])
def test_the_line_way_asks_for_every_line_of_a_page_after_letting_the_next_kernel_launch(evict_last):
    """`line` (session 43): a 64 KB page's keys and values, 512 lines each, two line prefetches a thread under the
    policy, between the PDL launch and the wait."""
    asm = kv_prefetch._LINE_ASM.replace("EVICT", "::evict_last" if evict_last else "")
    constexprs = dict(LINES=512, LINE=kv_prefetch.LINE, PAGE=16, FROM_END=False, ASM=asm, USE_PDL=True)
    source = ASTSource(kv_prefetch._kv_line_kernel, constexprs=constexprs,
                       signature={**LINE_TYPES, **{k: "constexpr" for k in constexprs}})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"]
    lines = [line.strip() for line in compiled.asm["ptx"].splitlines() if not line.strip().startswith(("//", ".loc"))]
    want = "prefetch.global.L2::evict_last [" if evict_last else "prefetch.global.L2 ["
    prefetches = [i for i, line in enumerate(lines) if line.startswith(want) or line.split(" ", 1)[-1].startswith(want)]
    assert len(prefetches) == 512 * 2 // 128  # 4 warps: 4 lines of keys and 4 of values a thread
    assert not any("prefetch.global.L2::evict_last" in line for line in lines) or evict_last
    launch = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert len(launch) == len(wait) == 1 and launch[0] < prefetches[0] and prefetches[-1] < wait[0]
