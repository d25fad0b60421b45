"""A whole loop pass of decode (every layer of the stack, attention included) as one warp-specialized Gluon
launch (Hopper, up to 8 requests of one new row each). layers_dispatch.py and layer_stack.layers_run say when
it runs, layer_stack.py holds what it reads (the stacked weights, the counters, the scratch rows, the row sums),
gluon_layers_stage.py is its stager; docs/benchmarks.md (session 18) says what it measured.

One CTA per SM, three partitions, five phases per layer, each ended by a grid-wide count in global memory
(every CTA adds one after its stores; a CTA that needs a phase's output waits for all of them):
  qkv   the consumer warp multiplies the staged x = rms(h) n_in by the layer's [q; k; v] weights (16 columns a
        tile; the rows' 1 / rms applied in the epilogue) and writes the rows' q, k, v before RoPE
  attn  the stager (4 warps) of CTA r x heads + head: RoPE on the row's q and k, the new key and value into the
        loop's paged cache at the row's slot, then softmax(q K^T / sqrt(d)) V over the request's pages (the
        new position from registers: its slot in the streamed page may not be written yet)
  o     the attention rows staged, times o_proj's weights; each CTA also writes its columns' sums of squares
  gu    hm = h + rms(o) n_in2 and x2 = rms(hm) n_post staged chunk by chunk as they land (rms(o) from those
        sums), SiLU(x2 Wg) (x2 Wu) written
  down  SiLU x up's rows staged, times down's weights (and its sums of squares)
and the next layer's h = hm + rms(d) n_post2; after the last layer each CTA writes its columns of the readout
rms(h) n_final (model.norm: the loop's readout and the next loop's input). Each CTA owns 16 columns of the
residual stream and writes them in the stagings. The loader warp TMA-streams, in the consumer's order, every
weight box of the CTA's tiles and its item's key / value pages (one page of keys and one of values per
8 KB slot of the same ring); it waits only for free slots, so weights flow across phase boundaries.

The counts are never reset: each launch adds the grid's size to every one, and a generation (bumped by the last
CTA to finish) tells a launch which total to wait for (int32 differences: wrapping is harmless). Every CTA must
be resident at once (one per SM: layers_dispatch bounds the grid and the shared memory). Imported lazily.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from . import layers_dispatch as ld
from . import pdl
from .layer_stack import NORMS, LayerStack
from .gluon_attention import _gdc_wait, smem_layout
from .gluon_layers_stage import BK, BM, BN, PHASES, _count, kv_pages, stager, stamp
from .gluon_mlp import A_LAYOUT, B_LAYOUT, MMA, quarters, smem_layouts, zeros4
from .gluon_ring import give, load_box, take, weight_ring

X_LAYOUT = gl.NVMMASharedLayout.get_default_for([ld.ROWS, ld.BLOCK_K], gl.bfloat16)  # a staged chunk's


@gluon.jit
def _load_layer_boxes(desc, ring, ready, empty, i, row0, pid, programs, NT: gl.constexpr, K: gl.constexpr,
                      PAIR: gl.constexpr, PAIR_OFFSET: gl.constexpr, STAGES: gl.constexpr):
    for t in range(pid, NT, programs):
        for kb in range(K // BK):
            for half in gl.static_range(2 if PAIR else 1):  # gate, then up
                load_box(desc, row0 + half * PAIR_OFFSET + t * BN, kb * BK, ring, ready, empty, i, STAGES)
                i += 1
    return i


@gluon.jit
def _load_kv(k_desc, v_desc, kv_ring, ready, empty, i, layer_row0, tables_ptr, stride_bt, ctx_ptr, M, pid,
             HEADS: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr):
    # the item's key and value pages (a box of each per slot), their block ids read 32 at a time
    if pid < M * HEADS:
        r = pid // HEADS
        col = (pid % HEADS) * D
        offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        pages = (gl.load(ctx_ptr + r) + PAGE - 1) // PAGE
        ids = gl.load(tables_ptr + r * stride_bt + offs, mask=offs < pages, other=0)
        for t in range(pages):
            if (t % 32 == 0) & (t > 0):
                ids = gl.load(tables_ptr + r * stride_bt + t + offs, mask=t + offs < pages, other=0)
            row = layer_row0 + gl.sum(gl.where(offs == t % 32, ids, 0), axis=0) * PAGE
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * k_desc.block_type.nbytes)
            slot = kv_ring.index(s)
            tma.async_copy_global_to_shared(k_desc, [row, col], ready.index(s), slot.slice(0, PAGE, dim=0))
            tma.async_copy_global_to_shared(v_desc, [row, col], ready.index(s), slot.slice(PAGE, PAGE, dim=0))
            i += 1
    return i


@gluon.jit
def _loader(wq, wo, wgu, wd, k_desc, v_desc, ring, kv_ring, ready, empty, meta, num_layers, M, layer_rows,
            H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, HEADS: gl.constexpr, D: gl.constexpr,
            PAGE: gl.constexpr, STAGES: gl.constexpr, USE_PDL: gl.constexpr):
    pos_ptr, slots_ptr, tables_ptr, stride_bt, ctx_ptr = meta
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    i = pid * 0
    for layer in range(num_layers):
        i = _load_layer_boxes(wq, ring, ready, empty, i, layer * QKV, pid, programs, QKV // BN, H, False, 0, STAGES)
        if USE_PDL:
            if layer == 0:  # block tables and lengths may be the kernel before's output
                _gdc_wait()
        i = _load_kv(k_desc, v_desc, kv_ring, ready, empty, i, layer * layer_rows, tables_ptr, stride_bt, ctx_ptr, M,
                     pid, HEADS, D, PAGE, STAGES)
        i = _load_layer_boxes(wo, ring, ready, empty, i, layer * H, pid, programs, H // BN, H, False, 0, STAGES)
        i = _load_layer_boxes(wgu, ring, ready, empty, i, layer * 2 * INTER, pid, programs, INTER // BN, H, True,
                              INTER, STAGES)
        i = _load_layer_boxes(wd, ring, ready, empty, i, layer * H, pid, programs, H // BN, INTER, False, 0, STAGES)


@gluon.jit
def multiply(ring, ready, empty, xbuf, x_ready, scales, i, p, layer, out_ptr, sums_ptr, M, pid, programs,
             NT: gl.constexpr, K: gl.constexpr, PAIR: gl.constexpr, OUT_W: gl.constexpr, H: gl.constexpr,
             STAGES: gl.constexpr, SCALED: gl.constexpr, SUMS: gl.constexpr):
    """The CTA's tiles of one phase (benchmarks/ws_layer.py's consumer too); p is the staging's index (four a layer):
    chunks below H / BK are staged every time, the others (down's K) once a layer. SCALED: the staged rows are
    h * n and the rows' 1 / rms (scales, published once the whole rows are in) is applied in the epilogue; PAIR:
    gate and up, SiLU x up. SUMS: also the rows' sums of squares over the CTA's columns (sums_ptr[pid]), so the
    stager of a norm after this phase need not read whole rows before it can normalize them."""
    rn0 = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    rm = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    scale_smem, scale_ready = scales
    Q: gl.constexpr = BK // 4
    sq = gl.zeros([BM], gl.float32, gl.SliceLayout(0, MMA))
    if pid >= NT:  # no tile: still take the chunks' signals, or a later wait for the same parity passes early
        for kb in range(K // BK):
            mbarrier.wait(x_ready.index(kb), gl.where(kb < H // BK, p, layer) & 1)
        if SCALED:
            mbarrier.wait(scale_ready.index(0), (p // 2) & 1)
    for t in range(pid, NT, programs):
        g0, g1, g2, g3 = zeros4()
        u0, u1, u2, u3 = zeros4()
        for kb in range(K // BK):
            mbarrier.wait(x_ready.index(kb), gl.where(kb < H // BK, p, layer) & 1)
            xc = xbuf.index(kb)
            b0 = xc.slice(0, Q, dim=1).permute((1, 0)).load(B_LAYOUT)
            b1 = xc.slice(Q, Q, dim=1).permute((1, 0)).load(B_LAYOUT)
            b2 = xc.slice(2 * Q, Q, dim=1).permute((1, 0)).load(B_LAYOUT)
            b3 = xc.slice(3 * Q, Q, dim=1).permute((1, 0)).load(B_LAYOUT)
            g0, g1, g2, g3 = quarters(take(ring, ready, i, STAGES), b0, b1, b2, b3, g0, g1, g2, g3, A_LAYOUT)
            give(empty, i, STAGES)
            i += 1
            if PAIR:
                u0, u1, u2, u3 = quarters(take(ring, ready, i, STAGES), b0, b1, b2, b3, u0, u1, u2, u3, A_LAYOUT)
                give(empty, i, STAGES)
                i += 1
        y = (g0 + g1) + (g2 + g3)
        u = (u0 + u1) + (u2 + u3)
        if SCALED:
            mbarrier.wait(scale_ready.index(0), (p // 2) & 1)
            rs = scale_smem.load(gl.SliceLayout(0, MMA))
            y = y * rs[None, :]
            u = u * rs[None, :]
        if PAIR:
            y = y / (1.0 + gl.exp(-y)) * u
        rn = t * BN + rn0
        yq = y.to(out_ptr.dtype.element_ty)
        gl.store(out_ptr + rm[None, :] * OUT_W + rn[:, None], yq, mask=(rm < M)[None, :])
        if SUMS:
            yf = yq.to(gl.float32)
            sq += gl.sum(yf * yf, axis=0)
    if SUMS:
        gl.store(sums_ptr + pid * BM + rm, sq)
    return i


@gluon.jit
def _consumer(ring, ready, empty, xbuf, x_ready, scales, acts, sums_ptr, cnt_ptr, ctx_ptr, trace, num_layers, M,
              H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, HEADS: gl.constexpr, PAGE: gl.constexpr,
              STAGES: gl.constexpr, TRACE: gl.constexpr):
    hq_ptr, hm_ptr, qkv_ptr, attn_ptr, o_ptr, act_ptr, d_ptr = acts
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    pages = kv_pages(ctx_ptr, M, pid, HEADS, PAGE)
    i = pid * 0
    for layer in range(num_layers):
        s = 4 * layer
        c = cnt_ptr + 1 + PHASES * layer
        sums = sums_ptr + layer * 2 * programs * BM  # this layer's o and down row sums
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, s, layer, qkv_ptr + layer * BM * QKV, sums, M,
                      pid, programs, QKV // BN, H, False, QKV, H, STAGES, True, False)
        _count(c)
        stamp(trace, pid, layer, num_layers, 10, TRACE)
        i += pages
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, s + 1, layer, o_ptr + layer * BM * H, sums, M,
                      pid, programs, H // BN, H, False, H, H, STAGES, False, True)
        _count(c + 2)
        stamp(trace, pid, layer, num_layers, 11, TRACE)
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, s + 2, layer, act_ptr + layer * BM * INTER, sums,
                      M, pid, programs, INTER // BN, H, True, INTER, H, STAGES, True, False)
        _count(c + 3)
        stamp(trace, pid, layer, num_layers, 12, TRACE)
        i = multiply(ring, ready, empty, xbuf, x_ready, scales, i, s + 3, layer, d_ptr + layer * BM * H,
                      sums + programs * BM, M, pid, programs, H // BN, INTER, False, H, H, STAGES, False, True)
        _count(c + 4)
        stamp(trace, pid, layer, num_layers, 13, TRACE)


@gluon.jit
def staging(dtype: gl.constexpr, XCHUNKS: gl.constexpr, x_layout: gl.constexpr):
    """The stager's buffer of XCHUNKS chunks (ROWS x BLOCK_K) with a `ready` barrier each, and the rows' 1 / rms
    with its barrier (benchmarks/ws_layer.py's kernel too)."""
    xbuf = gl.allocate_shared_memory(dtype, [XCHUNKS, BM, BK], x_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [XCHUNKS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(XCHUNKS):
        mbarrier.init(x_ready.index(c), count=1)
    scale_smem = gl.allocate_shared_memory(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    scale_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(scale_ready.index(0), count=1)
    return xbuf, x_ready, scale_smem, scale_ready


@gluon.jit(do_not_specialize=["M"])  # one compile for 1-8 requests (M == 1 would be a second, of ~3.5 s)
def layers_kernel(wq, wo, wgu, wd, k_desc, v_desc, h_in_ptr, out_ptr, k_ptr, v_ptr, inv_freq_ptr, hq_ptr, hm_ptr,
                  qkv_ptr, attn_ptr, o_ptr, act_ptr, d_ptr, n_in, n_in2, n_post, n_post2, n_final, pos_ptr, slots_ptr,
                  tables_ptr, stride_bt, ctx_ptr, cnt_ptr, sums_ptr, trace_ptr, num_layers, M, layer_rows, eps,
                  qk_scale, H: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, HEADS: gl.constexpr,
                  D: gl.constexpr,
                  PAGE: gl.constexpr, XCHUNKS: gl.constexpr, x_layout: gl.constexpr, STAGES: gl.constexpr,
                  USE_PDL: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(BN * BK == 2 * PAGE * D, "a ring slot holds one weight box, or a page of keys and one of values")
    ring, ready, empty = weight_ring(wq, STAGES)
    kv_ring = ring._reinterpret(wq.dtype, [STAGES, 2 * PAGE, D], k_desc.layout)
    xbuf, x_ready, scale_smem, scale_ready = staging(wq.dtype, XCHUNKS, x_layout)
    landed = gl.allocate_shared_memory(gl.int64, [H // BK, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(H // BK):  # a staging's chunk c has landed: every stager thread's copies arrive
        mbarrier.init(landed.index(c), count=num_warps * 32)
    fence_async_shared()
    scales = (scale_smem, scale_ready)
    acts = (hq_ptr, hm_ptr, qkv_ptr, attn_ptr, o_ptr, act_ptr, d_ptr)
    meta = (pos_ptr, slots_ptr, tables_ptr, stride_bt, ctx_ptr)
    gl.warp_specialize([
        (stager, (kv_ring, ready, empty, xbuf, x_ready, (scale_smem, scale_ready, landed, sums_ptr), acts,
                  (h_in_ptr, out_ptr, k_ptr, v_ptr, inv_freq_ptr, trace_ptr),
                  (n_in, n_in2, n_post, n_post2, n_final), meta, cnt_ptr, num_layers, M, layer_rows, eps, qk_scale,
                  H, QKV, INTER, HEADS, D, PAGE, num_warps, STAGES, USE_PDL, TRACE)),
        (_consumer, (ring, ready, empty, xbuf, x_ready, scales, acts, sums_ptr, cnt_ptr, ctx_ptr, trace_ptr, num_layers,
                     M, H, QKV, INTER, HEADS, PAGE, STAGES, TRACE)),
        (_loader, (wq, wo, wgu, wd, k_desc, v_desc, ring, kv_ring, ready, empty, meta, num_layers, M, layer_rows, H,
                   QKV, INTER, HEADS, D, PAGE, STAGES, USE_PDL)),
    ], [1, 1], [192, 40])


def _descriptors(stack: "LayerStack", k: torch.Tensor, v: torch.Tensor) -> tuple:
    """TMA descriptors of the stacked weights and of one loop's key / value planes (cached: a graph captures the
    launch's arguments once, and an eager step should not rebuild them)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    key = (stack.wq.data_ptr(), k.data_ptr(), v.data_ptr())
    found = stack.descriptors.get(key)
    if found is None:
        w_layout, _, _ = smem_layouts(torch.bfloat16, ld.BLOCK_K)  # gluon_mlp's weight boxes: the same tiles
        ws = tuple(TensorDescriptor.from_tensor(w, [ld.BLOCK_N, ld.BLOCK_K], w_layout)
                   for w in (stack.wq, stack.wo, stack.wgu, stack.wd))
        width = k.shape[-2] * k.shape[-1]
        kvs = tuple(TensorDescriptor.from_tensor(t.view(-1, width), [k.shape[-3], k.shape[-1]], smem_layout())
                    for t in (k, v))
        found = stack.descriptors[key] = ws + kvs
    return found


def launch_layers(h: torch.Tensor, stack: "LayerStack", k: torch.Tensor, v: torch.Tensor, meta,
                  inv_freq: torch.Tensor, eps: float, scale: float, trace: torch.Tensor | None = None) -> torch.Tensor:
    """One loop pass over every layer: h [rows <= 8, hidden] (the loop's input) -> the loop's readout
    rms(h_out) * model.norm. k, v: the loop's planes [layers, blocks, page, kv_heads, d]; the rows' keys and values
    are written at meta.slots. layer_stack.layers_run says which calls come here. trace (measuring only): int64
    [SMs, layers, TRACE_EVENTS], each CTA's global-timer stamps (gluon_layers_stage.stamp's events)."""
    args, constexprs, out = layers_args(h, stack, k, v, meta, inv_freq, eps, scale, trace)
    layers_kernel[(pdl.num_sms(h.device),)](*args, **constexprs, **pdl.launch_kwargs(h.device))
    return out


def layers_args(h: torch.Tensor, stack: "LayerStack", k: torch.Tensor, v: torch.Tensor, meta,
                inv_freq: torch.Tensor, eps: float, scale: float, trace: torch.Tensor | None = None
                ) -> tuple[tuple, dict, torch.Tensor]:
    """launch_layers' kernel arguments, its constexprs but USE_PDL (pdl.launch_kwargs), and the readout it fills
    (tests/test_gluon_layers_emulated.py runs the kernel on them on the CPU)."""
    h = h.contiguous()  # rows of `hidden` (a no-op on the engine's calls)
    rows, hidden = h.shape
    L, _, page, heads, d = k.shape
    out = torch.empty_like(h)
    args = (*_descriptors(stack, k, v), h, out, k, v, inv_freq, *stack.rows, *stack.norms, stack.final_norm,
            meta.positions, meta.slots, meta.block_tables, meta.block_tables.stride(0), meta.context_lens,
            stack.counters, stack.row_sums, stack.counters if trace is None else trace,
            L, rows, k.shape[1] * page, eps, scale * 1.4426950408889634)
    constexprs = dict(H=hidden, QKV=stack.qkv_width, INTER=stack.inter, HEADS=heads, D=d, PAGE=page,
                      XCHUNKS=ld.staged_chunks(hidden, stack.inter), x_layout=X_LAYOUT, STAGES=ld.STAGES,
                      TRACE=trace is not None, num_warps=4)
    return args, constexprs, out


def run_loops(model, h: torch.Tensor, meta, pool, first_loop: int, last_loop: int) -> list[torch.Tensor]:
    """OuroForCausalLM.run_loops through launch_layers: one launch per loop pass."""
    cfg = model.config
    readouts = []
    for loop in range(first_loop, last_loop + 1):
        h = launch_layers(h, model.layer_stack, pool.k[loop - 1], pool.v[loop - 1], meta, model.layer_stack.inv_freq,
                          cfg.rms_norm_eps, cfg.head_dim**-0.5)
        readouts.append(h)
    return readouts


def warm_launch(s, rows: int, layers: int, device: torch.device) -> None:
    """One loop-pass launch of `rows` requests through `layers` layers on zeros, for the startup's compile pass
    (kernel_warmup): weights for two layers only (the TMA reads past them come back as zeros), everything the
    launch writes or reads by pointer for all of them; a table row as wide as the engine's."""
    H, inter, heads, d = s.hidden_size, s.intermediate_size, s.num_heads, s.head_dim
    z = dict(dtype=s.dtype, device=device)
    qkv = (heads + 2 * s.num_kv_heads) * d
    stack = LayerStack(torch.zeros(2 * qkv, H, **z), torch.zeros(2 * H, H, **z), torch.zeros(4 * inter, H, **z),
                       torch.zeros(2 * H, inter, **z), torch.ones(len(NORMS), layers, H, **z), torch.ones(H, **z),
                       torch.ones(d // 2, dtype=torch.float32, device=device), layers, weight_layers=2)
    k = torch.zeros(layers, 2, s.block_size, s.num_kv_heads, d, **z)
    meta = SimpleNamespace(positions=torch.zeros(rows, dtype=torch.int64, device=device),
                           slots=torch.zeros(rows, dtype=torch.int64, device=device),
                           block_tables=torch.zeros(rows, s.table_width, dtype=torch.int32, device=device),
                           context_lens=torch.ones(rows, dtype=torch.int32, device=device))
    launch_layers(torch.zeros(rows, H, **z), stack, k, torch.zeros_like(k), meta, stack.inv_freq, s.eps, d**-0.5)
