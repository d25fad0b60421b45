"""What the routers read from ``request.app.state``, in one place (create_app sets it; the routers, each
in the module of its concern, only read it):

    served                  ServedModel: the model, its name and tokenizer, fixed when the app is built
    engine                  the Engine (None until the app's lifespan starts it; it closes with the app)
    gen                     completions.Generation over that engine (the generation routes' machinery)
    metrics                 metrics.ServerMetrics, the app's own Prometheus registry
    draining                True once SIGTERM (or the lifespan's end) starts the drain
    recompute_on_continue   set by /pause_generation mode "retract", read by /continue_generation
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ourobatch.config import EngineConfig
from ourobatch.text import Tokenizer

from .limits import DEFAULT_MAX_COMPLETIONS


def model_card(path: Path) -> dict[str, Any]:
    """model_type and architectures from the checkpoint's config.json (None where it has none)."""
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        hf = {}
    return {"model_type": hf.get("model_type"), "architectures": hf.get("architectures")}


@dataclass(frozen=True)
class ServedModel:
    """The model one app serves, as its routes describe it (/v1/models, /get_model_info, /get_server_info)."""

    config: EngineConfig
    name: str  # the model id clients send (--served-model-name; default: the checkpoint folder)
    tokenizer: Tokenizer | None  # None: text prompts are refused (400)
    health_check_timeout: float  # seconds /health_generate waits for an engine step
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created"
    card: dict[str, Any] = field(default_factory=dict)  # model_card(config.model), read once
    max_completions: int = DEFAULT_MAX_COMPLETIONS  # prompts x n a request may ask for (limits.py)
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)

    @classmethod
    def of(cls, config: EngineConfig, name: str | None, tokenizer: Tokenizer | None,
           health_check_timeout: float, max_completions: int = DEFAULT_MAX_COMPLETIONS,
           prompt_tokens_details: bool = False) -> "ServedModel":
        return cls(config, name or str(config.model), tokenizer, health_check_timeout,
                   card=model_card(Path(config.model)), max_completions=max_completions,
                   prompt_tokens_details=prompt_tokens_details)

    @property
    def tokenizer_path(self) -> str | None:
        return str(self.tokenizer.path) if self.tokenizer is not None and self.tokenizer.path is not None else None
