"""EngineConfig on the command line, for every CLI (vLLM's ``EngineArgs.add_cli_args`` pattern).

``add_engine_arguments(parser)`` adds one flag per EngineConfig field, derived from the dataclass: the
flag is the field's name (``--deep-interval``), its type and metavar come from the annotation, a str
field's allowed values from ``EngineConfig``'s CHOICES (shown, not checked here: EngineConfig checks
them, so a bad value gets the same message from the CLI as from Python), and its help from the comment
beside the field in config.py (or HELP below, where the CLI says it better). A field added to EngineConfig
gets its flag with no change here. ``engine_config_from_args(args)`` is the way back.

Torch-free: ``--help`` loads no model code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ourobatch.config import CHOICES, EngineConfig

#: Flags named other than --<field-name>: "seed" is the engine's seed, and --seed means a request's in
#: `generate` (its documented meaning there); `serve` keeps --seed as another spelling of --engine-seed.
FLAG_NAMES = {"seed": "--engine-seed"}

#: Help where the comment in config.py is written for Python readers rather than for a command line.
HELP = {
    "model": "checkpoint folder (config.json + model.safetensors [+ tokenizer.json])",
    "mode": "deferred | eager | verify (see docs/semantics.md); matters only with --deep-interval > 1",
    "deep_interval": "B: deep loops run every B decoded tokens. 1 = full-depth decoding, the checkpoint's own "
                     "policy. B > 1 is an opt-in: deferred/eager read the tokens between deep calls from loop s "
                     "(faster, lossy: see docs/quality.md); verify stays exact",
    "shallow_loops": "s: loops run for every decoded token when B > 1, 1 .. total_ut_steps - 1",
    "num_kv_blocks": "KV pool size in blocks; none = automatic (CPU: room for max-num-seqs x max-model-len, capped "
                     "by --kv-cache-memory-gb; CUDA: what --gpu-memory-utilization leaves after the weights)",
    "max_num_batched_tokens": "tokens per step: one per decoding request + prompt tokens prefilled, a longer "
                              "prompt in chunks; >= --block-size",
    "max_prefill_tokens_while_decoding": "while any request decodes, at most this many prompt tokens per step, so a "
                                         "step that prefills stays near a decode step; none = only "
                                         "--max-num-batched-tokens bounds them; >= --block-size",
    "cuda_graphs": "none = on for CUDA with the Triton attention backend; true or false to choose",
    "seed": "engine seed: unseeded request i (in arrival order) gets a seed derived from (seed, i)",
    "logprobs_mode": "reported log-probs: processed (the distribution each token was drawn from: the native "
                     "Engine's and generate's default) or raw (log_softmax of the logits: vLLM's and serve's default)",
}
METAVARS = {"model": "DIR", "deep_interval": "B", "shallow_loops": "S", "max_model_len": "L",
            "kv_cache_memory_gb": "GB", "device": "DEVICE"}
NONE_WORDS = ("none", "auto")  # what an optional field's flag takes for None
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def add_engine_arguments(parser: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None,
                         aliases: Mapping[str, Sequence[str]] | None = None,
                         title: str = "engine (EngineConfig)") -> argparse._ArgumentGroup:
    """One flag per EngineConfig field, in a group of `parser` (which it returns). `defaults`: where this
    CLI's default differs from EngineConfig's (serve: logprobs_mode raw); `aliases`: more spellings of a
    field's flag (serve: --seed for --engine-seed)."""
    defaults, aliases = dict(defaults or {}), dict(aliases or {})
    unknown = sorted((set(defaults) | set(aliases)) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise ValueError(f"not EngineConfig fields: {unknown}")
    group = parser.add_argument_group(title)
    hints = _type_hints()
    for f in dataclasses.fields(EngineConfig):
        flags = [FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-")), *aliases.get(f.name, ())]
        convert, metavar = _converter(f.name, hints.get(f.name, str))
        text = _help(f.name)
        if f.name == "model":
            group.add_argument(*flags, dest=f.name, required=True, metavar=metavar, help=text)
            continue
        default = defaults.get(f.name, f.default)
        group.add_argument(*flags, dest=f.name, type=convert, default=default, metavar=metavar,
                           help=f"{text} (default: {_shown(default)})")
    return group


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the flags of add_engine_arguments describe (`overrides` replace fields); EngineConfig
    checks every value (ValueError / TypeError naming the field and the allowed values)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{**values, **overrides})


# --------------------------------------------------------------------------- types


def _type_hints() -> dict[str, Any]:
    try:
        return typing.get_type_hints(EngineConfig)
    except (NameError, TypeError):  # an annotation this Python cannot evaluate: its flag takes text
        return {}


def _converter(name: str, hint: Any) -> tuple[Callable[[str], Any], str]:
    """(argparse type, metavar) for a field of type `hint`."""
    members = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
    optional = type(None) in members
    members.discard(type(None))
    if members == {bool}:
        convert, metavar = _bool_converter(optional), "BOOL"
    elif members == {int}:
        convert, metavar = _optional(int) if optional else int, "N"
    elif members <= {int, float} and members:
        convert, metavar = _optional(float) if optional else float, "X"
    else:  # str, a path (str | Path: metavar PATH), or a type this table lacks (EngineConfig checks the text)
        convert, metavar = _optional(str) if optional else str, "PATH" if Path in members else "TEXT"
    if name in CHOICES:
        metavar = "{" + ",".join(CHOICES[name]) + "}"
    return convert, METAVARS.get(name, metavar)


def _bool_converter(optional: bool) -> Callable[[str], bool | None]:
    words = "true, false or none" if optional else "true or false"

    def convert(text: str) -> bool | None:
        lowered = text.lower()
        if optional and lowered in NONE_WORDS:
            return None
        if lowered in TRUE_WORDS:
            return True
        if lowered in FALSE_WORDS:
            return False
        raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}")

    convert.__name__ = words
    return convert


def _optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def optional(text: str) -> Any:
        return None if text.lower() in NONE_WORDS else convert(text)

    optional.__name__ = f"{convert.__name__} or none"  # argparse's "invalid int or none value: 'x'"
    return optional


def _shown(default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return str(default).lower()
    return str(default).replace("%", "%%")


# --------------------------------------------------------------------------- help


def _help(name: str) -> str:
    text = HELP.get(name) or field_comments(EngineConfig).get(name) or f"EngineConfig.{name}"
    return text.replace("%", "%%")


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """The comment beside each field of dataclass `cls` in its source, with its continuation lines (comment
    lines after the field whose text is indented past the '#'); {} where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    fields = {node.lineno: node.target.id for node in body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    starts = sorted(node.lineno for node in body)
    comments: dict[str, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line, text = tok.start[0], tok.string[1:]
        if line in fields:
            comments[fields[line]] = [text.strip()]
            continue
        before = [start for start in starts if start < line]
        owner = fields.get(before[-1]) if before else None
        if owner in comments and tok.line.lstrip().startswith("#") and text.startswith("  "):
            comments[owner].append(text.strip())  # a continuation line of that field's comment
    return {name: " ".join(parts) for name, parts in comments.items()}
