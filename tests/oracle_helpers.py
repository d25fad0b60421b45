"""The tiny random checkpoints the oracle's own tests run on (tests/test_oracle.py, tests/test_oracle_logprobs.py):
a config and seeded weights written as one safetensors file or two shards, and an independent, vectorised
re-derivation of the forward pass that the oracle's explicit loops are checked against."""

from __future__ import annotations

import json
import math
import random

import torch
from safetensors.torch import save_file

from tests.oracle import load_oracle

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- #
# Tiny checkpoint writer
# --------------------------------------------------------------------------- #
def make_config(**overrides) -> dict:
    config = {
        "model_type": "ouro",
        "architectures": ["OuroForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "vocab_size": 31,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 128,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def attention_dims(config: dict) -> tuple[int, int, int, int]:
    """(hidden size, query heads, kv heads, head dim) from an HF config dict, with its defaults."""
    H, nh = config["hidden_size"], config["num_attention_heads"]
    return H, nh, config.get("num_key_value_heads") or nh, config.get("head_dim") or H // nh


def make_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, nh, nkv, hd = attention_dims(config)
    inter = config["intermediate_size"]
    V = config["vocab_size"]

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(torch.float32)

    def norm_w():
        return (1.0 + 0.2 * torch.randn(H, generator=g)).to(torch.float32)

    w = {"model.embed_tokens.weight": rand(V, H, scale=1.0)}
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        w[p + "self_attn.q_proj.weight"] = rand(nh * hd, H, scale=0.6 / math.sqrt(H))
        w[p + "self_attn.k_proj.weight"] = rand(nkv * hd, H, scale=0.6 / math.sqrt(H))
        w[p + "self_attn.v_proj.weight"] = rand(nkv * hd, H, scale=1.0 / math.sqrt(H))
        w[p + "self_attn.o_proj.weight"] = rand(H, nh * hd, scale=1.0 / math.sqrt(nh * hd))
        w[p + "mlp.gate_proj.weight"] = rand(inter, H, scale=1.0 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = rand(inter, H, scale=1.0 / math.sqrt(H))
        w[p + "mlp.down_proj.weight"] = rand(H, inter, scale=1.0 / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = norm_w()
        w[p + "input_layernorm_2.weight"] = norm_w()
        w[p + "post_attention_layernorm.weight"] = norm_w()
        w[p + "post_attention_layernorm_2.weight"] = norm_w()
    w["model.norm.weight"] = norm_w()
    w["model.early_exit_gate.weight"] = rand(1, H, scale=1.0 / math.sqrt(H))
    w["model.early_exit_gate.bias"] = rand(1, scale=0.5)
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rand(V, H, scale=1.0 / math.sqrt(H))
    return w


def write_checkpoint(path, config: dict, weights: dict[str, torch.Tensor], sharded: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if not sharded:
        save_file(weights, str(path / "model.safetensors"))
        return path
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, str(path / shard))
        weight_map.update({n: shard for n in shard_names})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def build(tmp_path, name="ckpt", seed=0, sharded=False, **overrides):
    config = make_config(**overrides)
    weights = make_weights(config, seed=seed)
    write_checkpoint(tmp_path / name, config, weights, sharded=sharded)
    return load_oracle(tmp_path / name), config, weights


def random_ids(n, vocab=31, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


# --------------------------------------------------------------------------- #
# An independent, vectorised re-derivation of the forward pass (used to check the
# oracle's explicit loops). RoPE here uses the complex-number form of NeoX
# rotate-half: pair (x[i], x[i + d/2]) is the complex number x[i] + 1j*x[i + d/2].
# --------------------------------------------------------------------------- #
def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope_complex(x, theta):
    # x: [S, heads, d]
    S, _, d = x.shape
    half = d // 2
    freqs = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64) * 2 / d))
    ang = torch.arange(S, dtype=torch.float64)[:, None] * freqs[None, :]
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]  # [S, 1, half]
    c = torch.complex(x[..., :half], x[..., half:]) * rot
    return torch.cat([c.real, c.imag], dim=-1)


def reference_forward(config, weights, ids):
    w = {k: v.to(torch.float64) for k, v in weights.items()}
    H, nh, nkv, hd = attention_dims(config)
    eps = config["rms_norm_eps"]
    theta = config["rope_theta"]
    lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    S = len(ids)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    hidden, logits, gates, keys, values = [], [], [], [], []
    for _t in range(config["total_ut_steps"]):
        ks, vs = [], []
        for l in range(config["num_hidden_layers"]):
            p = f"model.layers.{l}."
            x = _rms(h, w[p + "input_layernorm.weight"], eps)
            q = _rope_complex((x @ w[p + "self_attn.q_proj.weight"].T).view(S, nh, hd), theta)
            k = _rope_complex((x @ w[p + "self_attn.k_proj.weight"].T).view(S, nkv, hd), theta)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(S, nkv, hd)
            ks.append(k)
            vs.append(v)
            kr = k.repeat_interleave(nh // nkv, dim=1)  # [S, nh, hd]
            vr = v.repeat_interleave(nh // nkv, dim=1)
            scores = torch.einsum("ihd,jhd->hij", q, kr) / math.sqrt(hd)
            scores = scores.masked_fill(~mask, NEG_INF)
            a = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vr).reshape(S, nh * hd)
            h = h + _rms(a @ w[p + "self_attn.o_proj.weight"].T, w[p + "input_layernorm_2.weight"], eps)
            x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            m = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
            h = h + _rms(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], eps)
        h = _rms(h, w["model.norm.weight"], eps)
        hidden.append(h)
        logits.append(h @ lm_head.T)
        gates.append((h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"])[:, 0])
        keys.append(torch.stack(ks))
        values.append(torch.stack(vs))
    return (
        torch.stack(hidden),
        torch.stack(logits),
        torch.stack(gates),
        torch.stack(keys),
        torch.stack(values),
    )


def assert_close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
