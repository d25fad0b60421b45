"""The fused backend's loop pass, a layer at a time (OuroForCausalLM.run_loops where neither the loop-pass launch
nor the 64-row launches serve the call): per layer 4 GEMMs, RoPE + the K / V store, attention, two add + norm +
norm (at the rows gemm_dispatch lists: o_proj and down_proj as split-K partials reduced by the add + norm kernel,
gate_up with SiLU x up in its epilogue; engine/triton_gemm.py).

The math of OuroDecoderLayer.run, written out because each residual add is fused with the norm after it, which
for the MLP's add is the next layer's input norm (or model.norm): the fusion crosses the layer boundary. Where
OUROBATCH_KV_PREFETCH is set (kv_prefetch_dispatch.py), a decode pass also asks the L2 for part of each
attention's keys and values while the GEMMs before it stream their weights. CUDA only; tests/gpu checks it
against the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kv_prefetch_dispatch as kvp
from .attention import attend, attend_o, attend_o_partials
from .batch import BatchMeta
from .gemm_dispatch import GemmConfig, gemm_config, qkv_block_d, stream_k
from .kv_cache import KVPool
from .mlp_dispatch import mlp_folds


def linear_add_norm(h: torch.Tensor, y_in: torch.Tensor, w: torch.Tensor, gemm: GemmConfig | None, which: str,
                    w_branch: torch.Tensor, w_next: torch.Tensor, eps: float,
                    before_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """h + rms(y_in @ w.T) * w_branch and its rms * w_next (the o_proj / down_proj half). `before_norm`: called
    between the split-K GEMM and the add + norm that reduces it (the prefetch's "norm" point)."""
    from . import triton_fused as fused

    if gemm is None:
        return fused.add_rms_norm2(h, F.linear(y_in, w), w_branch, w_next, eps)
    from . import triton_gemm

    splits = gemm.splits_o if which == "o" else gemm.splits_down
    partials = triton_gemm.linear_partials(y_in, w, splits, gemm)
    if before_norm is not None:
        before_norm()
    return triton_gemm.add_rms_norm2_partials(h, partials, w_branch, w_next, eps)


def qkv_rope_store(x: torch.Tensor, w_qkv: torch.Tensor, meta: BatchMeta, inv_freq: torch.Tensor,
                   k_plane: torch.Tensor, v_plane: torch.Tensor, Hq: int, Hkv: int, d: int,
                   gemm: GemmConfig | None, flags: torch.Tensor | None) -> torch.Tensor:
    """q after RoPE [rows, Hq, d], k and v written to their slots: one kernel where gemm_dispatch says so (stream-K
    on the model's flags where the config asks for it and the call is one row tile)."""
    if qkv_block_d(gemm, d):
        if flags is not None and stream_k(gemm, "qkv", x.shape[0]):
            from . import triton_streamk

            return triton_streamk.qkv_rope_store_stream(x, w_qkv, meta.positions, meta.slots, inv_freq, k_plane,
                                                        v_plane, Hq, Hkv, d, gemm, flags)
        from . import triton_gemm

        return triton_gemm.qkv_rope_store(x, w_qkv, meta.positions, meta.slots, inv_freq, k_plane, v_plane,
                                          Hq, Hkv, d, gemm)
    from . import triton_fused as fused

    return fused.rope_store_kv(F.linear(x, w_qkv), meta.positions, meta.slots, inv_freq, k_plane, v_plane, Hq, Hkv, d)


def gate_up_silu(x: torch.Tensor, w_gate_up: torch.Tensor, gemm: GemmConfig | None,
                 flags: torch.Tensor | None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T), fused into the GEMM where gemm_dispatch says so; a stream-K launch on the
    model's flags (OuroForCausalLM.stream_flags) where the config asks for one and the call is one row tile."""
    if gemm is None:
        from . import triton_fused as fused

        return fused.silu_mul(F.linear(x, w_gate_up))
    if flags is not None and stream_k(gemm, "gate", x.shape[0]):
        from . import triton_streamk

        return triton_streamk.gate_up_silu_stream(x, w_gate_up, gemm, flags)
    from . import triton_gemm

    return triton_gemm.gate_up_silu(x, w_gate_up, gemm)


def inv_freq(model, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies in float32 on `device`, kept on the model."""
    cfg = model.config
    if model.rope_inv_freq is None or model.rope_inv_freq.device != device:
        d = cfg.head_dim
        model.rope_inv_freq = cfg.rope_theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    return model.rope_inv_freq


def pass_prefetch(h: torch.Tensor, meta: BatchMeta, pool: KVPool, num_layers: int, first_loop: int,
                  last_loop: int) -> kvp.PassPrefetch:
    """The pass's prefetch launches (kv_prefetch_dispatch.PassPrefetch; a no-op where the setting is off or the
    call is not one it serves)."""
    config = kvp.setting()
    if config is not None and not kvp.call_fits(h.shape[0], meta.max_rows, meta.prefill, meta.tiles is not None,
                                                h.device.type == "cuda"):
        config = None

    def launch(k: torch.Tensor, v: torch.Tensor) -> None:
        from .kv_prefetch import prefetch_pages

        prefetch_pages(k, v, meta.block_tables, meta.context_lens, config.pages, config.from_end, config.evict_last,
                       config.line)

    return kvp.PassPrefetch(config, num_layers, first_loop, last_loop, pool.block_plane, launch)


def run_loops(model, h: torch.Tensor, meta: BatchMeta, pool: KVPool, first_loop: int,
              last_loop: int) -> list[torch.Tensor]:
    """Loops first_loop..last_loop of `model` (OuroForCausalLM, fused) over the rows h: each loop's readout."""
    from . import triton_fused as fused

    cfg, layers = model.config, model.model.layers
    eps, Hq, Hkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    freqs = inv_freq(model, h.device)
    # the skinny-batch GEMMs of triton_gemm.py for half-precision calls of the rows gemm_dispatch lists
    gemm = gemm_config(h.shape[0]) if h.dtype in (torch.bfloat16, torch.float16) else None
    prefetch = pass_prefetch(h, meta, pool, len(layers), first_loop, last_loop)
    readouts = []
    x = fused.rms_norm(h, layers[0].input_layernorm.weight, eps)
    for loop in range(first_loop, last_loop + 1):
        for i, layer in enumerate(layers):
            k_plane, v_plane = pool.plane(loop, layer.layer)
            prefetch.at("qkv", loop, i)
            q = qkv_rope_store(x, layer.self_attn.qkv_weight, meta, freqs, k_plane, v_plane, Hq, Hkv, d, gemm,
                               model.stream_flags)
            w_next = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.model.norm.weight
            h, x = attention_mlp(model, h, q, layer, meta, pool, loop, gemm, w_next, prefetch, i)
        readouts.append(x)  # rms(h, model.norm): loop `loop`'s readout and loop+1's input
        if loop < last_loop:
            h = x
            x = fused.rms_norm(h, layers[0].input_layernorm.weight, eps)
    return readouts


def attention_mlp(model, h: torch.Tensor, q: torch.Tensor, layer, meta: BatchMeta, pool: KVPool, loop: int,
                  gemm: GemmConfig | None, w_next: torch.Tensor, prefetch: kvp.PassPrefetch,
                  index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of the layer after q: attention, o_proj, the add + norm, the MLP, the add + norm into w_next.
    Where the MLP runs as one Gluon launch (mlp_dispatch.mlp_folds), o_proj's float32 output goes to it
    unreduced and the add + norm after attention runs inside it (gluon_mlp.py). `prefetch`: the pass's, asked for
    the next attention (layer `index` + 1) at "gate_up" and "norm"."""
    mlp, eps = layer.mlp, model.config.rms_norm_eps
    w_out = layer.post_attention_layernorm_2.weight
    if gemm is not None and model.mlp_barrier is not None and mlp_folds(h, mlp.gate_up_weight,
                                                                         mlp.down_proj.weight):
        from . import gluon_mlp, triton_gemm

        attn = layer.self_attn
        o = attend_o_partials(q, pool, loop, layer.layer, meta, attn.scale, attn.backend, attn.o_proj.weight,
                              model.o_barrier, h, gemm)
        h_mid, down = gluon_mlp.launch_mlp(h, o, layer.input_layernorm_2.weight,
                                           layer.post_attention_layernorm.weight, mlp.gate_up_weight,
                                           mlp.down_proj.weight, model.mlp_barrier, eps)
        return triton_gemm.add_rms_norm2_partials(h_mid, down, w_out, w_next, eps)
    h, x = attention_add_norm(model, h, q, layer, meta, pool, loop, gemm)
    prefetch.at("gate_up", loop, index + 1)
    m = gate_up_silu(x, mlp.gate_up_weight, gemm, model.stream_flags)
    return linear_add_norm(h, m, mlp.down_proj.weight, gemm, "down", w_out, w_next, eps,
                           prefetch.hook("norm", loop, index + 1))


def attention_add_norm(model, h: torch.Tensor, q: torch.Tensor, layer, meta: BatchMeta, pool: KVPool, loop: int,
                       gemm: GemmConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention, o_proj and add + norm + norm: one launch where the Gluon decode kernel folds o_proj and the add +
    norm into its tail (attention.attend_o), else attention, then o_proj with them."""
    attn, eps = layer.self_attn, model.config.rms_norm_eps
    w_branch, w_next = layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight
    if gemm is not None:
        folded = attend_o(q, pool, loop, layer.layer, meta, attn.scale, attn.backend, attn.o_proj.weight,
                          model.o_barrier, h, w_branch, w_next, eps)
        if folded is not None:
            return folded
    a = attend(q, None, None, pool, loop, layer.layer, meta, attn.scale, attn.backend)
    return linear_add_norm(h, a.reshape(q.shape[0], -1), attn.o_proj.weight, gemm, "o", w_branch, w_next, eps)
