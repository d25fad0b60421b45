"""OuroConfig: the model fields read from a checkpoint's config.json (never the config class defaults)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ourobatch.scheduler.errors import CheckpointError


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
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> "OuroConfig":
        model_type = raw.get("model_type")
        if model_type != "ouro":
            raise CheckpointError(f"{where}: model_type must be 'ouro', got {model_type!r}")

        def need(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise CheckpointError(f"{where}: required field {name!r} is missing")
            return raw[name]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise CheckpointError(
                f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        if raw.get("rope_scaling"):
            raise CheckpointError(f"{where}: rope_scaling {raw['rope_scaling']!r} is not supported (only null)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        total = int(raw.get("total_ut_steps", 4))
        if total < 2:
            raise CheckpointError(f"{where}: total_ut_steps must be >= 2 for deferred loops, got {total}")
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            total_ut_steps=total,
            max_position_embeddings=int(raw.get("max_position_embeddings", 65536)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            early_exit_threshold=float(raw.get("early_exit_threshold", 1.0)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype"),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "OuroConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{path}: no config.json (is this an Ouro checkpoint folder?)")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{file}: not valid JSON: {exc}") from None
        config = cls.from_dict(raw, str(file))
        gen = Path(path) / "generation_config.json"
        if gen.is_file():  # generation_config's eos wins where present, as in transformers
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
                config = dataclasses.replace(config, eos_token_ids=tuple(int(e) for e in ids))
        return config

