"""Tests of the float64 oracle itself (tests/oracle.py), on tiny random checkpoints (tests/oracle_helpers.py):
its forward pass, against an independent vectorised re-derivation and by the properties it must have
(causality, loops, GQA, RoPE, tied embeddings, sharded checkpoints), and its readout schedule. Its
processed_logprobs: tests/test_oracle_logprobs.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.oracle import expected_readout_loops, load_oracle, readout_position
from tests.oracle_helpers import (
    NEG_INF,
    _rms,
    _rope_complex,
    assert_close,
    build,
    make_config,
    make_weights,
    random_ids,
    reference_forward,
    write_checkpoint,
)


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
