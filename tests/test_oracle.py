"""Tests of the float64 oracle itself (tests/oracle.py), on tiny random checkpoints."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import save_file

from tests.oracle import (
    expected_readout_loops,
    load_oracle,
    processed_logprobs,
    readout_position,
)

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


def make_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H = config["hidden_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    hd = config.get("head_dim") or H // nh
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
    H = config["hidden_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    hd = config.get("head_dim") or H // nh
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


# --------------------------------------------------------------------------- #
# Forward-pass tests
# --------------------------------------------------------------------------- #
def test_shapes_and_dtype(tmp_path):
    model, config, _ = build(tmp_path)
    assert model.total_ut_steps == 4
    assert model.config == config
    S = 9
    out = model.forward(random_ids(S))
    T, L, V, H = 4, 2, 31, 32
    assert out.logits.shape == (T, S, V)
    assert out.hidden.shape == (T, S, H)
    assert out.keys.shape == (T, L, S, 2, 8)
    assert out.values.shape == (T, L, S, 2, 8)
    assert out.gate_logits.shape == (T, S)
    for tensor in (out.logits, out.hidden, out.keys, out.values, out.gate_logits):
        assert tensor.dtype == torch.float64
        assert torch.isfinite(tensor).all()


def test_matches_independent_vectorised_reference(tmp_path):
    model, config, weights = build(tmp_path, num_hidden_layers=3, total_ut_steps=3)
    ids = random_ids(17, seed=3)
    out = model.forward(ids)
    hidden, logits, gates, keys, values = reference_forward(config, weights, ids)
    assert_close(out.hidden, hidden)
    assert_close(out.logits, logits)
    assert_close(out.gate_logits, gates)
    assert_close(out.keys, keys)
    assert_close(out.values, values)


def test_readout_is_rmsnormed_and_heads_are_linear(tmp_path):
    model, config, weights = build(tmp_path)
    out = model.forward(random_ids(6, seed=1))
    w64 = {k: v.double() for k, v in weights.items()}
    norm_w = w64["model.norm.weight"]
    # hidden = norm_w * unit-RMS vector  =>  hidden / norm_w has RMS ~1 (eps is tiny)
    rms = (out.hidden / norm_w).pow(2).mean(-1).sqrt()
    assert_close(rms, torch.ones_like(rms), tol=1e-5)
    assert_close(out.logits, out.hidden @ w64["lm_head.weight"].T)
    gate = out.hidden @ w64["model.early_exit_gate.weight"][0] + w64["model.early_exit_gate.bias"][0]
    assert_close(out.gate_logits, gate)


def test_sharded_checkpoint_identical(tmp_path):
    config = make_config()
    weights = make_weights(config, seed=5)
    write_checkpoint(tmp_path / "single", config, weights)
    write_checkpoint(tmp_path / "sharded", config, weights, sharded=True)
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    a = load_oracle(tmp_path / "single").forward(random_ids(12, seed=2))
    b = load_oracle(str(tmp_path / "sharded")).forward(random_ids(12, seed=2))
    for name in ("logits", "hidden", "keys", "values", "gate_logits"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_weights_loaded_as_float64_exactly(tmp_path):
    model, _, weights = build(tmp_path)
    for name, tensor in weights.items():
        loaded = model.weights[name]
        assert loaded.dtype == torch.float64
        assert torch.equal(loaded, tensor.double())


def test_causality(tmp_path):
    model, _, _ = build(tmp_path)
    ids = random_ids(20, seed=7)
    p = 11
    short = model.forward(ids[:p])
    full = model.forward(ids)
    assert_close(short.logits, full.logits[:, :p])
    assert_close(short.hidden, full.hidden[:, :p])
    assert_close(short.keys, full.keys[:, :, :p])
    assert_close(short.values, full.values[:, :, :p])
    assert_close(short.gate_logits, full.gate_logits[:, :p])
    # changing a later token changes later positions but not earlier ones
    altered = list(ids)
    altered[p] = (altered[p] + 1) % 31
    alt = model.forward(altered)
    assert_close(alt.logits[:, :p], full.logits[:, :p])
    assert not torch.allclose(alt.logits[:, p:], full.logits[:, p:])


def test_earlier_loops_independent_of_later_loops(tmp_path):
    config = make_config()
    weights = make_weights(config, seed=11)
    ids = random_ids(15, seed=4)
    outs = {}
    for T in (1, 2, 4):
        write_checkpoint(tmp_path / f"T{T}", make_config(total_ut_steps=T), weights)
        model = load_oracle(tmp_path / f"T{T}")
        assert model.total_ut_steps == T
        outs[T] = model.forward(ids)
    full = outs[4]
    for T in (1, 2):
        assert_close(outs[T].hidden, full.hidden[:T])
        assert_close(outs[T].logits, full.logits[:T])
        assert_close(outs[T].keys, full.keys[:T])
        assert_close(outs[T].values, full.values[:T])
        assert_close(outs[T].gate_logits, full.gate_logits[:T])
    # loops really differ from each other (the test above is not vacuous)
    for t in range(3):
        assert not torch.allclose(full.logits[t], full.logits[t + 1])
        assert not torch.allclose(full.keys[t], full.keys[t + 1])


def test_loop_input_is_previous_normed_readout(tmp_path):
    """Loop 2 of a 1-layer model == loop 1 of the same layer applied to hidden[0] as 'embeddings'."""
    config = make_config(num_hidden_layers=1, total_ut_steps=2)
    weights = make_weights(config, seed=13)
    write_checkpoint(tmp_path / "a", config, weights)
    ids = random_ids(8, seed=8)
    out = load_oracle(tmp_path / "a").forward(ids)
    # A 1-loop model with the same weights whose embedding rows are loop 1's readouts.
    write_checkpoint(tmp_path / "b", make_config(num_hidden_layers=1, total_ut_steps=1), weights)
    model_b = load_oracle(tmp_path / "b")
    model_b.embed = out.hidden[0].clone()  # row i = position i's loop-1 readout (exact float64)
    out_b = model_b.forward(list(range(len(ids))))
    assert_close(out_b.hidden[0], out.hidden[1])
    assert_close(out_b.keys[0], out.keys[1])


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_gqa_against_manual_repeat_interleave(tmp_path, num_kv_heads):
    config = make_config(
        num_hidden_layers=1, total_ut_steps=1, num_attention_heads=4, num_key_value_heads=num_kv_heads
    )
    weights = make_weights(config, seed=20 + num_kv_heads)
    write_checkpoint(tmp_path / "g", config, weights)
    model = load_oracle(tmp_path / "g")
    ids = random_ids(10, seed=num_kv_heads)
    out = model.forward(ids)
    assert out.keys.shape == (1, 1, 10, num_kv_heads, 8)

    # Manual single layer, single loop: query head h <- kv head h // (4 // num_kv_heads)
    w = {k: v.double() for k, v in weights.items()}
    p = "model.layers.0."
    eps = 1e-6
    S, nh, hd = len(ids), 4, 8
    h0 = w["model.embed_tokens.weight"][torch.tensor(ids)]
    x = _rms(h0, w[p + "input_layernorm.weight"], eps)
    q = _rope_complex((x @ w[p + "self_attn.q_proj.weight"].T).view(S, nh, hd), 10000.0)
    k = _rope_complex((x @ w[p + "self_attn.k_proj.weight"].T).view(S, num_kv_heads, hd), 10000.0)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(S, num_kv_heads, hd)
    assert_close(out.keys[0, 0], k)
    assert_close(out.values[0, 0], v)
    group = nh // num_kv_heads
    heads = []
    for qh in range(nh):
        kh = qh // group
        rows = []
        for i in range(S):
            s = torch.tensor([float(q[i, qh] @ k[j, kh]) / math.sqrt(hd) for j in range(i + 1)], dtype=torch.float64)
            rows.append(torch.softmax(s, 0) @ v[: i + 1, kh])
        heads.append(torch.stack(rows))
    a = torch.stack(heads, dim=1).reshape(S, nh * hd)
    # the same through repeat_interleave, to pin the mapping convention
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sc = torch.einsum("ihd,jhd->hij", q, kr) / math.sqrt(hd)
    sc = sc.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), NEG_INF)
    a2 = torch.einsum("hij,jhd->ihd", sc.softmax(-1), vr).reshape(S, nh * hd)
    assert_close(a, a2)
    h = h0 + _rms(a @ w[p + "self_attn.o_proj.weight"].T, w[p + "input_layernorm_2.weight"], eps)
    xm = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
    m = torch.nn.functional.silu(xm @ w[p + "mlp.gate_proj.weight"].T) * (xm @ w[p + "mlp.up_proj.weight"].T)
    h = h + _rms(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], eps)
    h = _rms(h, w["model.norm.weight"], eps)
    assert_close(out.hidden[0], h)
    assert_close(out.logits[0], h @ w["lm_head.weight"].T)


def test_config_defaults_absent_kv_heads_and_head_dim(tmp_path):
    config = make_config(num_attention_heads=4)
    del config["num_key_value_heads"]
    config["head_dim"] = None
    weights = make_weights(config, seed=30)
    write_checkpoint(tmp_path / "d", config, weights)
    model = load_oracle(tmp_path / "d")
    out = model.forward(random_ids(5))
    assert out.keys.shape == (4, 2, 5, 4, 8)  # kv heads = 4, head_dim = 32 // 4
    hidden, logits, *_ = reference_forward(config, weights, random_ids(5))
    assert_close(out.logits, logits)

    config2 = dict(config)
    del config2["head_dim"]
    write_checkpoint(tmp_path / "d2", config2, weights)
    assert_close(load_oracle(tmp_path / "d2").forward(random_ids(5)).logits, logits)


def test_head_dim_not_hidden_over_heads(tmp_path):
    model, config, weights = build(tmp_path, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=12)
    ids = random_ids(7, seed=6)
    out = model.forward(ids)
    assert out.keys.shape == (4, 2, 7, 1, 12)
    _, logits, _, keys, _ = reference_forward(config, weights, ids)
    assert_close(out.logits, logits)
    assert_close(out.keys, keys)


def test_tied_embeddings(tmp_path):
    model, config, weights = build(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in weights
    out = model.forward(random_ids(6))
    assert_close(out.logits, out.hidden @ weights["model.embed_tokens.weight"].double().T)


def test_rope_relative_position_property(tmp_path):
    """Post-RoPE q.k depends only on the position difference: same token pair at shifted positions."""
    model, _, _ = build(tmp_path, num_hidden_layers=1, total_ut_steps=1, num_key_value_heads=4)
    # Layer 0, loop 1 keys depend only on the token and its position (pre-attention).
    ids = [5] * 12
    k = model.forward(ids).keys[0, 0]  # [S, kv, d]; same token everywhere => same pre-RoPE key
    # rotation preserves norms
    norms = k.norm(dim=-1)
    assert_close(norms, norms[:1].expand_as(norms))
    # <k_m, k_n> depends only on m - n
    d01 = (k[0] * k[3]).sum(-1)
    d47 = (k[4] * k[7]).sum(-1)
    assert_close(d01, d47)
    # position 0 is unrotated: equals the raw projection
    x = model.weights["model.embed_tokens.weight"][5]
    x = model.weights["model.layers.0.input_layernorm.weight"] * x / torch.sqrt(x.pow(2).mean() + 1e-6)
    raw = (x @ model.weights["model.layers.0.self_attn.k_proj.weight"].T).view(4, 8)
    assert_close(k[0], raw)
    # position 1, pair (0, d/2) rotates by exactly 1 radian (inv_freq[0] = 1)
    c, s = math.cos(1.0), math.sin(1.0)
    assert_close(k[1, :, 0], raw[:, 0] * c - raw[:, 4] * s)
    assert_close(k[1, :, 4], raw[:, 4] * c + raw[:, 0] * s)
    # last pair of position 1 rotates by theta^(-(d-2)/d) = 10000^(-0.75)
    f = 10000.0 ** (-6 / 8)
    assert_close(k[1, :, 3], raw[:, 3] * math.cos(f) - raw[:, 7] * math.sin(f))


def test_single_token_attention_is_value(tmp_path):
    """At position 0 attention output is exactly v (softmax over one key)."""
    model, _, weights = build(tmp_path, num_hidden_layers=1, total_ut_steps=1, num_key_value_heads=1)
    out = model.forward([3])
    w = {k: v.double() for k, v in weights.items()}
    p = "model.layers.0."
    h0 = w["model.embed_tokens.weight"][3]
    v = out.values[0, 0, 0, 0]  # [8]
    a = v.repeat(4)  # every query head reads the single kv head
    h = h0 + _rms(a @ w[p + "self_attn.o_proj.weight"].T, w[p + "input_layernorm_2.weight"], 1e-6)
    xm = _rms(h, w[p + "post_attention_layernorm.weight"], 1e-6)
    m = torch.nn.functional.silu(xm @ w[p + "mlp.gate_proj.weight"].T) * (xm @ w[p + "mlp.up_proj.weight"].T)
    h = h + _rms(m @ w[p + "mlp.down_proj.weight"].T, w[p + "post_attention_layernorm_2.weight"], 1e-6)
    h = _rms(h, w["model.norm.weight"], 1e-6)
    assert_close(out.hidden[0, 0], h)


# --------------------------------------------------------------------------- #
# processed_logprobs
# --------------------------------------------------------------------------- #
def lsm(values):
    t = torch.tensor(values, dtype=torch.float64)
    return torch.log_softmax(t, 0)


def expect(kept: dict[int, float], V: int) -> torch.Tensor:
    out = torch.full((V,), NEG_INF, dtype=torch.float64)
    for i, val in kept.items():
        out[i] = val
    return out


def check(actual, expected):
    assert actual.dtype == torch.float64
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), (actual, expected)
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-12, atol=1e-12)


LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64)
# Probabilities exactly [0.5, 0.3, 0.15, 0.05] in log space.
P4 = [0.5, 0.3, 0.15, 0.05]
LOGP4 = torch.tensor([math.log(p) for p in P4], dtype=torch.float64)


def test_no_filters_is_log_softmax():
    check(processed_logprobs(LOGITS, 1.0), lsm([2, 1, 0, -1]))
    for k in (0, -1, 4, 10):
        check(processed_logprobs(LOGITS, 1.0, top_k=k), lsm([2, 1, 0, -1]))
    check(processed_logprobs(LOGITS, 1.0, top_p=1.0, min_p=0.0), lsm([2, 1, 0, -1]))


def test_top_k():
    s = lsm([2, 1])
    check(processed_logprobs(LOGITS, 1.0, top_k=2), expect({0: s[0], 1: s[1]}, 4))
    check(processed_logprobs(LOGITS, 1.0, top_k=1), expect({0: 0.0}, 4))
    s = lsm([2, 1, 0])
    check(processed_logprobs(LOGITS, 1.0, top_k=3), expect({0: s[0], 1: s[1], 2: s[2]}, 4))
    # unsorted input
    shuffled = torch.tensor([0.0, 2.0, -1.0, 1.0], dtype=torch.float64)
    s = lsm([2, 1])
    check(processed_logprobs(shuffled, 1.0, top_k=2), expect({1: s[0], 3: s[1]}, 4))


def test_top_k_ties_at_boundary_are_kept():
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    s = lsm([2, 1, 1])
    check(processed_logprobs(logits, 1.0, top_k=2), expect({0: s[0], 1: s[1], 2: s[2]}, 4))
    ties = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    check(processed_logprobs(ties, 1.0, top_k=1), lsm([1, 1, 1, 1]))


def test_temperature_scaling():
    s = lsm([1.0, 0.5, 0.0, -0.5])
    check(processed_logprobs(LOGITS, 2.0), s)
    s = lsm([4.0, 2.0, 0.0, -2.0])
    check(processed_logprobs(LOGITS, 0.5), s)
    # temperature applied before top_k (does not change the kept set here) then renormalised
    s = lsm([4.0, 2.0])
    check(processed_logprobs(LOGITS, 0.5, top_k=2), expect({0: s[0], 1: s[1]}, 4))


def test_greedy_is_temperature_one():
    check(processed_logprobs(LOGITS, 0.0), lsm([2, 1, 0, -1]))
    check(processed_logprobs(LOGITS, 0.0), processed_logprobs(LOGITS, 1.0))
    s = lsm([2, 1])
    check(processed_logprobs(LOGITS, 0.0, top_k=2), expect({0: s[0], 1: s[1]}, 4))


def test_min_p():
    # p = [0.5, 0.3, 0.15, 0.05]; min_p=0.2 -> threshold 0.1 -> drop 0.05
    out = processed_logprobs(LOGP4, 1.0, min_p=0.2)
    check(out, expect({i: math.log(P4[i] / 0.95) for i in range(3)}, 4))
    # min_p=0.5 -> threshold 0.25 -> keep 0.5 and 0.3
    out = processed_logprobs(LOGP4, 1.0, min_p=0.5)
    check(out, expect({0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}, 4))
    # min_p=1 keeps only the argmax
    check(processed_logprobs(LOGP4, 1.0, min_p=1.0), expect({0: 0.0}, 4))
    # tiny min_p keeps all
    check(processed_logprobs(LOGP4, 1.0, min_p=1e-3), LOGP4)


def test_min_p_after_temperature():
    # temperature 0.5 squares the probabilities: ~[0.25, 0.09, 0.0225, 0.0025] (unnormalised)
    # min_p=0.2 -> threshold 0.05 of max 0.25 -> keep tokens 0, 1 only (0.0225 < 0.05).
    # At temperature 1 the same min_p would keep three tokens.
    out = processed_logprobs(LOGP4, 0.5, min_p=0.2)
    sq = [0.25, 0.09]
    check(out, expect({0: math.log(sq[0] / sum(sq)), 1: math.log(sq[1] / sum(sq))}, 4))


def test_top_p():
    # sorted p = [0.5, 0.3, 0.15, 0.05]; mass before = [0, 0.5, 0.8, 0.95]
    cases = {0.7: 2, 0.85: 3, 0.99: 4, 0.4: 1, 1e-9: 1, 0.5001: 2, 0.79: 2, 0.81: 3}
    for top_p, n in cases.items():
        kept = {i: math.log(P4[i] / sum(P4[:n])) for i in range(n)}
        check(processed_logprobs(LOGP4, 1.0, top_p=top_p), expect(kept, 4))


def test_exact_boundaries():
    two = torch.tensor([0.0, 0.0], dtype=torch.float64)  # p = [0.5, 0.5] exactly
    # top_p: the second-ranked token has mass-before 0.5, which is not < 0.5 -> excluded
    out = processed_logprobs(two, 1.0, top_p=0.5)
    assert torch.isfinite(out).sum() == 1 and out.max() == 0.0
    # ... but it is kept for any top_p above 0.5
    check(processed_logprobs(two, 1.0, top_p=0.5000001), lsm([0, 0]))
    four = torch.zeros(4, dtype=torch.float64)  # p = 0.25 each; mass before 0, .25, .5, .75
    assert torch.isfinite(processed_logprobs(four, 1.0, top_p=0.5)).sum() == 2
    assert torch.isfinite(processed_logprobs(four, 1.0, top_p=0.75)).sum() == 3
    # min_p: p == min_p * max(p) is NOT excluded (only strictly smaller is)
    check(processed_logprobs(two, 1.0, min_p=1.0), lsm([0, 0]))
    check(processed_logprobs(four, 1.0, min_p=1.0), lsm([0, 0, 0, 0]))


def test_top_p_unsorted_input():
    perm = [2, 0, 3, 1]  # position i holds P4[perm[i]] -> [0.15, 0.5, 0.05, 0.3]
    logits = LOGP4[perm]
    out = processed_logprobs(logits, 1.0, top_p=0.7)  # keep 0.5 (idx 1) and 0.3 (idx 3)
    check(out, expect({1: math.log(0.5 / 0.8), 3: math.log(0.3 / 0.8)}, 4))


def test_top_p_renormalises_after_top_k():
    # after top_k=3: p' = [0.5, 0.3, 0.15] / 0.95 = [0.526, 0.316, 0.158]; mass before [0, 0.526, 0.842]
    # top_p=0.82 keeps 2 (it would keep 3 if p were not renormalised: 0.8 < 0.82)
    out = processed_logprobs(LOGP4, 1.0, top_k=3, top_p=0.82)
    check(out, expect({0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}, 4))
    out = processed_logprobs(LOGP4, 1.0, top_k=3, top_p=0.86)
    check(out, expect({i: math.log(P4[i] / 0.95) for i in range(3)}, 4))


def test_top_k_counts_only_tokens_not_excluded_by_min_p():
    # min_p=0.9 leaves only token 0, top_k=3 cannot bring others back
    check(processed_logprobs(LOGP4, 1.0, top_k=3, min_p=0.9), expect({0: 0.0}, 4))


def test_all_filters_together():
    V = 6
    probs = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    logits = torch.tensor([math.log(p) for p in probs], dtype=torch.float64)
    # min_p=0.125 -> threshold 0.05 -> drop 0.04; top_k=4 -> [0.4,.25,.15,.1] (sum .9)
    # p' = [0.444, 0.278, 0.167, 0.111]; mass before = [0, .444, .722, .889]; top_p=0.75 -> keep 3
    out = processed_logprobs(logits, 1.0, top_k=4, top_p=0.75, min_p=0.125)
    check(out, expect({i: math.log(probs[i] / 0.8) for i in range(3)}, V))


def _python_reference(logits, temperature, top_k, top_p, min_p):
    """Plain-Python restatement of the contract (no torch), for random cross-checks."""
    z = [x / temperature if temperature > 0 else x for x in logits]
    V = len(z)
    kept = set(range(V))

    def softmax(idx):
        m = max(z[i] for i in idx)
        e = {i: math.exp(z[i] - m) for i in idx}
        tot = sum(e.values())
        return {i: e[i] / tot for i in idx}

    if min_p > 0:
        p = softmax(range(V))
        pmax = max(p.values())
        kept = {i for i in kept if not p[i] < min_p * pmax}
    if 0 < top_k < V:
        vals = sorted((z[i] for i in kept), reverse=True)
        if len(vals) > top_k:
            kth = vals[top_k - 1]
            kept = {i for i in kept if z[i] >= kth}
    if top_p < 1:
        p = softmax(kept)
        order = sorted(kept, key=lambda i: -p[i])
        new, before = set(), 0.0
        for i in order:
            if before < top_p:
                new.add(i)
            before += p[i]
        kept = new
    p = softmax(kept)
    return [math.log(p[i]) if i in kept else NEG_INF for i in range(V)]


def test_random_cross_check_and_normalisation():
    rng = random.Random(1234)
    for trial in range(300):
        V = rng.choice([2, 5, 31])
        logits = torch.tensor([rng.gauss(0, 2) for _ in range(V)], dtype=torch.float64)
        temperature = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])
        top_k = rng.choice([0, -1, 1, 2, 5, 40])
        top_p = rng.choice([1.0, 0.95, 0.5, 0.1])
        min_p = rng.choice([0.0, 0.05, 0.3])
        out = processed_logprobs(logits, temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        assert out.shape == (V,)
        assert out.dtype == torch.float64
        assert torch.isfinite(out).any()
        torch.testing.assert_close(torch.logsumexp(out, 0), torch.tensor(0.0, dtype=torch.float64), atol=1e-12, rtol=0)
        # the argmax is always kept; kept tokens form a top set by logit
        assert torch.isfinite(out[logits.argmax()])
        kept = torch.isfinite(out)
        if (~kept).any():
            assert logits[kept].min() >= logits[~kept].max()
        ref = torch.tensor(_python_reference(logits.tolist(), temperature, top_k, top_p, min_p), dtype=torch.float64)
        check(out, ref)


def test_float32_input_gives_float64_output():
    out = processed_logprobs(LOGITS.float(), 1.0, top_k=2)
    assert out.dtype == torch.float64
    s = lsm([2, 1])
    check(out, expect({0: s[0], 1: s[1]}, 4))


def test_does_not_mutate_input():
    logits = LOGITS.clone()
    processed_logprobs(logits, 0.5, top_k=2, top_p=0.5, min_p=0.1)
    assert torch.equal(logits, LOGITS)


# --------------------------------------------------------------------------- #
# Readout schedule
# --------------------------------------------------------------------------- #
def test_expected_readout_loops():
    assert expected_readout_loops(6, 2, 2, 4) == [4, 2, 4, 2, 4, 2]
    assert expected_readout_loops(7, 3, 1, 4) == [4, 1, 1, 4, 1, 1, 4]
    assert expected_readout_loops(5, 1, 2, 4) == [4, 4, 4, 4, 4]
    assert expected_readout_loops(1, 8, 2, 4) == [4]
    assert expected_readout_loops(0, 2, 2, 4) == []
    assert expected_readout_loops(4, 100, 3, 4) == [4, 3, 3, 3]
    assert expected_readout_loops(5, 2, 1, 3) == [3, 1, 3, 1, 3]


def test_readout_position():
    assert readout_position(5, 1) == 4
    assert readout_position(5, 2) == 5
    assert readout_position(5, 4) == 7
    assert readout_position(1, 1) == 0
