"""Checkpoint loading: real tensor names, sharded files, dtype conversion, and clear errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from ourobatch import CheckpointError
from engine import OuroConfig, expected_shapes, load_model
from ourobatch.testing import make_tiny_checkpoint


def test_loads_every_tensor_under_its_checkpoint_name(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_key_value_heads=1, head_dim=12)
    model = load_model(ckpt, torch.float64)
    on_disk = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    assert set(state) == set(on_disk)
    for name, t in on_disk.items():
        assert state[name].dtype == torch.float64
        assert torch.equal(state[name], t.double()), name


def test_sharded_checkpoint_equals_single_file(tmp_path):
    a = load_model(make_tiny_checkpoint(tmp_path / "one", seed=3), torch.float32).state_dict()
    b = load_model(make_tiny_checkpoint(tmp_path / "four", seed=3, num_shards=4), torch.float32).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_conversion_from_bf16_checkpoint(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_model(ckpt, torch.float32)
    raw = load_file(str(ckpt / "model.safetensors"))
    assert raw["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, raw["lm_head.weight"].float())


def test_tied_embeddings_without_lm_head(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    model = load_model(ckpt)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_head_dim_absent_defaults_to_hidden_over_heads(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "nohd", head_dim=None)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("head_dim")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert OuroConfig.from_checkpoint(ckpt).head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    load_model(ckpt)


def _rewrite(ckpt, change):
    tensors = load_file(str(ckpt / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("change,match", [
    (lambda t: t.pop("model.layers.1.input_layernorm_2.weight"), r"missing tensor.*layers\.1\.input_layernorm_2"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(8)),
     r"unknown tensor.*q_norm"),
    (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.ones(65, 32)),
     r"tensor model\.layers\.0\.mlp\.up_proj\.weight has shape \(65, 32\), config\.json implies \(64, 32\)"),
    (lambda t: t.pop("lm_head.weight"), r"missing tensor.*lm_head"),
])
def test_bad_tensors_are_named(tmp_path, change, match):
    ckpt = make_tiny_checkpoint(tmp_path / "bad")
    _rewrite(ckpt, change)
    with pytest.raises(CheckpointError, match=match):
        load_model(ckpt)


@pytest.mark.parametrize("edit,match", [
    (dict(model_type="llama"), "model_type must be 'ouro', got 'llama'"),
    (dict(vocab_size=None), "required field 'vocab_size'"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
])
def test_bad_configs_are_named(tmp_path, edit, match):
    ckpt = make_tiny_checkpoint(tmp_path / "cfg")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(edit)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_model(ckpt)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    ckpt = make_tiny_checkpoint(tmp_path / "nofile")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_model(ckpt)
    sharded = make_tiny_checkpoint(tmp_path / "shards", num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lists shard model-00002-of-00002"):
        load_model(sharded)


def test_expected_shapes_cover_the_ouro_names():
    cfg = OuroConfig.from_dict(dict(model_type="ouro", vocab_size=10, hidden_size=8, intermediate_size=16,
                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
    shapes = expected_shapes(cfg)
    assert len(shapes) == 5 + 2 * 11
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (4, 8)
    assert shapes["model.early_exit_gate.bias"] == (1,)


def test_eos_comes_from_the_checkpoint(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "eos", eos_token_id=[0, 2])
    assert OuroConfig.from_checkpoint(ckpt).eos_token_ids == (0, 2)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert OuroConfig.from_checkpoint(ckpt).eos_token_ids == (2,)


# ------------------------------------------------------------------ broken checkpoints: always CheckpointError


def _edit_config(file: str = "config.json", **fields):
    def edit(ckpt):
        cfg = json.loads((ckpt / file).read_text()) if (ckpt / file).is_file() else {}
        cfg.update(fields)
        (ckpt / file).write_text(json.dumps(cfg))
    return edit


def _write(file: str, data: bytes | None = None, keep=None):
    """Replace `file` by `data`, or by the first `keep(size)` bytes of itself."""
    def edit(ckpt):
        if data is None:
            raw = (ckpt / file).read_bytes()
        (ckpt / file).write_bytes(data if data is not None else raw[:keep(len(raw))])
    return edit


def _poke(name: str, value: float):
    def edit(ckpt):
        _rewrite(ckpt, lambda t: t[name].view(-1).__setitem__(3, value))
    return edit


ST, CFG, GEN = "model.safetensors", "config.json", "generation_config.json"

BROKEN = {  # id: (corruption, file named in the message, field or tensor named in it)
    "safetensors truncated": (_write(ST, keep=lambda n: n // 2), ST, "not a readable safetensors file"),
    "safetensors header cut": (_write(ST, keep=lambda n: 5), ST, "not a readable safetensors file"),
    "safetensors empty": (_write(ST, b""), ST, "not a readable safetensors file"),
    "safetensors garbage": (_write(ST, b"\x07not safetensors at all" * 9), ST, "not a readable safetensors file"),
    "config a list": (_write(CFG, b"[1, 2, 3]"), CFG, "expected a JSON object, got list"),
    "config truncated": (_write(CFG, keep=lambda n: n - 9), CFG, "not valid JSON"),
    "config not text": (_write(CFG, b"\xff\xfe\x00garbage"), CFG, "not valid JSON"),
    "heads 0": (_edit_config(num_attention_heads=0), CFG, "num_attention_heads must be an integer >= 1, got 0"),
    "heads 0 no head_dim": (_edit_config(num_attention_heads=0, head_dim=None), CFG, "num_attention_heads"),
    "kv heads 0": (_edit_config(num_key_value_heads=0), CFG, "num_key_value_heads must be an integer >= 1"),
    "vocab many": (_edit_config(vocab_size="many"), CFG, "vocab_size must be an integer >= 1, got 'many'"),
    "vocab bool": (_edit_config(vocab_size=True), CFG, "vocab_size"),
    "hidden not divisible": (_edit_config(hidden_size=30, head_dim=None), CFG,
                             r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"),
    "odd head_dim": (_edit_config(head_dim=7), CFG, "head_dim must be even"),
    "negative intermediate": (_edit_config(intermediate_size=-64), CFG, "intermediate_size must be an integer >= 1"),
    "negative layers": (_edit_config(num_hidden_layers=-1), CFG, "num_hidden_layers"),
    "zero eps": (_edit_config(rms_norm_eps=0), CFG, "rms_norm_eps must be a finite number > 0"),
    "rope_theta string": (_edit_config(rope_theta="big"), CFG, "rope_theta"),
    "total_ut_steps 1": (_edit_config(total_ut_steps=1), CFG, "total_ut_steps must be an integer >= 2"),
    "tie not bool": (_edit_config(tie_word_embeddings="yes"), CFG, "tie_word_embeddings"),
    "eos outside vocab": (_edit_config(eos_token_id=31), CFG, r"eos_token_id \[31\] outside the vocabulary"),
    "eos negative in list": (_edit_config(eos_token_id=[0, -1]), CFG, r"eos_token_id \[-1\] outside"),
    "eos a string": (_edit_config(eos_token_id="0"), CFG, "eos_token_id must be a token id"),
    "bos outside vocab": (_edit_config(bos_token_id=99), CFG, r"bos_token_id \[99\] outside"),
    "generation_config truncated": (_write(GEN, b'{"eos_token_id": '), GEN, "not valid JSON"),
    "generation_config a list": (_write(GEN, b"[2]"), GEN, "expected a JSON object"),
    "generation eos outside vocab": (_edit_config(GEN, eos_token_id=[2, 40]), GEN,
                                     r"eos_token_id \[40\] outside the vocabulary"),
    "NaN weight": (_poke("lm_head.weight", float("nan")), ST, r"tensor lm_head\.weight has 1 non-finite value"),
    "inf weight": (_poke("model.layers.1.mlp.up_proj.weight", float("inf")), ST,
                   r"tensor model\.layers\.1\.mlp\.up_proj\.weight has 1 non-finite"),
    "-inf norm": (_poke("model.norm.weight", float("-inf")), ST, r"tensor model\.norm\.weight"),
}


@pytest.mark.parametrize("corrupt,file,needle", BROKEN.values(), ids=BROKEN.keys())
def test_broken_checkpoints_raise_checkpoint_error_naming_the_file_and_field(tmp_path, corrupt, file, needle):
    ckpt = make_tiny_checkpoint(tmp_path / "ck")
    corrupt(ckpt)
    with pytest.raises(CheckpointError) as info:
        load_model(ckpt, torch.float32)
    message = str(info.value)
    assert str(ckpt / file) in message and re.search(needle, message), message
    assert "\n" not in message


def test_weights_that_overflow_the_requested_dtype_are_named(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "big")
    _rewrite(ckpt, lambda t: t["model.embed_tokens.weight"].view(-1).__setitem__(0, 1e6))  # fp16 max: 65504
    load_model(ckpt, torch.float32)
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight has 1 non-finite value\(s\) \(NaN or inf\) "
                                              r"after conversion from torch\.float32 to torch\.float16"):
        load_model(ckpt, torch.float16)


def test_a_cuda_device_on_a_machine_without_one_is_a_clear_error(tmp_path, monkeypatch):
    # the benchmarks default to --device cuda and load the model themselves: one line saying what to pass
    ckpt = make_tiny_checkpoint(tmp_path / "m")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda', but this machine has no CUDA device.*--device cpu"):
        load_model(ckpt, torch.float32, "cuda")
