"""Keys and values asked into L2 ahead of the decode attention that reads them (Triton, Hopper).

At 64 requests a layer's GEMM side (qkv, o, gate_up, down and the norms) streams its ~103 MB of weights (23.9 us at
4.3 TB/s) in ~44 us: about half the HBM bandwidth goes unused there, while the decode attention after it is bound by
HBM alone. A launch of this kernel before the GEMM side's last kernels asks the L2 for the first (or last) `pages`
pages of every request's keys and values of the layer the next attention reads, with Hopper's bulk prefetch
(``cp.async.bulk.prefetch.L2``: one instruction a page, nothing waits for it), so part of that attention's bytes
come from the L2; the `line` way (session 43) asks line by line instead (``prefetch.global.L2``, 128 bytes each, a
program per request and page), to tell the bulk prefetch apart from the idea. It changes no value: a prefetch is a
hint, and where its lines are evicted first the attention reads them from HBM as before.

The kernel lets the next kernel launch at once (PDL) and waits for the kernel before only at its end, so it runs
beside that kernel and keeps the chain's order. Measured on the H200 it made the N = 64 pass slower at every setting,
even the attention right after its own prefetch (docs/benchmarks.md, session 28): off by default. Imported lazily:
the CPU path never needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

_ASM = """{
.reg .pred ok;
.reg .b64 pol;
setp.ne.s32 ok, $4, 0;
createpolicy.fractional.L2::EVICT.b64 pol, 1.0;
@ok cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol;
@ok cp.async.bulk.prefetch.L2.global.L2::cache_hint [$2], $3, pol;
mov.u32 $0, 0;
}"""
WIDTH = 32  # pages a request at most: one per thread of the kernel's warp
_LINE_ASM = """{
prefetch.global.L2EVICT [$1];
prefetch.global.L2EVICT [$2];
mov.u32 $0, 0;
}"""
LINE = 128  # bytes a line prefetch asks for


@triton.jit
def _kv_prefetch_kernel(k_base, v_base, tables_ptr, lens_ptr, stride_bt, block_bytes, max_block, pages,
                        PAGE: tl.constexpr, FROM_END: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may launch now; this one ends only after the kernel before (below)
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    n_pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE)
    j = tl.arange(0, 32)
    first = tl.maximum(n_pages - pages, 0) if FROM_END else 0
    page = tl.minimum(first + j, tl.maximum(n_pages - 1, 0))
    block = tl.load(tables_ptr + seq * stride_bt + page).to(tl.int64)
    block = tl.minimum(tl.maximum(block, 0), max_block)  # a hint never leaves the pool
    offset = block * block_bytes
    valid = ((j < pages) & (first + j < n_pages)).to(tl.int32)
    size = tl.full([32], 0, tl.int32) + block_bytes
    tl.inline_asm_elementwise(ASM, "=r,l,l,r,r", [k_base + offset, v_base + offset, size, valid], dtype=tl.int32,
                              is_pure=False, pack=1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _kv_line_kernel(k_base, v_base, tables_ptr, lens_ptr, stride_bt, max_block, pages, LINES: tl.constexpr,
                    LINE: tl.constexpr, PAGE: tl.constexpr, FROM_END: tl.constexpr, ASM: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """The `line` way: program (seq, j) asks for page j of request seq line by line (prefetch.global.L2), a
    page's keys and its values, LINES lines each."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    seq, j = tl.program_id(0), tl.program_id(1)
    n_pages = tl.cdiv(tl.load(lens_ptr + seq), PAGE)
    first = tl.maximum(n_pages - pages, 0) if FROM_END else 0
    if first + j < n_pages:
        block = tl.load(tables_ptr + seq * stride_bt + first + j).to(tl.int64)
        block = tl.minimum(tl.maximum(block, 0), max_block)
        offset = block * (LINES * LINE) + tl.arange(0, LINES).to(tl.int64) * LINE
        tl.inline_asm_elementwise(ASM, "=r,l,l", [k_base + offset, v_base + offset], dtype=tl.int32, is_pure=False,
                                  pack=1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


def prefetch_pages(k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, pages: int, from_end: bool = False, evict_last: bool = True,
                   line: bool = False) -> None:
    """Ask the L2 for `pages` pages of every request's keys and values (its first ones, or its last with
    from_end): a bulk prefetch a page, or with `line` a line prefetch (prefetch.global.L2) for each 128 bytes.
    k_blocks, v_blocks: one plane by block, [blocks, block_size, kv_heads, d], contiguous;
    block_tables: [seqs, width] int32; context_lens: [seqs] int32."""
    if not 0 < pages <= WIDTH:
        raise ValueError(f"pages must be in 1..{WIDTH}, got {pages}")
    if not (k_blocks.is_contiguous() and v_blocks.is_contiguous() and k_blocks.shape == v_blocks.shape):
        raise ValueError("k_blocks and v_blocks must be contiguous planes of one shape")
    seqs = context_lens.shape[0]
    if seqs == 0:
        return
    blocks, page = k_blocks.shape[:2]
    block_bytes = k_blocks[0].numel() * k_blocks.element_size()
    if line:
        if block_bytes % LINE or (block_bytes // LINE) & (block_bytes // LINE - 1):
            raise ValueError(f"the line way needs a page of a power of two of {LINE}-byte lines, got {block_bytes} B")
        asm = _LINE_ASM.replace("EVICT", "::evict_last" if evict_last else "")
        _kv_line_kernel[(seqs, pages)](k_blocks.data_ptr(), v_blocks.data_ptr(), block_tables, context_lens,
                                       block_tables.stride(0), blocks - 1, pages, LINES=block_bytes // LINE,
                                       LINE=LINE, PAGE=page, FROM_END=from_end, ASM=asm, num_warps=4,
                                       **pdl.launch_kwargs(k_blocks.device))
        return
    asm = _ASM.replace("EVICT", "evict_last" if evict_last else "evict_normal")
    _kv_prefetch_kernel[(seqs,)](k_blocks.data_ptr(), v_blocks.data_ptr(), block_tables, context_lens,
                                 block_tables.stride(0), block_bytes, blocks - 1, pages, PAGE=page,
                                 FROM_END=from_end, ASM=asm, num_warps=1, **pdl.launch_kwargs(k_blocks.device))
