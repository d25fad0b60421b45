"""vLLM and SGLang sampling parameters in, vLLM output shapes out (ourobatch.compat), and text handling
(ourobatch.text) with the shipped model's real tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from ourobatch import CompletionOutput, SamplingParams
from ourobatch.compat import Logprob, from_dict, from_sglang, from_vllm, to_sampling_params, to_vllm_completion
from ourobatch.text import StopChecker, Tokenizer, completion_text

MODEL = Path(__file__).resolve().parents[1] / "models" / "pointer-chase"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(MODEL)


def test_vllm_fields_are_accepted_as_vllm_does():
    p = SamplingParams(logprobs=True, min_tokens=2, max_tokens=4, stop="x", skip_special_tokens=False,
                       presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1)
    assert p.logprobs == 1 and p.stop == ("x",) and not p.skip_special_tokens
    assert SamplingParams(logprobs=False).logprobs == 0
    for name, value in (("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("frequency_penalty", -1.0)):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name}=.*not supported.*{name}="):
            SamplingParams(**{name: value})
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=[""])
    for kind in (True, 1.0):  # an IntEnum takes both as DELTA; neither names a kind
        with pytest.raises(ValueError, match=rf"output_kind must be one of CUMULATIVE, DELTA, FINAL_ONLY, got {kind}"):
            SamplingParams(output_kind=kind)
    assert SamplingParams(output_kind="delta").output_kind == SamplingParams(output_kind=1).output_kind
    with pytest.raises(TypeError, match="stop_token_ids must be a list of ints"):
        SamplingParams(stop_token_ids={1: 2})  # its keys would be read silently


def test_sglang_dict_is_converted_explicitly_with_sglang_defaults():
    p = from_sglang({"max_new_tokens": 5, "min_new_tokens": 2, "stop": "n3", "stop_token_ids": [7],
                     "no_stop_trim": True, "top_k": -1, "sampling_seed": 3, "stream_interval": 4})
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.top_k, p.seed) == \
        (5, 2, ("n3",), (7,), True, 0, 3)
    assert from_sglang({}).max_tokens == 128  # SGLang's default, not vLLM's 16
    assert from_dict({"temperature": 0.5}).max_tokens == 16  # plain vLLM names: vLLM's default
    assert from_dict({"max_new_tokens": 3}).max_tokens == 3  # "auto" spots SGLang's names
    with pytest.raises(ValueError, match="'max_tokens' twice"):
        from_dict({"max_new_tokens": 3, "max_tokens": 4})
    with pytest.raises(ValueError, match="regex"):
        from_sglang({"regex": "a+"})
    with pytest.raises(ValueError, match="unknown sampling_params field 'temprature'"):
        from_sglang({"temprature": 1.0})
    with pytest.raises(ValueError, match="unknown sampling_params field"):
        from_dict({"max_tokens": 3, "bogus": 1}, dialect="vllm")


def test_a_vllm_dict_with_vllm_only_fields_keeps_vllms_defaults():
    # logit_bias and stream_interval are vLLM's names too: they must not switch "auto" to SGLang's defaults
    assert from_dict({"temperature": 0, "logit_bias": None}).max_tokens == 16
    assert from_dict({"stream_interval": 4, "best_of": 2, "n": 2}).max_tokens == 16
    assert from_dict({"logit_bias": {}}, dialect="vllm").max_tokens == 16
    with pytest.raises(ValueError, match=r"logit_bias=\{1: 2.0\} is not supported"):
        from_dict({"logit_bias": {1: 2.0}})
    with pytest.raises(ValueError, match="best_of=3"):
        from_dict({"best_of": 3})
    with pytest.raises(ValueError, match=r"unknown sampling_params field\(s\) \['_eos_token_id'\]"):
        from_dict({"_eos_token_id": 2})  # vLLM's engine sets it; a user's dict may not
    assert from_dict({"max_new_tokens": 3, "logit_bias": None}).max_tokens == 3  # SGLang's own name decides
    assert from_dict({"regex": None}).max_tokens == 128
    with pytest.raises(ValueError, match="dialect must be"):
        from_dict({}, dialect="openai")


def test_to_sampling_params_takes_every_form():
    assert to_sampling_params(None) == SamplingParams()
    p = SamplingParams(max_tokens=3)
    assert to_sampling_params(p) is p
    assert to_sampling_params({"max_tokens": 3, "n": 2}).n == 2
    with pytest.raises(TypeError, match="sampling_params must be"):
        to_sampling_params(42)
    with pytest.raises(ValueError, match="max_tokens=None"):  # vLLM's "until the context is full"
        to_sampling_params({"max_tokens": None})


def test_a_real_vllm_sampling_params_converts_field_by_field():
    vllm = pytest.importorskip("vllm")  # optional: vllm is not installed in CI
    v = vllm.SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=9, min_tokens=1, seed=5,
                            stop_token_ids=[3], stop=["x"], logprobs=2, skip_special_tokens=False,
                            include_stop_str_in_output=True)
    p = from_vllm(v)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens, p.seed, p.stop_token_ids, p.stop,
            p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output) == \
        (2, 0.7, 0.9, 0, 9, 1, 5, (3,), ("x",), 2, False, True)
    assert to_sampling_params(v) == p
    with pytest.raises(ValueError, match="repetition_penalty"):
        from_vllm(vllm.SamplingParams(repetition_penalty=1.2))


def test_stop_checker_finds_the_token_that_completes_a_stop_string(tok):
    ids = tok.encode("n1 n2 n3 n4 n5")
    p = SamplingParams(stop=("n3 n4", "n5"))
    checker = StopChecker(tok, p)
    assert checker.check(ids[:3]) is None  # "n1 n2 n3": a prefix of a stop string is no match
    m = checker.check(ids)  # several tokens arrive at once: the first completing one counts
    assert (m.num_tokens, m.stop, m.text) == (4, "n3 n4", "n1 n2 ")
    m = StopChecker(tok, SamplingParams(stop=("n3 n4",), include_stop_str_in_output=True)).check(ids)
    assert (m.num_tokens, m.text) == (4, "n1 n2 n3 n4")


def test_completion_text_leaves_the_stop_token_out_unless_asked(tok):
    ids = tok.encode("n1 n2") + [0]  # 0 is <|endoftext|>, a special token
    keep = SamplingParams(skip_special_tokens=False)
    assert completion_text(tok, ids, "stop", keep) == "n1 n2"
    assert completion_text(tok, ids, "stop", SamplingParams(skip_special_tokens=False,
                                                            include_stop_str_in_output=True)) == "n1 n2 <|endoftext|>"
    assert completion_text(tok, ids, "length", keep) == "n1 n2 <|endoftext|>"
    assert completion_text(None, ids, "stop", keep) == "" and completion_text(tok, ids, "stop", SamplingParams(
        detokenize=False)) == ""


def _completion(**kw) -> CompletionOutput:
    base = dict(index=0, token_ids=[4, 5, 0], logprobs=[-0.5, -1.0, -0.25], readout_loops=[4, 4, 4],
                cumulative_logprob=-1.75, finish_reason="stop", seed=7)
    return CompletionOutput(**{**base, **kw})


def test_vllm_shaped_completion(tok):
    eos = frozenset({0})
    top = [{4: -0.5, 6: -1.5}, {7: -0.8, 5: -1.0}, {0: -0.25, 9: -3.0}]  # token 5 is outside the top 1
    out = to_vllm_completion(_completion(top_logprobs=top), SamplingParams(logprobs=1), tok, eos)
    assert out.stop_reason is None and out.finish_reason == "stop"  # eos: vLLM reports no stop_reason
    assert out.text == "n1 n2" and out.token_ids == [4, 5, 0] and out.cumulative_logprob == -1.75
    assert out.logprobs[0] == {4: Logprob(-0.5, 1, "n1")}
    assert out.logprobs[1] == {7: Logprob(-0.8, 1, "n4"), 5: Logprob(-1.0, None, "n2")}
    assert to_vllm_completion(_completion(), SamplingParams(), tok, eos).logprobs is None
    zero = to_vllm_completion(_completion(), SamplingParams(logprobs=0), tok, eos)
    assert [list(d) for d in zero.logprobs] == [[4], [5], [0]] and zero.logprobs[2][0].logprob == -0.25
    stop_tok = to_vllm_completion(_completion(token_ids=[4, 5, 9]), SamplingParams(stop_token_ids=(9,)), tok, eos)
    assert stop_tok.stop_reason == 9
    ignored = to_vllm_completion(_completion(), SamplingParams(ignore_eos=True, stop_token_ids=(0,)), tok, eos)
    assert ignored.stop_reason == 0
