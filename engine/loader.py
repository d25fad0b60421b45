"""Load a Hugging Face Ouro checkpoint: config.json + model.safetensors (or index-listed shards).

Every tensor is checked against the config before anything is copied: unknown names, missing names and
shape mismatches raise CheckpointError naming the tensor. Weights are converted to the requested dtype and
must be finite there (a NaN or inf weight would load silently and make every log-prob NaN). A file that is
not readable safetensors (truncated, empty, garbage) raises CheckpointError naming the file, never the
library's own SafetensorError.

The finiteness check is one reduction per tensor queued where the tensor lives (``torch.aminmax``: NaN
propagates to both ends, an inf shows at one; no [numel] bool temporary, about 9x faster than
``isfinite().all()`` on the CPU) and one read of all the flags at the end: on CUDA a single sync instead
of one per tensor. Only when a flag is down is the bad tensor looked at again, for the message: how many
values are not finite, and whether the stored tensor already was (else: "after conversion from ... to
..."). On CUDA the bytes go through two pinned staging buffers (a copy from the mapped file into one
overlaps the device copy out of the other) and are converted to the requested dtype on the device.

``LoadTimings`` (pass one to load_model / load_state_dict) breaks the time down for the engine's log:
``init`` (the device's first use: the CUDA context), ``read`` (safetensors' reads and the checks against
the config; the file is memory-mapped, so its pages come in at their first touch, counted in the phase
that touches them), ``to_device`` (copies and dtype conversions, with the waits for a staging buffer) and
``check`` (queueing the reductions and the final read of their flags: on CUDA the wait for the last copies).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
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


STAGE_BYTES = 64 << 20  # each of the two pinned staging buffers of a CUDA load


@dataclass
class LoadTimings:
    """Where a load's time went (seconds; the module docstring defines the phases), for the engine's log."""

    init_s: float = 0.0
    read_s: float = 0.0
    to_device_s: float = 0.0
    check_s: float = 0.0
    total_s: float = 0.0
    num_bytes: int = 0  # as stored
    num_tensors: int = 0

    def fields(self) -> dict[str, float | int]:
        """The breakdown as log fields (weights_*)."""
        return dict(weights_init_s=round(self.init_s, 3), weights_read_s=round(self.read_s, 3),
                    weights_to_device_s=round(self.to_device_s, 3), weights_check_s=round(self.check_s, 3),
                    weights_total_s=round(self.total_s, 3), weights_gb=round(self.num_bytes / 1e9, 3),
                    weights_gb_per_s=round(self.num_bytes / 1e9 / self.total_s, 2) if self.total_s else None,
                    weights_tensors=self.num_tensors)


class _Staged:
    """Host-to-device copies through two pinned buffers: filling one from the mapped file overlaps the
    device's copy out of the other (the copies from pageable memory it replaces each wait for the device)."""

    def __init__(self) -> None:
        self.buffers = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst (device) <- src (host, same dtype and shape), queued."""
        s, d = src.contiguous().view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        for start in range(0, s.numel(), STAGE_BYTES):
            i, self.turn = self.turn, 1 - self.turn
            if self.events[i] is not None:
                self.events[i].synchronize()  # the device has read this buffer's last chunk
            n = min(STAGE_BYTES, s.numel() - start)
            buffer = self.buffers[i][:n]
            buffer.copy_(s[start:start + n])
            d[start:start + n].copy_(buffer, non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record()

    def close(self) -> None:
        for event in self.events:
            if event is not None:
                event.synchronize()


def _to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype, staged: _Staged | None) -> torch.Tensor:
    """t (as stored, on the CPU) in `dtype` on `device`; on CUDA through the staging buffers, converted there."""
    if staged is None:
        return t.to(device=device, dtype=dtype)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    staged.copy(t, out)
    return out if out.dtype == dtype else out.to(dtype)


def _finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on t's device, queued: every value of t is finite (aminmax propagates NaN, shows inf)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _non_finite_error(t: torch.Tensor, file: Path, name: str) -> CheckpointError:
    """The message for a tensor whose flag is down: its non-finite count, and whether the stored tensor
    (read again) already had them or the conversion to t.dtype made them."""
    bad = int((~torch.isfinite(t)).sum())
    with _open_safetensors(file) as f:
        source = _read_tensor(f, file, name)
    why = "" if not bool(torch.isfinite(source).all()) else f" after conversion from {source.dtype} to {t.dtype}"
    return CheckpointError(f"{file}: tensor {name} has {bad} non-finite value(s) (NaN or inf){why}")


def _require_finite(tensors: dict[str, torch.Tensor], flags: list[torch.Tensor], where: list[tuple[Path, str]]
                    ) -> None:
    """One read of every tensor's flag (on CUDA the one sync of the load); the first bad tensor raises."""
    if not flags:
        return
    for ok, (file, name) in zip(torch.stack(flags).tolist(), where):
        if not ok:
            raise _non_finite_error(tensors[name], file, name)


def load_state_dict(path: str | Path, config: OuroConfig, dtype: torch.dtype,
                    device: torch.device | str = "cpu", should_stop: Callable[[], bool] | None = None,
                    timings: LoadTimings | None = None) -> dict[str, torch.Tensor]:
    """Read and validate every tensor; returns name -> tensor in `dtype` on `device`. `timings`, when
    given, gets the load's time breakdown (LoadTimings)."""
    path = Path(path)
    files = checkpoint_files(path)
    shapes = expected_shapes(config)
    tied = _check_names(path, set(files), shapes, config.tie_word_embeddings)
    clock = timings if timings is not None else LoadTimings()
    started = time.perf_counter()
    device = torch.device(device)
    torch.empty(0, device=device)  # the device's first use (the CUDA context), timed on its own
    staged = _Staged() if device.type == "cuda" else None
    clock.init_s = time.perf_counter() - started
    tensors: dict[str, torch.Tensor] = {}
    flags: list[torch.Tensor] = []
    where: list[tuple[Path, str]] = []
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    try:
        for file, file_names in by_file.items():
            with _open_safetensors(file) as f:
                present = set(f.keys())
                for name in file_names:
                    t0 = time.perf_counter()
                    t = _checked_tensor(f, file, name, present, shapes[name])
                    if should_stop is not None and should_stop():  # an engine closed while starting
                        raise EngineClosedError("the engine was closed while loading the checkpoint")
                    t1 = time.perf_counter()
                    tensors[name] = _to_device(t, device, dtype, staged)
                    t2 = time.perf_counter()
                    flags.append(_finite_flag(tensors[name]))
                    where.append((file, name))
                    clock.read_s += t1 - t0
                    clock.to_device_s += t2 - t1
                    clock.check_s += time.perf_counter() - t2
                    clock.num_bytes += t.numel() * t.element_size()
        t0 = time.perf_counter()
        _require_finite(tensors, flags, where)
        clock.check_s += time.perf_counter() - t0
    finally:
        if staged is not None:
            staged.close()  # no copy out of a staging buffer outlives the load
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    clock.num_tensors = len(where)
    clock.total_s = time.perf_counter() - started
    return tensors


def _check_names(path: Path, names: set[str], shapes: dict[str, tuple[int, ...]], tie_word_embeddings: bool) -> bool:
    """CheckpointError for unknown or missing tensor names; True when lm_head is the embedding (tied, absent)."""
    tied = tie_word_embeddings and "lm_head.weight" not in names
    if tied:
        names = names | {"lm_head.weight"}  # filled from the embedding
    unknown = sorted(names - set(shapes))
    if unknown:
        raise CheckpointError(f"{path}: unknown tensor(s) {unknown[:5]} (not part of an Ouro model)")
    missing = sorted(set(shapes) - names)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing[:5]}")
    return tied


def _checked_tensor(f, file: Path, name: str, present: set[str], shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor `name` as stored, checked against the index and the config (CheckpointError naming it)."""
    if name not in present:
        raise CheckpointError(f"{file.name}: tensor {name} listed in the index is not in the file")
    t = _read_tensor(f, file, name)
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{file}: tensor {name} has shape {tuple(t.shape)}, config.json implies {shape}")
    if not t.is_floating_point():
        raise CheckpointError(f"{file}: tensor {name} has non-float dtype {t.dtype}")
    return t


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               should_stop: Callable[[], bool] | None = None, timings: LoadTimings | None = None) -> OuroForCausalLM:
    """Build an OuroForCausalLM from a checkpoint folder, in `dtype` on `device`, in eval mode.

    `should_stop` is polled between tensors; when it returns True loading ends with EngineClosedError.
    `timings` (a LoadTimings), when given, gets the load's time breakdown."""
    config = OuroConfig.from_checkpoint(path)
    state = load_state_dict(path, config, dtype, device, should_stop, timings)
    with torch.device("meta"):
        model = OuroForCausalLM(config, init_weights=False)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
