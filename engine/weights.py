"""Weights in place and the engine's sleep: what an RL loop does between rollout phases.

``copy_named_tensors`` copies (Hugging Face name, tensor) pairs into the live model's parameters in
place, one tensor at a time (a generator of buckets never has to be held whole): the fused q/k/v and
gate/up weights are views of the named ones' storage (model.fuse_projections), so a copy into a named
weight updates the fused GEMM weight too, and CUDA graphs, which captured those storages' addresses,
stay valid. Every tensor is checked before it is copied (name, shape, floating dtype, finite values,
at most once per call); a bad one raises WeightUpdateError naming it and listing what was already
copied, so the caller knows whether the model is now half-updated.

``checkpoint_tensors`` (load_weights) streams a checkpoint's tensors onto the engine's device through
engine/weight_stream.py's staging buffers, a chunk at a time.

The executor's sleep (level 1) keeps its weights as a ``cpu_copy``; its wake_up builds the model again
with ``rebuild_model`` (from that copy, or zeroed after level 2, when a full update_weights /
load_weights must follow). The executor frees and reallocates its own pool and buffers;
``free_device_memory`` hands what it dropped back to the device at once.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Iterable, Iterator

import torch

from scheduler.errors import WeightUpdateError

from .config import OuroConfig
from .loader import checkpoint_files, expected_shapes, finite_flags, names_by_file
from .model import OuroForCausalLM
from .weight_stream import StagedReader, shard_spans


def copy_named_tensors(model: OuroForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy each (name, tensor) into `model` in place; returns the names copied, in order."""
    shapes = expected_shapes(model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    copied: list[str] = []
    seen: set[str] = set()

    def fail(message: str) -> WeightUpdateError:
        done = (f"; {len(copied)} tensor(s) were already copied ({', '.join(copied[:3])}"
                f"{', ...' if len(copied) > 3 else ''})" if copied else "; nothing was copied")
        return WeightUpdateError(message + done, copied=tuple(copied))

    if isinstance(named_tensors, (str, bytes, dict)):
        raise TypeError("update_weights takes an iterable of (name, tensor) pairs (e.g. model.named_parameters() "
                        "or dict.items()), got " + type(named_tensors).__name__)
    items = iter(named_tensors)
    try:
        for item in items:
            _copy_one(item, shapes, params, seen, copied, fail)
    except WeightUpdateError:
        raise
    except Exception as exc:  # the caller's iterator failed part-way (a shard, a bucket): say what was copied
        raise fail(f"the update failed: {type(exc).__name__}: {exc}") from exc
    finally:
        close = getattr(items, "close", None)
        if close is not None:  # a generator left part-way (a bad tensor) ends now: load_weights' reader with it
            close()
    return copied


def _copy_one(item, shapes, params, seen, copied, fail) -> None:
    if not (isinstance(item, tuple) and len(item) == 2):
        raise fail(f"each item must be a (name, tensor) pair, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str) or name not in shapes:
        raise fail(f"unknown tensor name {name!r}: not a tensor of this Ouro checkpoint (e.g. "
                   f"'model.layers.0.self_attn.q_proj.weight')")
    if name in seen:
        raise fail(f"tensor {name} appears twice in one update")
    seen.add(name)
    if not isinstance(tensor, torch.Tensor):
        raise fail(f"tensor {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shapes[name]:
        raise fail(f"tensor {name} has shape {tuple(tensor.shape)}, the checkpoint's is {shapes[name]}")
    if not tensor.is_floating_point():
        raise fail(f"tensor {name} has dtype {tensor.dtype}; weights must be floating point (they are "
                   f"converted to the engine's dtype)")
    if not _finite(tensor):
        raise fail(f"tensor {name} holds NaN or inf values")
    target = params[name]
    with torch.no_grad():
        target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
    copied.append(name)


def _finite(t: torch.Tensor) -> bool:
    """No NaN or inf in t: loader.finite_flags' aminmax (exact, ~9x faster than isfinite().all() on the CPU)."""
    return t.numel() == 0 or finite_flags([t.detach()], one_call=False)[0]


def checkpoint_tensors(path: str | Path, config: OuroConfig,
                       device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of an HF checkpoint folder (single file or shards), one chunk of them
    at a time, on `device` in the dtype as stored: read through engine/weight_stream.py's staging buffers
    (on CUDA pinned: the copies queue, no sync per tensor). CheckpointError for a file whose header does not
    describe it or lacks a tensor its index lists (weight_stream.shard_spans)."""
    files = checkpoint_files(Path(path))
    tied = config.tie_word_embeddings and "lm_head.weight" not in files
    embedding = None
    with StagedReader(torch.device(device)) as reader:
        for file, names in names_by_file(files).items():
            for span, tensor in reader.read_file(file, shard_spans(file, names)):
                if tied and span.name == "model.embed_tokens.weight":
                    embedding = tensor
                yield span.name, tensor
    if tied and embedding is not None:
        yield "lm_head.weight", embedding


# ---------------------------------------------------------------------- the weights' side of sleep / wake


def cpu_copy(model: OuroForCausalLM, pin: bool) -> dict[str, torch.Tensor]:
    """Every tensor of `model`'s state dict copied to CPU memory; `pin` (a CUDA model): into pinned memory
    (a fast way back), each copy queued straight into it and one sync at the end. (The copy through pageable
    memory it replaces synced once per tensor and copied each again to pin it: sleep(1) took 3.1 s on the
    H200 for Ouro-1.4B, h200_rl_ops.json.)"""
    state = model.state_dict()
    if not pin:
        return {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
    copies = {}
    for name, t in state.items():
        copies[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copies[name].copy_(t.detach(), non_blocking=True)
    devices = {t.device for t in state.values() if t.is_cuda}
    for device in devices:
        torch.cuda.synchronize(device)  # every copy has landed before the caller frees the device memory
    return copies


def rebuild_model(config: OuroConfig, state: dict[str, torch.Tensor] | None, dtype: torch.dtype,
                  device: torch.device) -> OuroForCausalLM:
    """A fused eval-mode model on `device` holding `state` (a cpu_copy), or, for None (sleep level 2),
    zeros in every tensor: the caller must then load every tensor before serving (the engine refuses
    until then)."""
    with torch.device("meta"):
        model = OuroForCausalLM(config, init_weights=False)
    if state is not None:
        state = {name: t.to(device=device, non_blocking=True) for name, t in state.items()}
    else:
        state = {name: torch.zeros(shape, dtype=dtype, device=device)
                 for name, shape in expected_shapes(config).items()}
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model = model.eval().requires_grad_(False)
    model.fuse_projections()
    return model


def free_device_memory(device: torch.device, clear_cublas: bool = False) -> None:
    """Give dropped weights, pools and graphs back to the device now (sleep, close)."""
    # torch builds modules on the meta device with reference cycles (nn.Embedding's init frames), so
    # the model is only freed by the cycle collector: run it now rather than some time later.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None) if clear_cublas else None
        if clear is not None:  # cuBLAS keeps a workspace per stream it saw (graph capture streams too)
            clear()
        torch.cuda.empty_cache()  # cached blocks count as used in the next engine's mem_get_info
