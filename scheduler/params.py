"""SamplingParams: what a caller asks of one request (vLLM's names and meanings).

Part of the scheduler/engine boundary: plain Python, validated on construction, immutable. The engine's
sampler reads the sampling fields; the scheduler reads the stopping fields.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

# vLLM treats temperatures below this as greedy.
GREEDY_EPS = 1e-5
MAX_SEED = 2**63 - 1
# num_top_logprobs for logprobs=-1: more than any vocabulary, so the engine's top-k is the whole vocabulary.
ALL_TOP_LOGPROBS = 2**31 - 1
# Completions per request at most. An engine also refuses n above its max_num_seqs (EngineCore.add).
MAX_N = 4096
# Which log-probs an engine reports (EngineConfig.logprobs_mode, whose default is the facade's): "processed",
# under the distribution each token was drawn from, or "raw", log_softmax of the logits (vLLM's default).
LOGPROBS_MODES: tuple[str, ...] = ("processed", "raw")


_E = TypeVar("_E", ValueError, TypeError)


def field_error(kind: type[_E], field: str, message: str) -> _E:
    """``kind(message)``, still a plain ValueError / TypeError (what callers catch), carrying the request
    field it is about as data: ``.field``, the HTTP error body's ``param`` (ourobatch.server.errors.field_of)."""
    exc = kind(message)
    exc.field = field  # type: ignore[attr-defined]  # an optional attribute, read with getattr
    return exc


class RequestOutputKind(enum.IntEnum):
    """What each streamed output holds (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output when the request ends


def _check_int(name: str, value: Any, low: int, high: int | None = None, allowed: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise field_error(TypeError, name, f"SamplingParams.{name} must be an int, got {type(value).__name__} "
                          f"{value!r}")
    if value < low or (high is not None and value > high):
        rng = allowed or (f"{low} <= {name} <= {high}" if high is not None else f"{name} >= {low}")
        raise field_error(ValueError, name, f"SamplingParams.{name} must satisfy {rng}, got {value}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise field_error(TypeError, name, f"SamplingParams.{name} must be a number, got {type(value).__name__} "
                          f"{value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise field_error(ValueError, name, f"SamplingParams.{name} must be finite, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Field names and meanings follow vLLM.

    Log-probabilities are always *processed*: the log-probability of the sampled token under the
    distribution it was drawn from, after temperature, min-p, top-k and top-p (in that order).
    Greedy decoding (``temperature`` 0) reports them with temperature treated as 1.
    """

    n: int = 1  # completions per prompt, 1 <= n <= MAX_N (4096) and <= the engine's max_num_seqs
    temperature: float = 1.0  # 0 (or < 1e-5) = greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    seed: int | None = None  # None: one is drawn at admission and reported in the output
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end the request (kept in the output)
    ignore_eos: bool = False  # True: the checkpoint's eos does not end the request
    max_tokens: int = 16  # generated tokens at most (>= 1)
    logprobs: int | None = None  # k > 0: also report the top-k processed log-probs of every position;
    #                                -1: the whole vocabulary (vLLM); True / False are 1 / 0 (as in vLLM)
    # None: off. k >= 0: the log-prob of every prompt token (from position 1) under loop T's readout at the
    # position before it, plus the top k there; -1: the whole vocabulary (vLLM). RequestOutput.prompt_logprobs
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # for streaming
    min_tokens: int = 0  # stop tokens and eos are masked (never sampled) until this many tokens exist
    # Penalties: vLLM's names; only the neutral values are supported (anything else is a ValueError).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Text options, used by the front ends that hold a tokenizer (ourobatch.LLM, the HTTP server). The
    # token engines (Engine, SyncEngine) produce no text: they reject `stop` strings, ignore the rest.
    stop: tuple[str, ...] = ()  # strings that end the completion (the text is cut before them)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the text
    detokenize: bool = True  # produce CompletionOutput.text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # vLLM's option; tokenizer.json (fast) decoders ignore it
    # Set by the engine, not by callers (vLLM's private field of the same name): stop_token_ids plus the
    # checkpoint's eos unless ignore_eos, the tokens masked while fewer than min_tokens exist.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:  # each check names the field and what it allows; normalises in place
        self._check_sampling()
        self._check_stop_tokens()
        self._check_logprobs()
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                   allowed=f"0 <= min_tokens <= max_tokens ({self.max_tokens})")
        self._check_penalties()
        self._check_text()
        object.__setattr__(self, "_all_stop_token_ids", frozenset(self._all_stop_token_ids))
        self._check_output_kind()

    def _check_sampling(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise field_error(ValueError, "temperature",
                              f"SamplingParams.temperature must be >= 0 (0 = greedy), got {temperature}")
        object.__setattr__(self, "temperature", temperature)
        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise field_error(ValueError, "top_p", f"SamplingParams.top_p must be in (0, 1], got {top_p}")
        object.__setattr__(self, "top_p", top_p)
        _check_int("top_k", self.top_k, -1, allowed="top_k == -1, top_k == 0 (disabled) or top_k >= 1")
        min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise field_error(ValueError, "min_p", f"SamplingParams.min_p must be in [0, 1], got {min_p}")
        object.__setattr__(self, "min_p", min_p)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)

    def _check_stop_tokens(self) -> None:
        stop = self.stop_token_ids
        if stop is None:
            stop = ()
        if isinstance(stop, (str, bytes, Mapping)) or not hasattr(stop, "__iter__"):
            raise field_error(TypeError, "stop_token_ids",
                              f"SamplingParams.stop_token_ids must be a list of ints, got {stop!r}")
        stop = tuple(stop)
        for tok in stop:
            _check_int("stop_token_ids[i]", tok, 0)
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise field_error(TypeError, "ignore_eos", f"SamplingParams.ignore_eos must be a bool, got "
                              f"{self.ignore_eos!r}")
        _check_int("max_tokens", self.max_tokens, 1)

    def _check_logprobs(self) -> None:
        if isinstance(self.logprobs, bool):
            object.__setattr__(self, "logprobs", int(self.logprobs))
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, -1, allowed="logprobs >= 0 (the sampled token's log-prob plus "
                       "the top k), -1 (the whole vocabulary) or None (off)")
        if isinstance(self.prompt_logprobs, bool):
            object.__setattr__(self, "prompt_logprobs", int(self.prompt_logprobs))
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, -1,
                       allowed="prompt_logprobs >= 0 (the prompt token's own log-prob plus the top k), -1 (the "
                               "whole vocabulary) or None (off)")

    def _check_penalties(self) -> None:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if _check_float(name, getattr(self, name)) != neutral:
                raise field_error(ValueError, name, f"SamplingParams.{name}={getattr(self, name)!r} is not "
                                  f"supported: ourobatch samples without penalties, so only {name}={neutral} "
                                  f"(no penalty) is allowed")
            object.__setattr__(self, name, neutral)

    def _check_text(self) -> None:
        stops = self.stop
        if stops is None:
            stops = ()
        if isinstance(stops, str):
            stops = (stops,)
        if isinstance(stops, bytes) or not hasattr(stops, "__iter__"):
            raise field_error(TypeError, "stop",
                              f"SamplingParams.stop must be a string or a list of strings, got {stops!r}")
        stops = tuple(stops)
        for text in stops:
            if not isinstance(text, str) or not text:
                raise field_error(ValueError, "stop", f"SamplingParams.stop must hold non-empty strings, got "
                                  f"{text!r}")
        object.__setattr__(self, "stop", stops)
        for name in ("include_stop_str_in_output", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(TypeError, name, f"SamplingParams.{name} must be a bool, got "
                                  f"{getattr(self, name)!r}")

    def _check_output_kind(self) -> None:
        kind = self.output_kind
        if not isinstance(kind, RequestOutputKind):
            try:
                if isinstance(kind, (bool, float)):  # True / 1.0 would pass RequestOutputKind(kind) as DELTA
                    raise TypeError(kind)
                kind = RequestOutputKind[kind.upper()] if isinstance(kind, str) else RequestOutputKind(kind)
            except (KeyError, ValueError, TypeError):
                names = ", ".join(k.name for k in RequestOutputKind)
                raise field_error(ValueError, "output_kind",
                                  f"SamplingParams.output_kind must be one of {names}, got {kind!r}") from None
            object.__setattr__(self, "output_kind", kind)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def num_top_logprobs(self) -> int:
        """k of the top-k log-probs to report per token; logprobs=-1 (the whole vocabulary) is ALL_TOP_LOGPROBS,
        which the engine caps at its vocabulary size."""
        return ALL_TOP_LOGPROBS if self.logprobs == -1 else self.logprobs or 0

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """stop_token_ids plus the checkpoint's eos (unless ignore_eos), once the engine has set them."""
        return self._all_stop_token_ids | frozenset(self.stop_token_ids)

    def masked_token_ids(self, token_index: int) -> frozenset[int]:
        """Tokens that generated token `token_index` (1-based) may not be: the stop set while fewer than
        min_tokens tokens exist, as vLLM masks their logits; empty otherwise."""
        return self.all_stop_token_ids if token_index <= self.min_tokens else frozenset()

    def with_all_stop_token_ids(self, eos_token_ids: "frozenset[int] | tuple[int, ...]") -> "SamplingParams":
        """A copy whose stop set holds stop_token_ids plus `eos_token_ids` (the engine calls this)."""
        return dataclasses.replace(self, _all_stop_token_ids=frozenset(eos_token_ids) | set(self.stop_token_ids))

    def with_checkpoint_eos(self, eos_token_ids: "frozenset[int] | tuple[int, ...]") -> "SamplingParams":
        """A copy whose stop set is the engine's: stop_token_ids plus the checkpoint's `eos_token_ids` unless
        ignore_eos. The one derivation of what min_tokens masks, for sampling (EngineCore.add) and for
        scoring (ourobatch.training), so a score with a rollout's params masks what its sampler masked."""
        return self.with_all_stop_token_ids(() if self.ignore_eos else eos_token_ids)

    @classmethod
    def coerce(cls, params: "SamplingParams | Mapping[str, Any] | None") -> "SamplingParams":
        """Accept a SamplingParams, a plain dict of vLLM/verl field names, or None (the defaults)."""
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        if isinstance(params, Mapping):
            known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
            unknown = sorted(set(params) - known)
            if unknown:
                raise ValueError(
                    f"unknown SamplingParams field(s) {unknown}; allowed fields: {sorted(known)}"
                )
            return cls(**params)
        raise TypeError(f"params must be SamplingParams, a dict or None, got {type(params).__name__}")

    def with_seed(self, seed: int) -> "SamplingParams":
        return dataclasses.replace(self, seed=seed)
