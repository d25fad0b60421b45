"""The Ouro looped decoder: one layer stack applied in loops 1..T, one KV plane per loop (OURO.md).

Module names mirror the Hugging Face checkpoint, so ``state_dict()`` keys are the checkpoint's tensor
names. The forward runs an arbitrary loop range over a batch of rows, which is all the engine needs:
prefill runs loops 1..T over prompt tokens, a shallow step loops 1..s over one fed token, a deep call
loops s+1..T over retained loop-s rows at their original positions.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .batch import BatchMeta
from .config import OuroConfig
from .kv_cache import KVPool
from .layer_stack import layers64_run, layers_run, stack_layers, wanted as stack_wanted
from .gemm_dispatch import new_stream_flags
from .mlp_dispatch import new_counters


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE run in float32 for low-precision models, in the model dtype otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_logits(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The lm_head matmul in `dtype` (None: the weight's). h: [..., hidden], weight: [vocab, hidden].

    `EngineConfig.head_dtype="float32"` passes float32: a bf16 model's logits are then computed from fp32
    copies of the readout and the weight (exact conversions) with fp32 output, as RL trainers run their
    head, instead of being rounded to bf16. The copy is made per call, never cached, so it is always the
    current weight (in-place updates, sleep) and holds no memory between steps."""
    if dtype is None or dtype == weight.dtype:
        return F.linear(h.to(weight.dtype), weight)
    return F.linear(h.to(dtype), weight.to(dtype))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(_compute_dtype(dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """NeoX rotate-half RoPE, inv_freq = theta^(-arange(0, d, 2) / d), the same in every loop."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [rows, heads, head_dim], positions: [rows]
        return self.rotate(x, *self.cos_sin(positions, x.dtype))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every row's angles, [rows, 1, head_dim] in `dtype` (the rows' dtype): a step
        computes them once for all its layer passes (BatchMeta.rope)."""
        cdt = _compute_dtype(dtype)
        inv_freq = self.theta ** (-torch.arange(0, self.head_dim, 2, device=positions.device, dtype=cdt)
                                  / self.head_dim)
        freqs = positions.to(cdt)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None, :].to(dtype), emb.sin()[:, None, :].to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.scale = d**-0.5
        self.qkv_weight: torch.Tensor | None = None  # set by fuse(): q, k, v stacked, one GEMM
        self.backend = "torch"  # "torch" (reference) or "triton"

    def fuse(self) -> None:
        """One [q; k; v] weight; the three projections become views of it (state_dict unchanged)."""
        fused = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).contiguous()
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj.weight = nn.Parameter(fused[:q_dim], requires_grad=False)
        self.k_proj.weight = nn.Parameter(fused[q_dim:q_dim + kv_dim], requires_grad=False)
        self.v_proj.weight = nn.Parameter(fused[q_dim + kv_dim:], requires_grad=False)
        self.qkv_weight = fused

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, fused: bool = True,
                cos_sin: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (after RoPE) and v of every row. x: [..., hidden] (rows = its leading dims flattened),
        positions: [rows] -> q: [rows, heads, d], k, v: [rows, kv_heads, d]. `fused`: one [q; k; v] GEMM
        when fuse() ran (the dense path passes False: it keeps the separate projections). `cos_sin`: a
        per-step cache of the rows' cos / sin by dtype (BatchMeta.rope), filled on first use."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if fused and self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight).split([q_dim, kv_dim, kv_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        cached = None if cos_sin is None else cos_sin.get(q.dtype)
        if cached is None:
            cached = rope.cos_sin(positions, q.dtype)
            if cos_sin is not None:
                cos_sin[q.dtype] = cached
        q = rope.rotate(q.reshape(-1, self.num_heads, self.head_dim), *cached)
        k = rope.rotate(k.reshape(-1, self.num_kv_heads, self.head_dim), *cached)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, meta: BatchMeta, rope: RotaryEmbedding, pool: KVPool, loop: int,
                layer: int) -> torch.Tensor:
        """The paged backend: keys and values to the pool, attention over it. x: [rows, hidden] -> same."""
        q, k, v = self.project(x, meta.positions, rope, cos_sin=meta.rope)
        pool.write(loop, layer, meta.slots, k, v)  # keys are stored after RoPE
        a = attend(q, k, v, pool, loop, layer, meta, self.scale, self.backend)
        return self.o_proj(a.reshape(x.shape[0], self.num_heads * self.head_dim))

    def dense(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """The dense backend: causal attention over whole sequences, no pool (differentiable).
        x: [b, L, hidden], positions: [b * L] -> [b, L, hidden]."""
        b, L = x.shape[:2]
        q, k, v = self.project(x, positions, rope, fused=False)
        q, k, v = (t.reshape(b, L, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [b, heads, L, d]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(a.transpose(1, 2).reshape(b, L, -1))


class OuroMLP(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()

    def fuse(self) -> None:
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight]).contiguous()
        inter = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(fused[:inter], requires_grad=False)
        self.up_proj.weight = nn.Parameter(fused[inter:], requires_grad=False)
        self.gate_up_weight = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroDecoderLayer(nn.Module):
    def __init__(self, config: OuroConfig, layer: int) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer = layer
        self.self_attn = OuroAttention(config)
        self.mlp = OuroMLP(config)
        self.input_layernorm = RMSNorm(H, eps)  # before attention
        self.input_layernorm_2 = RMSNorm(H, eps)  # on the attention output, before the residual add
        self.post_attention_layernorm = RMSNorm(H, eps)  # before the MLP (the name misleads)
        self.post_attention_layernorm_2 = RMSNorm(H, eps)  # on the MLP output, before the residual add

    def forward(self, h: torch.Tensor, meta: BatchMeta, rope: RotaryEmbedding, pool: KVPool,
                loop: int) -> torch.Tensor:
        # h: [rows, hidden] -> [rows, hidden], over the paged pool
        return self.run(h, lambda x: self.self_attn(x, meta, rope, pool, loop, self.layer))

    def run(self, h: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer's math, once: `attention` maps the normed input to the attention output (the paged
        backend in forward(), the dense one in dense_loops). h: [..., hidden] -> same shape."""
        h = h + self.input_layernorm_2(attention(self.input_layernorm(h)))
        m = self.mlp(self.post_attention_layernorm(h))
        return h + self.post_attention_layernorm_2(m)


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig, init_weights: bool = True) -> None:
        super().__init__()
        V, H = config.vocab_size, config.hidden_size
        # init_weights=False (the loaders, on the meta device): no normal_ init of the embedding, which on
        # meta runs through torch._refs and imports torch._dynamo and sympy (1-4 s of an engine's startup)
        self.embed_tokens = nn.Embedding(V, H) if init_weights else nn.Embedding(V, H, _weight=torch.empty(V, H))
        self.layers = nn.ModuleList(OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # at the end of every loop
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)


class OuroForCausalLM(nn.Module):
    def __init__(self, config: OuroConfig, init_weights: bool = True) -> None:
        super().__init__()
        self.config = config
        self.model = OuroModel(config, init_weights)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.fused_kernels = False
        self.rope_inv_freq: torch.Tensor | None = None  # the fused pass's (fused_pass.inv_freq)
        # the grid barrier's two counters of the decode kernel that folds o_proj (gluon_attention_o.py): made
        # with the fused backend, outside any graph capture, and kept (graphs capture their address)
        self.o_barrier: torch.Tensor | None = None
        self.mlp_barrier: torch.Tensor | None = None  # the same for the MLP launch (gluon_mlp.py)
        self.stream_flags: torch.Tensor | None = None  # the stream-K GEMMs' flags (triton_streamk.py), the same way
        self.layer_stack = None  # the stacked weights of the loop-pass launch (layer_stack.py), where it runs

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up into single GEMMs (the named weights stay, as views)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.layer_stack = stack_layers(self) if stack_wanted(self) else None

    def set_attention_backend(self, backend: str) -> None:
        """"torch": the reference path. "triton": the Triton attention kernel plus the fused elementwise
        kernels of triton_fused.py (CUDA; needs fuse_projections())."""
        if backend not in ("torch", "triton"):
            raise ValueError(f"attention backend must be 'torch' or 'triton', got {backend!r}")
        for layer in self.model.layers:
            layer.self_attn.backend = backend
        self.fused_kernels = backend == "triton"
        device = self.lm_head.weight.device
        if self.fused_kernels and device.type == "cuda" and self.o_barrier is None:
            self.o_barrier = torch.zeros(2, dtype=torch.int32, device=device)
            self.mlp_barrier = new_counters(device)
            self.stream_flags = new_stream_flags(device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def run_loops(self, h: torch.Tensor, meta: BatchMeta, pool: KVPool, first_loop: int,
                  last_loop: int) -> list[torch.Tensor]:
        """Run loops first_loop..last_loop; return each loop's normed readout (index 0 = first_loop).

        h: [rows, hidden], the input of first_loop (embeddings for loop 1, else loop first_loop-1's
        readout). Writes each loop's keys and values at the rows' slots in that loop's plane.
        """
        if self.fused_kernels and layers_run(self.layer_stack, h, meta, pool):
            from .gluon_layers import run_loops  # every layer of a loop pass as one launch

            return run_loops(self, h, meta, pool, first_loop, last_loop)
        if self.fused_kernels and layers64_run(self.layer_stack, h, meta, pool):
            from .layers64 import run_loops  # 9..64 requests: a launch per layer between the attention calls
            return run_loops(self, h, meta, pool, first_loop, last_loop)
        if self.fused_kernels:
            from .fused_pass import run_loops  # the per-layer kernels (fused_pass.py)

            return run_loops(self, h, meta, pool, first_loop, last_loop)
        readouts = []
        for loop in range(first_loop, last_loop + 1):
            for layer in self.model.layers:
                h = layer(h, meta, self.rope, pool, loop)
            h = self.model.norm(h)  # loop `loop`'s readout and loop+1's input
            readouts.append(h)
        return readouts

    def logits(self, h: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        # h: [..., hidden] readout -> [..., vocab], in `dtype` (None: the model's)
        return head_logits(h, self.lm_head.weight, dtype)

    def exit_gate(self, h: torch.Tensor) -> torch.Tensor:
        # h: [rows, hidden] -> [rows] gate logits (sigmoid gives lambda_t)
        return self.model.early_exit_gate(h).squeeze(-1)

    def dense_loops(self, token_ids: torch.Tensor) -> list[torch.Tensor]:
        """Every loop's normed readout over whole sequences with no KV pool: causal attention recomputed
        over all positions in every layer of every loop. token_ids: [b, L] -> T x [b, L, hidden].

        The no-cache, differentiable path: training (examples/train_looped_model.py) and the quality
        harness's readout KL use it; serving uses run_loops."""
        b, L = token_ids.shape
        pos = torch.arange(L, device=token_ids.device).repeat(b)
        h = self.embed(token_ids)
        readouts = []
        for _ in range(self.config.total_ut_steps):
            for layer in self.model.layers:
                h = layer.run(h, lambda x, attn=layer.self_attn: attn.dense(x, pos, self.rope))
            h = self.model.norm(h)  # this loop's readout and the next loop's input
            readouts.append(h)
        return readouts
