"""Load a Hugging Face Ouro checkpoint: config.json + model.safetensors (or index-listed shards).

Every tensor is checked against the config before anything is copied: unknown names, missing names and
shape mismatches raise CheckpointError naming the tensor. Weights are converted to the requested dtype and
must be finite there (a NaN or inf weight would load silently and make every log-prob NaN). A file that is
not readable safetensors (truncated, empty, garbage) raises CheckpointError naming the file, never the
library's own SafetensorError.

The bytes come through engine/weight_stream.py: read ahead with preadv into staging buffers (pinned on
CUDA; no memory map, no page faults), one queued copy per chunk of tensors out of them, converted to the
requested dtype where they land.

The finiteness check queues a reduction of every tensor where the tensors live and reads them all once
at the end (on CUDA the single sync of the load, and a single call, ``torch._foreach_norm``, for every
tensor: ``finite_flags``). Only a tensor whose flag is down is looked at again, for the message: how
many values are not finite (none: a norm overflowed on finite values, and the tensor is fine), and
whether the stored tensor already had them (else: "after conversion from ... to ..."). When several are
bad, the first in load order is named (files in the index's order, each file's tensors in its own
order).

``LoadTimings`` (pass one to load_model / load_state_dict) breaks the time down for the engine's log:
``init`` (the device's first use: the CUDA context), ``read`` (the headers, the checks against the config
and the waits for the file reads), ``to_device`` (queueing the copies and dtype conversions, with the
waits for a staging buffer) and ``check`` (queueing the reductions and the read of them: on CUDA the
wait for the last copies).
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
from .weight_stream import Span, StagedReader, shard_spans


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


def names_by_file(files: dict[str, Path]) -> dict[Path, list[str]]:
    """checkpoint_files' map turned around: each file's tensor names, in the index's order."""
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    return by_file


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


def _non_finite_error(t: torch.Tensor, file: Path, name: str) -> CheckpointError | None:
    """The message for a tensor whose flag is down: its non-finite count, and whether the stored tensor
    (read again) already had them or the conversion to t.dtype made them."""
    bad = int((~torch.isfinite(t)).sum())
    if not bad:
        return None  # the norm overflowed on finite values
    with _open_safetensors(file) as f:
        source = _read_tensor(f, file, name)
    why = "" if not bool(torch.isfinite(source).all()) else f" after conversion from {source.dtype} to {t.dtype}"
    return CheckpointError(f"{file}: tensor {name} has {bad} non-finite value(s) (NaN or inf){why}")


def finite_flags(tensors: list[torch.Tensor], one_call: bool | None = None) -> list[bool]:
    """Whether each (non-empty, one dtype, one device) tensor may be finite, in one read. `one_call` (the
    default on CUDA): one call queues every tensor's L1 norm, summed in float32 at least (NaN or inf make
    it non-finite; so can a sum of finite values past 3.4e38, which _require_finite's count settles). Else
    (the CPU's default, where that sum runs at ~1 GB/s): each tensor's aminmax (~9 GB/s; NaN propagates
    to both ends, an inf shows at one)."""
    if one_call if one_call is not None else tensors[0].device.type == "cuda":
        wide = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
        ends = torch.stack(torch._foreach_norm(tensors, 1, dtype=wide))
    else:
        ends = torch.stack([torch.stack(torch.aminmax(t)) for t in tensors])
    return torch.isfinite(ends).view(len(tensors), -1).all(dim=1).tolist()


def _require_finite(tensors: dict[str, torch.Tensor], where: list[tuple[Path, str]]) -> None:
    """Every tensor's flag (finite_flags); the first bad tensor in `where`'s order raises, once a count
    confirms it."""
    names = [name for _, name in where if tensors[name].numel()]
    if not names:
        return
    finite = dict(zip(names, finite_flags([tensors[name] for name in names])))
    for file, name in where:
        if not finite.get(name, True):
            error = _non_finite_error(tensors[name], file, name)
            if error is not None:
                raise error


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
    if device.type == "cuda" and not torch.cuda.is_available():  # a benchmark's --device default, on a CPU box
        raise ValueError(f"device {str(device)!r}, but this machine has no CUDA device (or torch was built "
                         f"without CUDA); use the CPU (--device cpu, device='cpu')")
    torch.empty(0, device=device)  # the device's first use (the CUDA context), timed on its own
    clock.init_s = time.perf_counter() - started
    by_file = names_by_file(files)
    tensors: dict[str, torch.Tensor] = {}
    where = [(file, name) for file, file_names in by_file.items() for name in file_names]
    with StagedReader(device) as reader:
        for file, file_names in by_file.items():
            t0 = time.perf_counter()
            spans = _checked_spans(file, file_names, shapes)
            clock.read_s += time.perf_counter() - t0
            t1 = time.perf_counter()
            for span, stored in reader.read_file(file, spans):  # the time in here: reads and copies
                if should_stop is not None and should_stop():  # an engine closed while starting
                    raise EngineClosedError("the engine was closed while loading the checkpoint")
                tensors[span.name] = stored if stored.dtype == dtype else stored.to(dtype)
                t2 = time.perf_counter()
                clock.to_device_s += t2 - t1
                clock.num_bytes += span.nbytes
                t1 = t2
        t0 = time.perf_counter()
        _require_finite(tensors, where)
        clock.check_s += time.perf_counter() - t0
        clock.read_s += reader.read_s  # the reads were timed inside the copies' share
        clock.to_device_s -= reader.read_s
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


def _checked_spans(file: Path, names: list[str], shapes: dict[str, tuple[int, ...]]) -> list[Span]:
    """The Spans of `names` in `file`, each checked against the index and the config (CheckpointError
    naming it)."""
    with _open_safetensors(file):  # safetensors' own reader vets the header first (not readable: named)
        pass
    spans = shard_spans(file, names)
    for span in spans:
        if span.shape != shapes[span.name]:
            raise CheckpointError(f"{file}: tensor {span.name} has shape {span.shape}, config.json implies "
                                  f"{shapes[span.name]}")
        if not span.dtype.is_floating_point:
            raise CheckpointError(f"{file}: tensor {span.name} has non-float dtype {span.dtype}")
    return spans


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
