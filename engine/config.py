"""OuroConfig: the model fields read from a checkpoint's config.json (never the config class defaults)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.errors import CheckpointError


@dataclass(frozen=True)
class OuroConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    total_ut_steps: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    early_exit_threshold: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: Any, where: str = "config.json") -> "OuroConfig":
        """Validate every field (type and range) and build the config; CheckpointError names `where` and
        the field otherwise."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type != "ouro":
            raise CheckpointError(f"{where}: model_type must be 'ouro', got {model_type!r}")
        field = _Fields(raw, where)
        heads = field.integer("num_attention_heads")
        hidden = field.integer("hidden_size")
        kv_heads = field.integer("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        if raw.get("head_dim") is None and hidden % heads:
            raise CheckpointError(f"{where}: hidden_size ({hidden}) must be divisible by num_attention_heads "
                                  f"({heads}) when head_dim is absent")
        head_dim = field.integer("head_dim", default=hidden // heads)
        if head_dim % 2:
            raise CheckpointError(f"{where}: head_dim must be even (rotary embeddings rotate halves), got {head_dim}")
        if raw.get("rope_scaling"):
            raise CheckpointError(f"{where}: rope_scaling {raw['rope_scaling']!r} is not supported (only null)")
        total = field.integer("total_ut_steps", default=4, minimum=2, why=" for deferred loops")
        vocab = field.integer("vocab_size")
        tie = raw.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise CheckpointError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
        bos = token_ids(raw.get("bos_token_id"), "bos_token_id", vocab, where, many=False)
        torch_dtype = raw.get("torch_dtype")
        if torch_dtype is not None and not isinstance(torch_dtype, str):
            raise CheckpointError(f"{where}: torch_dtype must be a string or null, got {torch_dtype!r}")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=field.integer("intermediate_size"),
            num_hidden_layers=field.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=field.number("rope_theta", default=10000.0, positive=True),
            rms_norm_eps=field.number("rms_norm_eps", default=1e-6, positive=True),
            total_ut_steps=total,
            max_position_embeddings=field.integer("max_position_embeddings", default=65536),
            tie_word_embeddings=tie,
            early_exit_threshold=field.number("early_exit_threshold", default=1.0),
            eos_token_ids=token_ids(raw.get("eos_token_id"), "eos_token_id", vocab, where),
            bos_token_id=bos[0] if bos else None,
            torch_dtype=torch_dtype,
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "OuroConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{path}: no config.json (is this an Ouro checkpoint folder?)")
        config = cls.from_dict(_read_json(file), str(file))
        gen = Path(path) / "generation_config.json"
        if gen.is_file():  # generation_config's eos wins where present, as in transformers
            raw = _read_json(gen)
            if not isinstance(raw, dict):
                raise CheckpointError(f"{gen}: expected a JSON object, got {type(raw).__name__}")
            if raw.get("eos_token_id") is not None:
                eos = token_ids(raw["eos_token_id"], "eos_token_id", config.vocab_size, str(gen))
                config = dataclasses.replace(config, eos_token_ids=eos)
        return config


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: truncated or not text
        raise CheckpointError(f"{file}: not valid JSON: {exc}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(value: Any, name: str, vocab_size: int, where: str, many: bool = True) -> tuple[int, ...]:
    """A token id field (an int, a list of ints when `many`, or null) -> ids, each in [0, vocab_size)."""
    if value is None:
        return ()
    ids = value if many and isinstance(value, list) else [value]
    if not all(_is_int(i) for i in ids):
        kind = "a token id or a list of token ids" if many else "a token id"
        raise CheckpointError(f"{where}: {name} must be {kind} (or null), got {value!r}")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise CheckpointError(f"{where}: {name} {outside} outside the vocabulary (vocab_size {vocab_size}: "
                              f"ids 0..{vocab_size - 1})")
    return tuple(ids)


class _Fields:
    """Typed, range-checked reads of config fields; errors name the file and the field."""

    def __init__(self, raw: dict[str, Any], where: str) -> None:
        self.raw, self.where = raw, where

    def _get(self, name: str, default: Any) -> Any:
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise CheckpointError(f"{self.where}: required field {name!r} is missing")
            return default
        return value

    def integer(self, name: str, default: int | None = None, minimum: int = 1, why: str = "") -> int:
        value = self._get(name, default)
        if not _is_int(value) or value < minimum:
            raise CheckpointError(f"{self.where}: {name} must be an integer >= {minimum}{why}, got {value!r}")
        return value

    def number(self, name: str, default: float, positive: bool = False) -> float:
        value = self._get(name, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (positive and value <= 0):
            allowed = "a finite number > 0" if positive else "a finite number"
            raise CheckpointError(f"{self.where}: {name} must be {allowed}, got {value!r}")
        return float(value)
