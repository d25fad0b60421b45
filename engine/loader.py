"""Load a Hugging Face Ouro checkpoint: config.json + model.safetensors (or index-listed shards).

Every tensor is checked against the config before anything is copied: unknown names, missing names and
shape mismatches raise CheckpointError naming the tensor. Weights are converted to the requested dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ourobatch.scheduler.errors import CheckpointError

from .config import OuroConfig
from .model import OuroForCausalLM


def expected_shapes(config: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of an Ouro checkpoint and its shape under `config`."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
        "model.early_exit_gate.weight": (1, H),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (V, H),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_dim, H),
            p + "self_attn.k_proj.weight": (kv_dim, H),
            p + "self_attn.v_proj.weight": (kv_dim, H),
            p + "self_attn.o_proj.weight": (H, q_dim),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
            p + "input_layernorm.weight": (H,),
            p + "input_layernorm_2.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "post_attention_layernorm_2.weight": (H,),
        })
    return shapes


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file holding it."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({exc})") from None
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} lists shard {shard.name}, which does not exist")
        return files
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")


def load_state_dict(path: str | Path, config: OuroConfig, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read and validate every tensor; returns name -> tensor in `dtype` on `device`."""
    path = Path(path)
    files = checkpoint_files(path)
    shapes = expected_shapes(config)
    names = set(files)
    if config.tie_word_embeddings and "lm_head.weight" not in names:
        names.add("lm_head.weight")  # filled from the embedding below
        tied = True
    else:
        tied = False
    unknown = sorted(names - set(shapes))
    if unknown:
        raise CheckpointError(f"{path}: unknown tensor(s) {unknown[:5]} (not part of an Ouro model)")
    missing = sorted(set(shapes) - names)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing[:5]}")

    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            present = set(f.keys())
            for name in file_names:
                if name not in present:
                    raise CheckpointError(f"{file.name}: tensor {name} listed in the index is not in the file")
                t = f.get_tensor(name)
                if tuple(t.shape) != shapes[name]:
                    raise CheckpointError(
                        f"tensor {name} has shape {tuple(t.shape)}, config.json implies {shapes[name]}"
                    )
                if not t.is_floating_point():
                    raise CheckpointError(f"tensor {name} has non-float dtype {t.dtype}")
                tensors[name] = t.to(device=device, dtype=dtype)
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> OuroForCausalLM:
    """Build an OuroForCausalLM from a checkpoint folder, in `dtype` on `device`, in eval mode."""
    config = OuroConfig.from_checkpoint(path)
    state = load_state_dict(path, config, dtype, device)
    with torch.device("meta"):
        model = OuroForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
