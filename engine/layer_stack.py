"""The model's layer weights stacked for gluon_layers.py's loop-pass launch (torch only).

The launch reads every layer's weights through one TMA descriptor per kind, so each kind lives in one tensor
([layers x rows, K]: qkv, o_proj, gate_up, down_proj; the four norms as [4, layers, hidden]). The modules'
parameters become views of those tensors (as fuse() makes q / k / v views of the fused qkv weight), so
weights.copy_named_tensors' in-place updates reach the launch, and CUDA graphs keep valid addresses. Made by
OuroForCausalLM.fuse_projections only where the launch can run (layers_dispatch), so CPU models and other
GPUs keep their own parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from . import layers64_dispatch as d64
from . import layers_dispatch as ld
from . import pdl

NORMS = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")


class LayerStack:
    """The stacked weights, the RoPE frequencies, the launch's counters and scratch rows, its descriptors."""

    def __init__(self, wq: torch.Tensor, wo: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, norms: torch.Tensor,
                 final_norm: torch.Tensor, inv_freq: torch.Tensor, layers: int,
                 weight_layers: int | None = None) -> None:
        # weight_layers: the layers the weight tensors hold (the warm-up's launch: fewer; the launch's TMA reads
        # past them come back as zeros), `layers` those of everything else
        self.wq, self.wo, self.wgu, self.wd = wq, wo, wgu, wd
        self.norm_table = norms  # [len(NORMS), layers, hidden] (layers64.py reads it as one tensor)
        self.norms = tuple(norms[k] for k in range(len(NORMS)))  # [layers, hidden] each, views
        self.final_norm, self.inv_freq, self.layers = final_norm, inv_freq, layers
        self.qkv_width = wq.shape[0] // (weight_layers or layers)
        self.inter = wd.shape[1]
        hidden, device = wo.shape[1], wq.device
        # never reset: a generation, then PHASES counts per layer and the launch's end count (gluon_layers.py)
        self.counters = torch.zeros(2 + ld.PHASES * layers, dtype=torch.int32, device=device)
        # the launch's per-layer rows, made here (outside any graph capture): hq hm qkv attn o act d
        widths = (hidden, hidden, self.qkv_width, hidden, hidden, self.inter, hidden)
        self.rows = tuple(torch.zeros(layers, ld.ROWS, w, dtype=wq.dtype, device=device) for w in widths)
        # per layer, o_proj's and down's rows' sums of squares, one [ROWS] per CTA (written every launch)
        self.row_sums = torch.zeros(layers, 2, ld.MAX_SMS, ld.ROWS, dtype=torch.float32, device=device)
        self.descriptors: dict = {}


def runs_on(device: torch.device, dtype: torch.dtype, hidden: int, inter: int, heads: int, kv_heads: int,
            head_dim: int, page: int) -> bool:
    """Whether a model of these shapes in `dtype` on `device` runs its decode loop passes as one launch each: the
    switch on, bf16, a Hopper GPU with Gluon, a shape layers_dispatch.shape_fits (the model's and the warm-up's
    rule: wanted, warm_runs)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not ld.switch_on():
        return False
    return (pdl.hopper(device) and pdl.gluon_importable()
            and ld.shape_fits(hidden, inter, heads, kv_heads, head_dim, page, pdl.num_sms(device)))


def wanted(model) -> bool:
    """Whether `model` (fused, on its device) gets a stack: runs_on for its weights and 16-position pages."""
    cfg, w = model.config, model.lm_head.weight
    return runs_on(w.device, w.dtype, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, ld.PAGE)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


@torch.no_grad()
def stack_layers(model) -> LayerStack:
    """Copy the fused model's layer weights into stacked tensors and make its parameters views of them."""
    cfg, layers = model.config, model.model.layers
    L, H, d = len(layers), cfg.hidden_size, cfg.head_dim
    first = layers[0]
    qkv, inter = first.self_attn.qkv_weight.shape[0], first.mlp.down_proj.weight.shape[1]
    ref = first.self_attn.qkv_weight
    wq, wo = ref.new_empty(L * qkv, H), ref.new_empty(L * H, H)
    wgu, wd = ref.new_empty(L * 2 * inter, H), ref.new_empty(L * H, inter)
    norms = ref.new_empty(len(NORMS), L, H)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        q_dim, kv_dim = attn.num_heads * d, attn.num_kv_heads * d
        wq[i * qkv:(i + 1) * qkv].copy_(attn.qkv_weight)
        attn.qkv_weight = wq[i * qkv:(i + 1) * qkv]
        attn.q_proj.weight = _param(attn.qkv_weight[:q_dim])
        attn.k_proj.weight = _param(attn.qkv_weight[q_dim:q_dim + kv_dim])
        attn.v_proj.weight = _param(attn.qkv_weight[q_dim + kv_dim:])
        wo[i * H:(i + 1) * H].copy_(attn.o_proj.weight)
        attn.o_proj.weight = _param(wo[i * H:(i + 1) * H])
        wgu[i * 2 * inter:(i + 1) * 2 * inter].copy_(mlp.gate_up_weight)
        mlp.gate_up_weight = wgu[i * 2 * inter:(i + 1) * 2 * inter]
        mlp.gate_proj.weight = _param(mlp.gate_up_weight[:inter])
        mlp.up_proj.weight = _param(mlp.gate_up_weight[inter:])
        wd[i * H:(i + 1) * H].copy_(mlp.down_proj.weight)
        mlp.down_proj.weight = _param(wd[i * H:(i + 1) * H])
        for k, name in enumerate(NORMS):
            norms[k, i].copy_(getattr(layer, name).weight)
            getattr(layer, name).weight = _param(norms[k, i])
    inv_freq = cfg.rope_theta ** (-torch.arange(0, d, 2, device=ref.device, dtype=torch.float32) / d)
    if ref.device.type == "cuda":  # the per-layer copies' blocks: cached, they would count as this process's in
        torch.cuda.empty_cache()  # the KV pool's sizing (assembly.auto_num_blocks) and shrink it by the weights
    stack = LayerStack(wq, wo, wgu, wd, norms, model.model.norm.weight, inv_freq, L)
    if ref.device.type == "cuda" and d64.switch_on() and d64.shape_fits(  # the 64-row launches' buffers and
            H, inter, cfg.num_attention_heads, cfg.num_key_value_heads, d, pdl.num_sms(ref.device)):  # compiles,
        from .layers64 import warm  # before any graph capture (layers64.py; off by default: layers64_dispatch)

        warm(stack, ref.device)
    return stack


def layers_run(stack: LayerStack | None, h: torch.Tensor, meta, pool) -> bool:
    """Whether this run_loops call goes to the loop-pass launch: a stack, decode rows it serves, a bf16 pool of
    16-position pages."""
    return (stack is not None and h.dtype == stack.wq.dtype and pool.k is not None and pool.k.dtype == h.dtype
            and pool.block_size == ld.PAGE and meta.context_lens.shape[0] == h.shape[0]  # row r is request r's
            and ld.call_fits(h.shape[0], meta.max_rows, meta.prefill, meta.tiles is not None))


def layers64_run(stack: LayerStack | None, h: torch.Tensor, meta, pool) -> bool:
    """Whether this run_loops call goes to layers64.py's launches: the switch, a stack, decode rows they serve (9..64
    requests), a bf16 pool of 16-position pages, the model's shape on this GPU (layers64_dispatch)."""
    if stack is None or not d64.switch_on() or h.dtype != stack.wq.dtype or pool.k is None:
        return False
    rows, (k, _) = h.shape[0], pool.plane(1, 0)
    kv_heads, d = k.shape[-2], k.shape[-1]
    return (d64.call_fits(rows, meta.max_rows, meta.prefill, meta.tiles is not None)
            and meta.context_lens.shape[0] == rows and pool.k.dtype == h.dtype and pool.block_size == ld.PAGE
            and d64.shape_fits(h.shape[1], stack.inter, stack.qkv_width // d - 2 * kv_heads, kv_heads, d,
                               pdl.num_sms(h.device)))


def warm_runs(s, device: torch.device) -> bool:
    """Whether an engine of these KernelShapes (kernel_cases) runs its decode loop passes as one launch each."""
    return s.triton_attention and runs_on(device, s.dtype, s.hidden_size, s.intermediate_size, s.num_heads,
                                          s.num_kv_heads, s.head_dim, s.block_size)
