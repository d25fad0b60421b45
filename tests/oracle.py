"""Independent float64 reference ("oracle") for the Ouro looped language model.

This module deliberately shares no code with ``ourobatch``, ``engine`` or
``scheduler``: it re-implements the forward pass of /work/shared/OURO.md from
scratch, as plainly as possible, recomputing the whole sequence with no cache.
It is meant for tiny test checkpoints (hidden 32-64, a few layers, sequences of
tens of tokens); performance is not a goal.

Public API
----------
load_oracle(checkpoint_dir) -> OracleModel
OracleModel.forward(token_ids) -> OracleOutput
processed_logprobs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0) -> Tensor
expected_readout_loops(num_tokens, deep_interval, shallow_loops, total_ut_steps) -> list[int]
readout_position(prompt_len, j) -> int
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

DTYPE = torch.float64


# --------------------------------------------------------------------------- #
# Checkpoint loading
# --------------------------------------------------------------------------- #
def _load_state_dict(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """Load every tensor of the checkpoint (single file or shards) as float64 CPU."""
    single = os.path.join(checkpoint_dir, "model.safetensors")
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    if os.path.exists(single):
        tensors.update(load_file(single, device="cpu"))
    elif os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for shard in sorted(set(weight_map.values())):
            loaded = load_file(os.path.join(checkpoint_dir, shard), device="cpu")
            for name, tensor in loaded.items():
                if name in weight_map and weight_map[name] == shard:
                    tensors[name] = tensor
        missing = set(weight_map) - set(tensors)
        if missing:
            raise KeyError(f"tensors listed in index but not found in shards: {sorted(missing)}")
    else:
        raise FileNotFoundError(
            f"neither model.safetensors nor model.safetensors.index.json in {checkpoint_dir}"
        )
    return {name: t.to(device="cpu", dtype=DTYPE) for name, t in tensors.items()}


def load_oracle(checkpoint_dir) -> "OracleModel":
    checkpoint_dir = os.fspath(checkpoint_dir)
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        config = json.load(f)
    weights = _load_state_dict(checkpoint_dir)
    return OracleModel(config, weights)


# --------------------------------------------------------------------------- #
# Building blocks
# --------------------------------------------------------------------------- #
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2, last dim) + eps), in float64."""
    mean_square = (x * x).mean(dim=-1, keepdim=True)
    return weight * (x / torch.sqrt(mean_square + eps))


def rope_cos_sin(num_positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, head_dim] for positions 0..S-1 (NeoX / rotate-half layout)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=DTYPE) / head_dim)  # [d/2]
    positions = torch.arange(num_positions, dtype=DTYPE)  # [S]
    angles = positions[:, None] * inv_freq[None, :]  # [S, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, d]
    return torch.cos(angles), torch.sin(angles)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [S, heads, d]; cos/sin: [S, d]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [rows, heads, d] with each row's halves rotated by its position x inv_freq (float64), as apply_rope with
    the tables of those positions: the fused kernels' (qkv + RoPE + store) reference on any positions."""
    angles = positions.to(DTYPE)[:, None] * inv_freq.to(DTYPE)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return apply_rope(x.to(DTYPE), torch.cos(angles), torch.sin(angles))


def qkv_rope_reference(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, n_q: int,
                       n_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [rows, heads, d] of x W^T (float64) split by heads, q and k RoPE'd at the rows' positions."""
    rows, qkv = x.shape[0], x.to(DTYPE) @ w.to(DTYPE).T
    q = rope_at(qkv[:, :n_q * d].view(rows, n_q, d), positions, inv_freq)
    k = rope_at(qkv[:, n_q * d:(n_q + n_kv) * d].view(rows, n_kv, d), positions, inv_freq)
    return q, k, qkv[:, (n_q + n_kv) * d:].view(rows, n_kv, d)


def qkv_inputs_cpu(g: torch.Generator, rows: int, n_q: int, n_kv: int, d: int, hidden: int) -> tuple:
    """Fresh float32 inputs of the fused qkv kernels in Triton's interpreter: x, w (scaled by hidden^-1/2), positions,
    distinct slots among 3 rows + 8, inv_freq (theta 10,000), and two zero planes [slots, n_kv, d]."""
    n_slots = 3 * rows + 8
    x = torch.randn(rows, hidden, generator=g)
    w = torch.randn((n_q + 2 * n_kv) * d, hidden, generator=g) / hidden ** 0.5
    pos = torch.randint(0, 4000, (rows,), generator=g)
    slots = torch.randperm(n_slots, generator=g)[:rows]
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    return x, w, pos, slots, inv_freq, torch.zeros(n_slots, n_kv, d), torch.zeros(n_slots, n_kv, d)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #
@dataclass
class OracleOutput:
    logits: torch.Tensor  # [T, S, V] float64; index t-1 is loop t's readout logits
    hidden: torch.Tensor  # [T, S, H] normed readout of each loop
    keys: torch.Tensor  # [T, L, S, kv_heads, head_dim] keys after RoPE
    values: torch.Tensor  # [T, L, S, kv_heads, head_dim]
    gate_logits: torch.Tensor  # [T, S]


class OracleModel:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        self.config = config
        self.weights = weights
        self.hidden_size = int(config["hidden_size"])
        self.num_layers = int(config["num_hidden_layers"])
        self.num_heads = int(config["num_attention_heads"])
        kv = config.get("num_key_value_heads")
        self.num_kv_heads = int(kv) if kv is not None else self.num_heads
        hd = config.get("head_dim")
        self.head_dim = int(hd) if hd is not None else self.hidden_size // self.num_heads
        self.intermediate_size = int(config["intermediate_size"])
        self.vocab_size = int(config["vocab_size"])
        self.rope_theta = float(config["rope_theta"])
        self.eps = float(config["rms_norm_eps"])
        self.total_ut_steps = int(config["total_ut_steps"])
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.group_size = self.num_heads // self.num_kv_heads

        self.embed = weights["model.embed_tokens.weight"]
        if "lm_head.weight" in weights:
            self.lm_head = weights["lm_head.weight"]
        elif config.get("tie_word_embeddings", False):
            self.lm_head = self.embed
        else:
            raise KeyError("lm_head.weight missing and tie_word_embeddings is not true")
        self.final_norm = weights["model.norm.weight"]
        self.gate_weight = weights["model.early_exit_gate.weight"]  # [1, H]
        self.gate_bias = weights["model.early_exit_gate.bias"]  # [1]

    def _w(self, layer: int, name: str) -> torch.Tensor:
        return self.weights[f"model.layers.{layer}.{name}.weight"]

    def _attention(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [S, H] already normed. Returns (o_proj output [S, H], keys, values)."""
        S = x.shape[0]
        d = self.head_dim
        q = (x @ self._w(layer, "self_attn.q_proj").T).reshape(S, self.num_heads, d)
        k = (x @ self._w(layer, "self_attn.k_proj").T).reshape(S, self.num_kv_heads, d)
        v = (x @ self._w(layer, "self_attn.v_proj").T).reshape(S, self.num_kv_heads, d)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        out = torch.zeros(S, self.num_heads, d, dtype=DTYPE)
        scale = 1.0 / math.sqrt(d)
        for h in range(self.num_heads):
            kv_h = h // self.group_size
            for i in range(S):
                # causal: query at position i sees keys at positions 0..i
                scores = (k[: i + 1, kv_h, :] @ q[i, h, :]) * scale  # [i+1]
                probs = torch.softmax(scores, dim=0)
                out[i, h, :] = probs @ v[: i + 1, kv_h, :]
        o = out.reshape(S, self.num_heads * d) @ self._w(layer, "self_attn.o_proj").T
        return o, k, v

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        gate = x @ self._w(layer, "mlp.gate_proj").T
        up = x @ self._w(layer, "mlp.up_proj").T
        return (silu(gate) * up) @ self._w(layer, "mlp.down_proj").T

    @torch.no_grad()
    def forward(self, token_ids: list[int]) -> OracleOutput:
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        S = ids.shape[0]
        T, L = self.total_ut_steps, self.num_layers
        cos, sin = rope_cos_sin(S, self.head_dim, self.rope_theta)

        all_logits, all_hidden, all_gates = [], [], []
        all_keys = torch.zeros(T, L, S, self.num_kv_heads, self.head_dim, dtype=DTYPE)
        all_values = torch.zeros_like(all_keys)

        h = self.embed[ids].clone()  # [S, H], no embedding scale
        for t in range(T):
            for layer in range(L):
                x = rms_norm(h, self._w(layer, "input_layernorm"), self.eps)
                attn, k, v = self._attention(layer, x, cos, sin)
                all_keys[t, layer] = k
                all_values[t, layer] = v
                h = h + rms_norm(attn, self._w(layer, "input_layernorm_2"), self.eps)
                x = rms_norm(h, self._w(layer, "post_attention_layernorm"), self.eps)
                h = h + rms_norm(self._mlp(layer, x), self._w(layer, "post_attention_layernorm_2"), self.eps)
            h = rms_norm(h, self.final_norm, self.eps)  # loop t's readout and loop t+1's input
            all_hidden.append(h)
            all_logits.append(h @ self.lm_head.T)
            all_gates.append((h @ self.gate_weight.T + self.gate_bias)[:, 0])

        return OracleOutput(
            logits=torch.stack(all_logits),
            hidden=torch.stack(all_hidden),
            keys=all_keys,
            values=all_values,
            gate_logits=torch.stack(all_gates),
        )

    __call__ = forward


# --------------------------------------------------------------------------- #
# Sampling contract
# --------------------------------------------------------------------------- #
def processed_logprobs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    banned_token_ids: "tuple[int, ...] | frozenset[int]" = (),
) -> torch.Tensor:
    """Log-probabilities [V] of the distribution the sampler draws from (-inf = excluded).

    Order: banned tokens (min_tokens: the stop set while fewer than min_tokens tokens exist) get logit
    -inf, then temperature, min_p, top_k, top_p, then log_softmax over the kept tokens.
    Temperature 0 (greedy) is treated as temperature 1 for log-probs.
    """
    z = torch.as_tensor(logits).to(DTYPE).flatten().clone()
    V = z.shape[0]
    for t in banned_token_ids:  # 0. min_tokens: these logits are -inf, as if the token did not exist
        z[t] = float("-inf")

    # 1. temperature
    if temperature > 0:
        z = z / temperature

    keep = torch.ones(V, dtype=torch.bool)

    # 2. min_p
    if min_p > 0:
        p = torch.softmax(z, dim=0)
        keep &= ~(p < min_p * p.max())

    # 3. top_k (0 or -1: disabled; k >= V: no-op)
    if top_k > 0 and top_k < V:
        kept_z = z[keep]
        if kept_z.numel() > top_k:
            kth_largest = torch.sort(kept_z, descending=True).values[top_k - 1]
            keep &= z >= kth_largest

    # 4. top_p
    if top_p < 1:
        kept_idx = torch.nonzero(keep).flatten()
        p_kept = torch.softmax(z[kept_idx], dim=0)
        # Stable sort: among tied probabilities, the lower token id ranks first.
        order = torch.sort(p_kept, descending=True, stable=True).indices
        sorted_p = p_kept[order]
        mass_before = torch.cumsum(sorted_p, dim=0) - sorted_p  # exclusive prefix sum
        mass_before[0] = 0.0
        survivors = kept_idx[order][mass_before < top_p]
        new_keep = torch.zeros(V, dtype=torch.bool)
        new_keep[survivors] = True
        keep = new_keep

    # 5. log_softmax over kept tokens
    out = torch.full((V,), float("-inf"), dtype=DTYPE)
    out[keep] = torch.log_softmax(z[keep], dim=0)
    return out


# --------------------------------------------------------------------------- #
# Readout schedule
# --------------------------------------------------------------------------- #
def expected_readout_loops(
    num_tokens: int, deep_interval: int, shallow_loops: int, total_ut_steps: int
) -> list[int]:
    """Loop read for generated tokens j = 1..num_tokens.

    Token j reads loop ``total_ut_steps`` when j == 1 or (j - 1) % deep_interval == 0,
    else loop ``shallow_loops``.
    """
    loops = []
    for j in range(1, num_tokens + 1):
        if j == 1 or (j - 1) % deep_interval == 0:
            loops.append(total_ut_steps)
        else:
            loops.append(shallow_loops)
    return loops


def readout_position(prompt_len: int, j: int) -> int:
    """Position whose readout produces generated token j (token 1: the last prompt position)."""
    return prompt_len + j - 2
