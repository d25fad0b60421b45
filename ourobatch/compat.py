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

from ourobatch.scheduler.params import SamplingParams

FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))

# vLLM SamplingParams fields that ourobatch has no counterpart for, with the value(s) meaning "not used".
# Any other value raises: converting it away would change the results.
VLLM_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "use_beam_search": (False,), "length_penalty": (1.0,), "early_stopping": (False,),
    "prompt_logprobs": (None,), "logits_processors": (None, [], ()), "truncate_prompt_tokens": (None,),
    "guided_decoding": (None,), "structured_outputs": (None,), "logit_bias": (None, {}), "allowed_token_ids": (None,),
    "bad_words": (None, [], ()), "extra_args": (None, {}), "flat_logprobs": (False,), "logprobs_mode": (None,),
}
# vLLM fields whose every value is fine to ignore (bookkeeping with no effect on the tokens).
VLLM_IGNORED = frozenset({"output_text_buffer_length", "_all_stop_token_ids", "_bad_words_token_ids",
                          "skip_clone", "_eos_token_id"})

# SGLang name -> ourobatch name. SGLang's other sampling fields are the same as vLLM's.
SGLANG_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
                  "no_stop_trim": "include_stop_str_in_output"}
SGLANG_DEFAULTS = {"max_tokens": 128}  # SGLang's max_new_tokens default (vLLM's max_tokens is 16)
SGLANG_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "stop_regex": (None,),
    "custom_params": (None, {}), "logit_bias": (None, {}), "dtype": (None,),
}
SGLANG_IGNORED = frozenset({"stream_interval"})  # only how often a stream reports


def _reject(where: str, name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    raise ValueError(f"{where}.{name}={value!r} is not supported by ourobatch (allowed: "
                     f"{', '.join(repr(a) for a in allowed)}); remove it or use the default")


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


def from_vllm(params: Any) -> SamplingParams:
    """A ``vllm.SamplingParams`` (or anything with its attributes), converted field by field."""
    names = [n for n in dir(params) if not n.startswith("__")]
    values: dict[str, Any] = {}
    for name in names:
        try:
            value = getattr(params, name)
        except Exception:  # noqa: BLE001 - a property that cannot compute without an engine
            continue
        if callable(value) or name in VLLM_IGNORED or name.startswith("_"):
            continue
        if name in VLLM_UNSUPPORTED:
            if not any(value is a or (value == a and type(value) is type(a)) for a in VLLM_UNSUPPORTED[name]):
                if not (name == "best_of" and value == getattr(params, "n", 1)):
                    _reject("vllm.SamplingParams", name, value, VLLM_UNSUPPORTED[name])
            continue
        if name in FIELDS:
            values[name] = value
    kind = values.pop("output_kind", None)
    if kind is not None:  # vLLM's RequestOutputKind has the same names
        values["output_kind"] = getattr(kind, "name", kind)
    return SamplingParams(**_normalise(values))


def from_sglang(params: Mapping[str, Any]) -> SamplingParams:
    """An SGLang ``sampling_params`` dict (``max_new_tokens``, ``stop``, ``stop_token_ids``, ``no_stop_trim``,
    ...) -> SamplingParams, with SGLang's defaults (``max_new_tokens`` 128). Unknown keys raise."""
    return from_dict(params, dialect="sglang")


def from_dict(params: Mapping[str, Any], dialect: str = "auto", where: str = "sampling_params") -> SamplingParams:
    """A dict in vLLM's names (``dialect="vllm"``), SGLang's (``"sglang"``) or either (``"auto"``: SGLang's
    names are translated, and SGLang's defaults apply when one of its own names is used)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{where} must be a JSON object / dict, got {type(params).__name__}")
    unknown = set(params) - set(FIELDS)
    if dialect == "vllm" or (dialect == "auto" and not unknown):
        if unknown:
            raise ValueError(f"unknown {where} field(s) {sorted(unknown)}; allowed: {sorted(FIELDS)}")
        return SamplingParams(**_normalise(dict(params)))
    if dialect not in ("sglang", "auto"):
        raise ValueError(f"dialect must be 'vllm', 'sglang' or 'auto', got {dialect!r}")
    values: dict[str, Any] = dict(SGLANG_DEFAULTS)
    seen: dict[str, str] = {}
    for key, value in params.items():
        if key in SGLANG_UNSUPPORTED:
            if not any(value == a for a in SGLANG_UNSUPPORTED[key]):
                _reject(where, key, value, SGLANG_UNSUPPORTED[key])
            continue
        if key in SGLANG_IGNORED:
            continue
        name = SGLANG_RENAMES.get(key, key)
        if name not in FIELDS:
            allowed = sorted(set(FIELDS) | set(SGLANG_RENAMES) | set(SGLANG_IGNORED))
            raise ValueError(f"unknown {where} field {key!r}; allowed: {allowed}")
        if name in seen:
            raise ValueError(f"{where} gives {name!r} twice, as {seen[name]!r} and as {key!r}; use one")
        seen[name] = key
        values[name] = value
    return SamplingParams(**_normalise(values))


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
class Logprob:
    """vLLM's Logprob: one token's log-prob, its rank among the processed log-probs (1 = the most likely;
    None for a sampled token outside the top k asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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
    token_logprobs: list[float] = field(default_factory=list)  # processed log-prob of each token (always)
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
    prompt_logprobs: None = None
    num_cached_tokens: int = 0
    metrics: None = None
    lora_request: None = None


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
                ranked = list(top.items())[:params.logprobs]
                pos = {t: entry(t, v, r) for r, (t, v) in enumerate(ranked, start=1)}
                pos.setdefault(tok, entry(tok, lp, None))
            else:
                pos = {tok: entry(tok, lp, None)}
            logprobs.append(pos)
    return LLMCompletionOutput(
        index=c.index, text=text, token_ids=token_ids, cumulative_logprob=float(sum(lps)), logprobs=logprobs,
        finish_reason=finish, stop_reason=reason, token_logprobs=lps, readout_loops=list(c.readout_loops[:n]),
        seed=c.seed, weight_version=c.weight_version)
