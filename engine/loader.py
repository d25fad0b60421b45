"""Load a Hugging Face Ouro checkpoint: config.json + model.safetensors (or index-listed shards).

Every tensor is checked against the config before anything is copied: unknown names, missing names and
shape mismatches raise CheckpointError naming the tensor. Weights are converted to the requested dtype and
must be finite there (one isfinite pass per tensor: a NaN or inf weight would load silently and make
every log-prob NaN). A file that is not readable safetensors (truncated, empty, garbage) raises
CheckpointError naming the file, never the library's own SafetensorError.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from typing import Callable

from scheduler.errors import CheckpointError, EngineClosedError

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
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:  # bad JSON, not an object, no weight_map
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} lists shard {shard.name}, which does not exist")
        return files
    if single.is_file():
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")


def _open_safetensors(file: Path):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as exc:  # the header: truncated, empty or garbage file
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


def _read_tensor(f, file: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except SafetensorError as exc:
        raise CheckpointError(f"{file}: tensor {name} could not be read ({exc})") from None


def _require_finite(t: torch.Tensor, source: torch.Tensor, file: Path, name: str) -> torch.Tensor:
    """t: the converted weight; source: as stored (to tell a stored NaN/inf from a conversion overflow)."""
    if bool(torch.isfinite(t).all()):
        return t
    bad = int((~torch.isfinite(t)).sum())
    why = "" if not bool(torch.isfinite(source).all()) else f" after conversion from {source.dtype} to {t.dtype}"
    raise CheckpointError(f"{file}: tensor {name} has {bad} non-finite value(s) (NaN or inf){why}")


def load_state_dict(path: str | Path, config: OuroConfig, dtype: torch.dtype,
                    device: torch.device | str = "cpu", should_stop: Callable[[], bool] | None = None) -> dict[str, torch.Tensor]:
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
        with _open_safetensors(file) as f:
            present = set(f.keys())
            for name in file_names:
                if name not in present:
                    raise CheckpointError(f"{file.name}: tensor {name} listed in the index is not in the file")
                t = _read_tensor(f, file, name)
                if tuple(t.shape) != shapes[name]:
                    raise CheckpointError(
                        f"{file}: tensor {name} has shape {tuple(t.shape)}, config.json implies {shapes[name]}"
                    )
                if not t.is_floating_point():
                    raise CheckpointError(f"{file}: tensor {name} has non-float dtype {t.dtype}")
                if should_stop is not None and should_stop():  # an engine closed while starting
                    raise EngineClosedError("the engine was closed while loading the checkpoint")
                tensors[name] = _require_finite(t.to(device=device, dtype=dtype), t, file, name)
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               should_stop: Callable[[], bool] | None = None) -> OuroForCausalLM:
    """Build an OuroForCausalLM from a checkpoint folder, in `dtype` on `device`, in eval mode.

    `should_stop` is polled between tensors; when it returns True loading ends with EngineClosedError."""
    config = OuroConfig.from_checkpoint(path)
    state = load_state_dict(path, config, dtype, device, should_stop)
    with torch.device("meta"):
        model = OuroForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
