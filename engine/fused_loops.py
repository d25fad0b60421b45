"""The loops of OuroForCausalLM with fused kernels (CUDA, attention_backend "triton"): one layer's kernels in order.

The math of OuroDecoderLayer.run, written out because each residual add is fused with the norm after it,
which for the MLP's add is the next layer's input norm (or model.norm at a loop's end): the fusion crosses
the layer boundary. Per layer, at the rows gemm_dispatch lists (triton_gemm.py, triton_norm_gemm.py):
qkv + RoPE + K / V store, attention, o_proj, gate_up + SiLU, down_proj. Where the config says
`defer_norm`, o_proj and down_proj hand their add + norm to the GEMM after them as a PendingNorm (no
kernel of its own); otherwise each is a split-K GEMM and an add + norm kernel over its partials. Past the
table's rows: cuBLAS GEMMs and triton_fused's elementwise kernels. tests/gpu checks every variant against
the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import attend
from .batch import BatchMeta
from .gemm_dispatch import GemmConfig, gemm_config, qkv_block_d
from .kv_cache import KVPool


def run_loops(layers, final_norm: torch.Tensor, h: torch.Tensor, meta: BatchMeta, pool: KVPool, first_loop: int,
              last_loop: int, inv_freq: torch.Tensor, counters: torch.Tensor | None, eps: float) -> list[torch.Tensor]:
    """OuroForCausalLM.run_loops with fused kernels; `counters`: triton_norm_gemm.counters (None: no deferred
    norms). h: [rows, hidden] -> each loop's normed readout."""
    from . import triton_fused as fused

    attn0 = layers[0].self_attn
    Hq, Hkv, d = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    rows = h.shape[0]
    # the skinny-batch GEMMs of triton_gemm.py for half-precision calls of the rows gemm_dispatch lists
    gemm = gemm_config(rows) if h.dtype in (torch.bfloat16, torch.float16) else None
    defer = gemm is not None and gemm.defer_norm and counters is not None
    readouts = []
    x = fused.rms_norm(h, layers[0].input_layernorm.weight, eps)
    for loop in range(first_loop, last_loop + 1):
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            k_plane, v_plane = pool.plane(loop, layer.layer)
            q, h = _qkv_rope_store(x, h, attn.qkv_weight, meta, inv_freq, k_plane, v_plane, Hq, Hkv, d, gemm)
            a = attend(q, None, None, pool, loop, layer.layer, meta, attn.scale, attn.backend)
            h, x = _linear_add_norm(h, a.reshape(rows, Hq * d), attn.o_proj.weight, gemm, "o",
                                    layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight, eps,
                                    counters if defer else None)
            m, h = _gate_up_silu(x, h, layer.mlp.gate_up_weight, gemm)
            last = i + 1 == len(layers)
            w_next = final_norm if last else layers[i + 1].input_layernorm.weight
            h, x = _linear_add_norm(h, m, layer.mlp.down_proj.weight, gemm, "down",
                                    layer.post_attention_layernorm_2.weight, w_next, eps,
                                    counters if defer and not last else None)
        readouts.append(x)  # rms(h, model.norm): loop `loop`'s readout and loop+1's input
        if loop < last_loop:
            h = x
            x = fused.rms_norm(h, layers[0].input_layernorm.weight, eps)
    return readouts


def _linear_add_norm(h: torch.Tensor, y_in: torch.Tensor, w: torch.Tensor, gemm: GemmConfig | None, which: str,
                     w_branch: torch.Tensor, w_next: torch.Tensor, eps: float, counters: torch.Tensor | None):
    """(h', x): h' = h + rms(y_in @ w.T) * w_branch and x = rms(h') * w_next (o_proj's / down_proj's half).
    With `counters` (a deferred norm): (h, a triton_norm_gemm.PendingNorm), h' and x computed by its consumer."""
    from . import triton_fused as fused

    if gemm is None:
        return fused.add_rms_norm2(h, F.linear(y_in, w), w_branch, w_next, eps)
    from . import triton_gemm

    splits = gemm.splits_o if which == "o" else gemm.splits_down
    if counters is not None:
        from . import triton_norm_gemm

        return h, triton_norm_gemm.linear_stats(y_in, w, h, w_branch, w_next, eps, splits, gemm, counters)
    partials = triton_gemm.linear_partials(y_in, w, splits, gemm)
    return triton_gemm.add_rms_norm2_partials(h, partials, w_branch, w_next, eps)


def _qkv_rope_store(x, h: torch.Tensor, w_qkv: torch.Tensor, meta: BatchMeta, inv_freq: torch.Tensor,
                    k_plane: torch.Tensor, v_plane: torch.Tensor, Hq: int, Hkv: int, d: int,
                    gemm: GemmConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q after RoPE [rows, Hq, d], the residual), k and v written to their slots: one kernel where
    gemm_dispatch says so. A PendingNorm x is computed as the kernel reads it (its h' is the residual)."""
    from . import triton_fused as fused
    from .triton_norm_gemm import PendingNorm

    if qkv_block_d(gemm, d):
        from . import triton_gemm

        args = (w_qkv, meta.positions, meta.slots, inv_freq, k_plane, v_plane, Hq, Hkv, d, gemm)
        if isinstance(x, PendingNorm):
            return triton_gemm.qkv_rope_store_normed(x, *args)
        return triton_gemm.qkv_rope_store(x, *args), h
    if isinstance(x, PendingNorm):
        h, x = x.resolve()
    q = fused.rope_store_kv(F.linear(x, w_qkv), meta.positions, meta.slots, inv_freq, k_plane, v_plane, Hq, Hkv, d)
    return q, h


def _gate_up_silu(x, h: torch.Tensor, w_gate_up: torch.Tensor,
                  gemm: GemmConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(x @ gate.T) * (x @ up.T), the residual), fused into the GEMM where gemm_dispatch says so. A
    PendingNorm x is computed as the kernel reads it (its h' is the residual)."""
    from .triton_norm_gemm import PendingNorm

    if gemm is None:
        from . import triton_fused as fused

        if isinstance(x, PendingNorm):
            h, x = x.resolve()
        return fused.silu_mul(F.linear(x, w_gate_up)), h
    from . import triton_gemm

    if isinstance(x, PendingNorm):
        return triton_gemm.gate_up_silu_normed(x, w_gate_up, gemm)
    return triton_gemm.gate_up_silu(x, w_gate_up, gemm), h
