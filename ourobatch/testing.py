"""Helpers for tests, examples and benchmarks: random-weight Ouro checkpoints in the real HF format."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["OuroForCausalLM"],
    "model_type": "ouro",
    "vocab_size": 31,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def make_tiny_checkpoint(path: str | Path, *, seed: int = 0, num_shards: int = 1,
                         dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Write a random-weight Ouro checkpoint (config.json + safetensors) to `path` and return it.

    Any config field can be overridden (``vocab_size=31, hidden_size=32, num_hidden_layers=2,
    total_ut_steps=4, num_key_value_heads=1, head_dim=16, ...``). Weights are scaled so each loop
    changes the residual stream substantially, so the loops' readouts differ from each other.
    ``num_shards > 1`` writes ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
    Set ``eos_token_id=None`` for a checkpoint without an eos.
    """
    config = {**TINY_CONFIG, **overrides}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(dtype).contiguous() for name, t in _random_weights(config, seed).items()}
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for stale in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    _save_shards(path, tensors, num_shards)
    return path


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's float32 tensors, by HF name, drawn from one generator seeded with `seed`."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or H // heads
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(H, generator=g)

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(V, H, std=1.0),
        "model.norm.weight": norm_weight(),
        "model.early_exit_gate.weight": normal(1, H, std=1 / math.sqrt(H)),
        "model.early_exit_gate.bias": normal(1, std=1.0),
    }
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = normal(V, H, std=2.0 / math.sqrt(H))
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            # q/k scaled up so attention is far from uniform; residual branches are RMS-normed (~unit
            # scale), so every layer moves the stream by O(1) and each loop's readout is different.
            p + "self_attn.q_proj.weight": normal(heads * d, H, std=2.0 / math.sqrt(H)),
            p + "self_attn.k_proj.weight": normal(kv_heads * d, H, std=2.0 / math.sqrt(H)),
            p + "self_attn.v_proj.weight": normal(kv_heads * d, H, std=1.0 / math.sqrt(H)),
            p + "self_attn.o_proj.weight": normal(H, heads * d, std=1.0 / math.sqrt(heads * d)),
            p + "mlp.gate_proj.weight": normal(I, H, std=1.0 / math.sqrt(H)),
            p + "mlp.up_proj.weight": normal(I, H, std=1.0 / math.sqrt(H)),
            p + "mlp.down_proj.weight": normal(H, I, std=1.0 / math.sqrt(I)),
            p + "input_layernorm.weight": norm_weight(),
            p + "input_layernorm_2.weight": norm_weight(),
            p + "post_attention_layernorm.weight": norm_weight(),
            p + "post_attention_layernorm_2.weight": norm_weight(),
        })
    return tensors


def _save_shards(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """model.safetensors, or num_shards files with HF's model.safetensors.index.json."""
    if num_shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class InjectedFault(RuntimeError):
    """The exception a FaultInjector raises inside an engine phase."""


class FaultInjector:
    """Raise InjectedFault inside chosen engine phases (set as ``executor.fault_hook``).

    ``FaultInjector("deep", calls={0})`` fails the first deep call; ``FaultInjector("shallow",
    when=lambda ids: "req-3" in ids)`` fails every shallow call that feeds req-3. Phases:
    "prefill", "shallow", "deep".
    """

    def __init__(self, phase: str, calls: set[int] | None = None, when=None) -> None:
        from scheduler.plan import Phase

        self.phase = Phase(phase)
        self.calls = calls
        self.when = when
        self.num_calls = 0
        self.num_raised = 0

    def __call__(self, phase, request_ids: tuple[str, ...]) -> None:
        if phase != self.phase:
            return
        n = self.num_calls
        self.num_calls += 1
        if (self.calls is None or n in self.calls) and (self.when is None or self.when(request_ids)):
            self.num_raised += 1
            raise InjectedFault(f"injected {phase.value} failure (call {n})")
