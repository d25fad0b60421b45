"""ourobatch.LLM with SamplingParams(prompt_logprobs=k) on the shipped pointer-chase model in float64,
against the float64 oracle: vLLM's RequestOutput.prompt_logprobs shape (None first, then {token id:
Logprob(logprob, rank, decoded_token)}), the token texts from the model's tokenizer, raw and processed."""

from __future__ import annotations

import json

import pytest
import torch

from ourobatch import LLM, SamplingParams
from ourobatch.compat import Logprob
from ourobatch.text import Tokenizer
from tests.oracle import load_oracle, processed_logprobs
from tests.server_helpers import MODEL

TASKS = [json.loads(line) for line in (MODEL / "heldout_tasks.jsonl").read_text().splitlines()[:3]]


@pytest.fixture(scope="module")
def oracle():
    return load_oracle(MODEL)


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_llm_generate_reports_vllm_shaped_prompt_logprobs(oracle, logprobs_mode):
    tok = Tokenizer.from_path(MODEL)
    prompts = [t["prompt_token_ids"] for t in TASKS]
    texts = [tok.decode(p, skip_special_tokens=False) for p in prompts]
    params = SamplingParams(max_tokens=4, temperature=0.6, top_k=5, seed=3, prompt_logprobs=2)
    with LLM(str(MODEL), dtype="float64", device="cpu", max_model_len=64, logprobs_mode=logprobs_mode,
             block_size=4, max_num_batched_tokens=8) as llm:  # chunked prefill too
        outs = llm.generate([{"prompt_token_ids": prompts[0]}, texts[1], prompts[2]], params, use_tqdm=False)
        as_dict = llm.generate([prompts[0]], {"prompt_logprobs": 0, "max_tokens": 1}, use_tqdm=False)[0]
        plain = llm.generate([prompts[0]], {"max_tokens": 1}, use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        logits = oracle.forward(prompt).logits[-1]  # loop T
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            row = logits[i - 1]
            ref = (torch.log_softmax(row, -1) if logprobs_mode == "raw_logprobs"
                   else processed_logprobs(row, 0.6, top_k=5))
            ranked = sorted(range(len(ref)), key=lambda t: (-float(ref[t]), t))
            entry = out.prompt_logprobs[i]
            assert list(entry) == list(dict.fromkeys([prompt[i], *ranked[:2]]))
            for t, lp in entry.items():
                assert isinstance(lp, Logprob)
                assert lp.logprob == float(ref[t]) or abs(lp.logprob - float(ref[t])) < 1e-9
                assert lp.rank == ranked.index(t) + 1
                assert lp.decoded_token == tok.token_text(t)
    first = as_dict.prompt_logprobs  # the dict's defaults: temperature 1, no filters = raw in both modes
    assert [list(d) for d in first[1:]] == [[t] for t in prompts[0][1:]]  # k = 0: only the prompt token
    raw = torch.log_softmax(oracle.forward(prompts[0]).logits[-1], -1)
    assert all(abs(first[i][t].logprob - float(raw[i - 1, t])) < 1e-9 for i, t in enumerate(prompts[0]) if i)
