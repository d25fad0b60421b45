"""ourobatch.LLM, vLLM's offline class: an RL worker's vLLM calls run unchanged on the shipped model and
score what its model card says at full depth (the default); prompts, params and outputs in vLLM's shapes;
stop strings cut as vLLM cuts them; unseeded requests reproducible from the engine seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ourobatch import EngineConfig, SyncEngine
from ourobatch.llm import LLM, SamplingParams
from ourobatch.testing import make_tiny_checkpoint

MODEL = Path(__file__).resolve().parents[1] / "models" / "pointer-chase"
NUM_TASKS = 32  # x n=2 rollouts: enough to tell 0.9985 from a broken policy (the old default: < 0.5)
Z = 3.29  # two-sided 99.9% normal quantile


@pytest.fixture(scope="module")
def tasks() -> list[dict]:
    lines = (MODEL / "heldout_tasks.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:NUM_TASKS]]


@pytest.fixture(scope="module")
def llm():
    # The constructor an RL worker passes to vllm.LLM (only the import differs).
    with LLM(model=str(MODEL), dtype="float32", gpu_memory_utilization=0.5, enforce_eager=True, max_model_len=64,
             trust_remote_code=True, seed=0) as llm:
        yield llm


def _rewards(outs, tasks) -> list[float]:
    return [float(c.token_ids == t["target_token_ids"] + [0]) for o, t in zip(outs, tasks) for c in o.outputs]


def test_rl_worker_calls_score_the_model_card_at_full_depth(llm, tasks):
    card = json.loads((MODEL / "training.json").read_text())
    assert llm.config.deep_interval == 1 and llm.config.cuda_graphs is False  # the default, enforce_eager
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=8, stop_token_ids=[0],
                            skip_special_tokens=False)
    outs = llm.generate([{"prompt_token_ids": t["prompt_token_ids"]} for t in tasks], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [t["prompt_token_ids"] for t in tasks]  # input order
    assert all(len(o.outputs) == 2 and [c.index for c in o.outputs] == [0, 1] for o in outs)
    assert all(set(c.readout_loops) == {4} for o in outs for c in o.outputs)  # full depth, every token
    rewards = _rewards(outs, tasks)
    mean, claimed = sum(rewards) / len(rewards), card["accuracy_per_loop"][3]
    # two independent binomial estimates, with a floor on the variance for p near 0 or 1
    var = sum(max(p * (1 - p), 1 / m) / m for p, m in ((mean, len(rewards)), (claimed, card["eval_n"])))
    assert abs(mean - claimed) <= Z * var ** 0.5, (mean, claimed)


def test_the_old_lossy_default_scores_far_below_it(tasks):
    """The control: deferred B=4 s=2 (the default before full depth was) reads answers from loop 2."""
    with LLM(str(MODEL), max_model_len=64, mode="deferred", deep_interval=4, shallow_loops=2) as lossy:
        outs = lossy.generate([{"prompt_token_ids": t["prompt_token_ids"]} for t in tasks],
                              SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert sum(_rewards(outs, tasks)) / len(tasks) < 0.5


def test_prompt_forms_and_per_prompt_params(llm, tasks):
    ids = [t["prompt_token_ids"] for t in tasks[:3]]
    text = llm.get_tokenizer().decode(ids[0], skip_special_tokens=False)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    ref = [o.outputs[0].token_ids for o in llm.generate(ids, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], greedy,
                                                         use_tqdm=False)] == ref
    assert llm.generate(ids[0], greedy, use_tqdm=False)[0].outputs[0].token_ids == ref[0]  # one bare prompt
    for prompt in (text, {"prompt": text}):
        out = llm.generate(prompt, greedy, use_tqdm=False)[0]
        assert out.prompt == text and out.prompt_token_ids == ids[0] and out.outputs[0].token_ids == ref[0]
    mixed = llm.generate(ids[:2], [greedy, {"max_new_tokens": 2, "temperature": 0}], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == ref[0] and mixed[1].outputs[0].token_ids == ref[1][:2]
    assert mixed[1].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        llm.generate(ids[:2], [greedy], use_tqdm=False)
    before = llm.stats()
    with pytest.raises(ValueError, match=r"prompts\[1\].*outside the vocabulary"):
        llm.generate([ids[0], [1, 10**6]], greedy, use_tqdm=False)
    after = llm.stats()  # every prompt is checked before any is queued: the good one left no trace
    assert [after[k] - before[k] for k in ("requests_added", "finished_abort")] == [0, 0]
    with pytest.raises(ValueError, match="unsupported key"):
        llm.generate({"prompt_token_ids": ids[0], "multi_modal_data": {}}, greedy, use_tqdm=False)


def test_stop_strings_cut_the_text_and_end_the_request(llm, tasks):
    ids = tasks[0]["prompt_token_ids"]
    full = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    assert len(words) == 4 and full.stop_reason is None and full.finish_reason == "stop"  # eos
    before = [llm.stats()[k] for k in ("finished_stop", "finished_abort")]
    cut = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, stop=[words[2]], n=2, seed=1),
                       use_tqdm=False)[0].outputs
    for c in cut:
        assert c.token_ids == full.token_ids[:3] and c.text == " ".join(words[:2]) + " "
        assert (c.finish_reason, c.stop_reason) == ("stop", words[2]) and len(c.token_logprobs) == 3
    # ended at the stop string (not run to eos), and counted as the stops they are, not as aborts
    assert [llm.stats()[k] for k in ("finished_stop", "finished_abort")] == [before[0] + 2, before[1]]
    kept = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, stop=words[2],
                                            include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == " ".join(words[:3])


def test_logprobs_in_vllm_shape(llm, tasks):
    ids = tasks[1]["prompt_token_ids"]
    out = llm.generate(ids, SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp, pos in zip(out.token_ids, out.token_logprobs, out.logprobs):
        assert pos[tok].logprob == lp
        best = [t for t, v in pos.items() if v.rank == 1]
        assert len(best) == 1 and pos[best[0]].logprob >= lp and pos[best[0]].decoded_token
    assert out.cumulative_logprob == pytest.approx(sum(out.token_logprobs))
    assert llm.generate(ids, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llm") / "m", eos_token_id=None)


def test_unseeded_requests_are_reproducible_from_the_engine_seed(tiny):
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = SamplingParams(temperature=1.5, max_tokens=6, n=2)

    def run(seed: int) -> list[list[int]]:
        with LLM(str(tiny), seed=seed, num_kv_blocks=64) as llm:
            return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]

    first = run(0)
    assert run(0) == first  # run to run
    assert run(1) != first  # the engine seed is what decides
    with SyncEngine(EngineConfig(model=str(tiny), seed=0, num_kv_blocks=64)) as engine:  # the same derivation
        assert [c.token_ids for o in engine.generate_batch(prompts, params) for c in o.outputs] == first


def test_vllm_only_options_are_mapped_accepted_or_refused(tiny):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*not supported"):
        LLM(str(tiny), tensor_parallel_size=2)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['flux_capacitor'\]"):
        LLM(str(tiny), flux_capacitor=True)
    with pytest.raises(ValueError, match="raw_logits"):
        LLM(str(tiny), logprobs_mode="raw_logits")
    with LLM(str(tiny), dtype="float", enforce_eager=True, swap_space=4, logprobs_mode="raw_logprobs",
             tensor_parallel_size=1, num_kv_blocks=16) as llm:
        assert llm.config.dtype == "float32" and llm.config.cuda_graphs is False and llm.get_tokenizer() is None
        assert llm.config.logprobs_mode == "raw"  # vLLM's spelling of its own default
        with pytest.raises(ValueError, match="no tokenizer is loaded"):
            llm.generate("hello", use_tqdm=False)
        with pytest.raises(ValueError, match="stop.*needs a tokenizer"):
            llm.generate([1, 2], SamplingParams(stop=["x"]), use_tqdm=False)
        with pytest.raises(TypeError, match="lora_request"):
            llm.generate([1, 2], lora_request=object())


def test_get_tokenizer_has_the_hugging_face_names_ported_code_reads(llm):
    tok = llm.get_tokenizer()
    config = json.loads((MODEL / "config.json").read_text())
    special = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert tok.eos_token_id == config["eos_token_id"] == tok.tok.token_to_id(special["eos_token"])
    assert tok.vocab_size == len(tok) == config["vocab_size"]
    ids = [[4, 18, 3], [11]]
    assert tok.batch_decode(ids) == [tok.decode(i) for i in ids]
    assert tok.pad_token_id == (tok.tok.token_to_id(special["pad_token"]) if special.get("pad_token") else None)
    assert tok.bos_token_id == (tok.tok.token_to_id(special["bos_token"]) if special.get("bos_token") else None)
