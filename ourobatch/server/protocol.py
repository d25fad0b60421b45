"""Request bodies of the HTTP server, as pydantic models: OpenAI's /v1/completions (with vLLM's extra
sampling fields), SGLang's /generate, and the control endpoints. Unknown fields are rejected (400 naming
the field), never dropped: a field ourobatch ignored could change what the caller gets."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.params import SamplingParams

from .errors import BadRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # fields OpenAI's API declares nullable, whose null means the default (n, stream, echo, ...)
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.NULL_IS_DEFAULT:
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULL_IS_DEFAULT}
        return data

    def check_stream_options(self) -> None:
        """vLLM's rule: stream_options only with stream=true (it would change nothing otherwise)."""
        if getattr(self, "stream_options", None) is not None and not getattr(self, "stream", False):
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingExtras(_Strict):
    """The sampling fields /v1/completions and /v1/chat/completions share, with one meaning: OpenAI's and
    vLLM's extras (CompletionRequest.sampling_params applies their rules for both routes)."""

    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own logs; no effect on generation
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(SamplingExtras):
    """OpenAI's legacy completions request, with vLLM's extra sampling fields."""

    NULL_IS_DEFAULT = ("n", "stream", "echo")
    model: str | None = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    return_tokens_as_token_ids: bool | None = False
    request_id: str | None = None
    return_token_ids: bool | None = False  # vLLM: prompt_token_ids and token_ids in each choice
    prompt_logprobs: int | None = None  # vLLM: each choice's prompt_logprobs (k best; -1: all); not with stream
    # vLLM's extras with no effect on what a completion holds, accepted at any value (as vLLM ignores the
    # first three on its generation routes; stream_interval only batches a stream's chunks, ourobatch
    # sends one per step; session_id, like user, names the caller's session for its own logs)
    return_token_offsets: bool | None = False
    mm_payload: str | None = "tensors"
    return_mm_kwargs: bool | None = None
    stream_interval: int | None = Field(default=None, ge=1)
    session_id: str | None = None
    # vLLM's other extras, accepted only at their neutral value (NEUTRAL_COMPLETION_FIELDS; 400 otherwise)
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    watermarking: Any = None
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    allowed_token_ids: Any = None
    logprob_token_ids: Any = None
    bad_words: Any = None
    prompt_embeds: Any = None
    add_special_tokens: Any = True
    response_format: Any = None
    structured_outputs: Any = None
    priority: Any = 0
    routed_experts_prompt_start: Any = 0
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None

    def refused_field(self) -> BadRequest | None:
        """The 400 for the first vLLM extra set to a value ourobatch cannot honour (None if none is)."""
        for name, (neutral, why) in NEUTRAL_COMPLETION_FIELDS.items():
            value = getattr(self, name)
            if not any(value is v or (value == v and type(value) is type(v)) for v in neutral):
                return BadRequest(f"{name}={value!r} is not supported: {why}; allowed: "
                                  f"{', '.join(repr(v) for v in neutral)}", name)
        return None

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams these fields ask for; ValueError/TypeError naming the field otherwise.
        ``max_tokens: null`` is vLLM 0.32's default, 16 (its CompletionRequest.normalize_null_max_tokens;
        vLLM's chat route is what reads null as "up to the context length")."""
        refused = self.refused_field()
        if refused is not None:
            raise refused
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens=0 asks for no completion: it needs echo=true (the prompt and, with "
                             "logprobs, its log-probs, as vLLM); give max_tokens >= 1 or echo=true", "max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest("prompt_logprobs is not supported with stream=true (as in vLLM); use echo=true with "
                             "logprobs, which streams the prompt's log-probs in each choice's first chunk",
                             "prompt_logprobs")
        if self.suffix:
            raise BadRequest("suffix is not supported (no fill-in-the-middle); leave it out", "suffix")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported; leave it out or empty", "logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(f"best_of={self.best_of} is not supported (only best_of == n, or leave it out)",
                             "best_of")
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=self.max_tokens if self.max_tokens is not None else 16, seed=self.seed,
            logprobs=self.logprobs, min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, stop=self.stop or (), skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if values.get("top_k") == -1:
            values["top_k"] = 0
        # prompt log-probs: vLLM's prompt_logprobs, else with echo the logprobs k (docs/server.md)
        values["prompt_logprobs"] = self.prompt_logprobs if self.prompt_logprobs is not None else (
            self.logprobs if self.echo else None)
        if self.echo and self.max_tokens == 0:  # vLLM's echo without generation: one token is drawn, then dropped
            values["max_tokens"] = 1
        return SamplingParams(**values)


# vLLM /v1/completions extras with no counterpart here: the values that ask for nothing, and why others cannot
# be honoured. (vLLM 0.32's CompletionRequest; prompt_logprobs and echo are the prompt log-prob routes'.)
NEUTRAL_COMPLETION_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "ourobatch has no beam search"),
    "length_penalty": ((1.0, 1), "a beam-search option"),
    "watermarking": ((None, False), "ourobatch has no watermark"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated (a long one is a 400)"),
    "truncation_side": ((None, "left", "right"), "only with truncate_prompt_tokens"),
    "allowed_token_ids": ((None,), "no logits processors"),
    "logprob_token_ids": ((None, []), "log-probs of chosen ids are not computed (logprobs=k or -1 are)"),
    "bad_words": ((None, []), "no logits processors"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "add_special_tokens": ((True,), "text is encoded with the tokenizer's special tokens"),
    "response_format": ((None, {"type": "text"}), "no structured outputs"),
    "structured_outputs": ((None,), "no structured outputs"),
    "priority": ((0,), "no priority scheduling"),
    "routed_experts_prompt_start": ((0,), "Ouro is not a mixture of experts"),
    "cache_salt": ((None,), "the prefix cache is shared by every request"),
    "kv_transfer_params": ((None,), "no disaggregated serving"),
    "ec_transfer_params": ((None,), "no disaggregated serving"),
    "vllm_xargs": ((None, {}), "no custom extensions"),
    "repetition_detection": ((None,), "sequences are not ended on a repeated n-gram"),
    "thinking_token_budget": ((None, -1), "no thinking budget (-1: unlimited)"),
}


class GenerateRequest(_Strict):
    """SGLang's /generate: token ids in, token ids (and their log-probs) out."""

    input_ids: Union[list[int], list[list[int]], None] = None
    text: Union[str, list[str], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    return_logprob: bool | None = False
    top_logprobs_num: int | None = 0
    logprob_start_len: int | None = None  # with return_logprob, L >= 0: input_token_logprobs from position L
    rid: Union[str, list[str], None] = None
    stream: bool | None = False  # null: false (as every optional field below: SGLang clients send nulls)
    return_text_in_logprobs: bool | None = False  # the token's text as the third element of each triple
    # SGLang's other request fields, accepted only at the value that asks for nothing (NEUTRAL_GENERATE_FIELDS;
    # the route refuses any other value with a 400 naming the field)
    custom_logit_processor: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    lora_id: Any = None
    token_ids_logprob: Any = None
    session_params: Any = None
    modalities: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    data_parallel_rank: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    @field_validator("return_logprob", "stream", "return_text_in_logprobs", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("top_logprobs_num", mode="before")
    @classmethod
    def _null_is_zero(cls, value: Any) -> Any:
        return 0 if value is None else value

    def refused_field(self) -> tuple[str, str] | None:
        """(field, why) for the first SGLang field set to something ourobatch cannot do; None if none is."""
        for name, (neutral, why) in NEUTRAL_GENERATE_FIELDS.items():
            value = getattr(self, name)
            if not any(value is v or (value == v and type(value) is type(v)) for v in neutral):
                return name, (f"{name}={value!r} is not supported: {why}; allowed: "
                              f"{', '.join(repr(v) for v in neutral)}")
        return None


# SGLang /generate fields with no counterpart here: the values that ask for nothing, and why others cannot be
# honoured. (A data_parallel_rank of 0 names the one engine this server is.)
NEUTRAL_GENERATE_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "custom_logit_processor": ((None,), "ourobatch runs no custom logit processors"),
    "image_data": ((None, []), "Ouro is a text model"),
    "video_data": ((None, []), "Ouro is a text model"),
    "audio_data": ((None, []), "Ouro is a text model"),
    "input_embeds": ((None,), "send input_ids or text"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
    "lora_id": ((None,), "LoRA adapters are not supported"),
    "token_ids_logprob": ((None,), "log-probs of chosen token ids are not computed; use top_logprobs_num"),
    "session_params": ((None,), "sessions are not supported; send the whole prompt"),
    "modalities": ((None, []), "Ouro is a text model"),
    "return_hidden_states": ((False,), "hidden states are not returned"),
    "return_routed_experts": ((False,), "Ouro has no experts to route"),
    "data_parallel_rank": ((None, 0), "this server is one engine (rank 0)"),
    "bootstrap_host": ((None,), "prefill/decode disaggregation is not supported"),
    "bootstrap_port": ((None,), "prefill/decode disaggregation is not supported"),
    "bootstrap_room": ((None,), "prefill/decode disaggregation is not supported"),
}


class AbortRequest(_Strict):
    rid: str | None = None
    abort_all: bool = False


class PauseRequest(_Strict):
    """ourobatch's (vLLM's) modes, and SGLang's "retract" and "in_place" (control_routes.PAUSE_MODES maps them)."""

    mode: Literal["abort", "wait", "keep", "retract", "in_place"] = "abort"


class ContinueRequest(_Strict):
    torch_empty_cache: bool | None = True  # SGLang's: returns cached allocator blocks; no effect on results here


class MemoryOccupationRequest(_Strict):
    """SGLang's /release_memory_occupation and /resume_memory_occupation: which memory regions (None: all)."""

    tags: list[str] | None = None


class UpdateWeightsFromDiskRequest(_Strict):
    model_path: str
    weight_version: int | None = None  # SGLang sends a string: "7" is read as 7, "v7" and "07" are refused (400)
    load_format: str | None = None  # only None / "auto": an HF safetensors folder
    abort_all_requests: bool = False
    flush_cache: bool | None = True  # only true: a weight change always drops the prefix cache here
    is_async: bool | None = False  # only false: the update returns once the weights are in

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> int | None:
        """Checked with the body, before any engine call (so abort_all_requests aborts nothing for it)."""
        if value is None:
            return None
        # a string is read as the int it spells, and reported back as that int: "07" could not round-trip
        if isinstance(value, str) and value.isascii() and value.isdigit() and (value == "0" or value[0] != "0"):
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise ValueError(f"weight_version must be an int >= 0, a string of its decimal digits without leading "
                         f"zeros (\"7\"; reported back as 7), or null; got {value!r}")


class SleepRequest(_Strict):
    level: int = Field(default=1, ge=1, le=2)
