"""Request bodies of the HTTP server, as pydantic models: OpenAI's /v1/completions (with vLLM's extra
sampling fields), SGLang's /generate, and the control endpoints. Unknown fields are rejected (400 naming
the field), never dropped: a field ourobatch ignored could change what the caller gets."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ourobatch.scheduler.params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(_Strict):
    """OpenAI's legacy completions request, with vLLM's extra sampling fields."""

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
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own logs; no effect on generation
    suffix: str | None = None
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
    return_tokens_as_token_ids: bool = False
    request_id: str | None = None

    def sampling_params(self) -> SamplingParams:
        """The SamplingParams these fields ask for; ValueError/TypeError naming the field otherwise."""
        if self.echo:
            raise ValueError("echo=true is not supported (prompt log-probs are not computed); leave echo false")
        if self.suffix:
            raise ValueError("suffix is not supported (no fill-in-the-middle); leave it out")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported; leave it out or empty")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of == n, or leave it out)")
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
        return SamplingParams(**values)


class GenerateRequest(_Strict):
    """SGLang's /generate: token ids in, token ids (and their log-probs) out."""

    input_ids: Union[list[int], list[list[int]], None] = None
    text: Union[str, list[str], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    return_logprob: bool | None = False
    top_logprobs_num: int | None = 0
    logprob_start_len: int | None = None  # only -1 / None: prompt log-probs are not computed
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
