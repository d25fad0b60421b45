"""Optional dependencies: which extra of ``pip install "ourobatch[...]"`` installs each, and the one error a
missing one raises.

``import ourobatch`` and the engines need only the core dependencies (torch, safetensors, numpy, structlog,
anyio, tqdm). Each feature below imports its packages through ``require`` when it is first used, so a plain
``pip install -e .`` runs token-id generation, and a feature whose extra is missing stops with one line
naming the command that installs it, instead of a raw ModuleNotFoundError deep in a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> the importable packages it installs (pyproject.toml's [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "text": ("tokenizers", "jinja2"),  # text prompts and output text (tokenizer.json), chat templates
    "server": ("fastapi", "uvicorn", "prometheus_client", "tokenizers", "jinja2"),  # python -m ourobatch serve
    "ray": ("ray",),  # ourobatch.ray.EnginePool
}


class MissingExtraError(ImportError):
    """An optional package a feature needs is not installed; the message names the pip install to run."""


def install_hint(extra: str) -> str:
    return f'pip install "ourobatch[{extra}]"'


def missing_extra(package: str, extra: str, feature: str) -> MissingExtraError:
    """The error for `feature` lacking `package` (installed by `extra`)."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    return MissingExtraError(f"{feature} needs the `{package}` package, which is not installed: "
                             f"{install_hint(extra)}")


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``import module``, or raise MissingExtraError naming `extra`'s pip install. A package that is there
    but lacks one of its own dependencies (fastapi without starlette) is reported by the missing name."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:  # also `sys.modules[name] = None` (import halted)
        raise missing_extra(exc.name or module, extra, feature) from None


def require_extra(extra: str, feature: str) -> None:
    """Import every package of `extra` (MissingExtraError for the first one missing)."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    for module in EXTRAS[extra]:
        require(module, extra, feature)
