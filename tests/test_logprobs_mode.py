"""EngineConfig.logprobs_mode ("processed" | "raw") and head_dtype ("auto" | "float32") against the float64
oracle (tests/oracle.py): raw is the oracle's processed_logprobs at temperature 1 with no filters, for the
sampled token and the top log-probs, in deferred and verify mode; the draws never change; an fp32 head on a
bf16 engine is closer to the oracle than a bf16 one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint
from ourobatch.training import readout_logprobs
from tests.oracle import load_oracle, processed_logprobs, readout_position

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.7, top_k=6, seed=21, logprobs=3, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=1.4, top_p=0.85, min_p=0.03, seed=22, logprobs=4, ignore_eos=True),
          SamplingParams(max_tokens=11, temperature=0.0, top_k=4, logprobs=2, ignore_eos=True)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lpm") / "m", seed=5, eos_token_id=None)


def oracle_top(ref: torch.Tensor, k: int, token: int) -> dict[int, float]:
    """The k best entries of `ref` (ties: the lower id first), then the sampled token."""
    ranked = sorted(range(ref.shape[0]), key=lambda i: (-float(ref[i]), i))[:k]
    top = {i: float(ref[i]) for i in ranked}
    top[token] = float(ref[token])
    return top


@pytest.mark.parametrize("mode,B", [("deferred", 3), ("verify", 3)])
def test_raw_and_processed_against_the_oracle(ckpt, mode, B):
    oracle = load_oracle(ckpt)
    runs = {}
    for lm in ("processed", "raw"):
        config = EngineConfig(model=str(ckpt), dtype="float64", mode=mode, deep_interval=B, logprobs_mode=lm,
                              num_kv_blocks=128)
        with SyncEngine(config) as llm:
            runs[lm] = [o.outputs[0] for o in llm.generate_batch(PROMPTS, PARAMS)]
    assert [c.token_ids for c in runs["raw"]] == [c.token_ids for c in runs["processed"]]  # same draws
    moved = 0.0
    for lm, outs in runs.items():
        for prompt, p, c in zip(PROMPTS, PARAMS, outs):
            logits = oracle.forward(prompt + c.token_ids[:-1]).logits
            assert len(c.top_logprobs) == len(c.token_ids)
            for j, (tok, lp, loop, top) in enumerate(zip(c.token_ids, c.logprobs, c.readout_loops, c.top_logprobs), 1):
                row = logits[loop - 1, readout_position(len(prompt), j)]
                processed = processed_logprobs(row, p.temperature, p.top_k, p.top_p, p.min_p)
                assert torch.isfinite(processed[tok])  # drawn from the processed distribution in both modes
                ref = processed_logprobs(row, 1.0) if lm == "raw" else processed
                assert lp == pytest.approx(float(ref[tok]), abs=1e-9), (lm, j)
                want = oracle_top(ref, p.logprobs, tok)
                assert list(top) == list(want), (lm, j)
                assert all(top[t] == want[t] or abs(top[t] - want[t]) < 1e-9 for t in want), (lm, j)  # -inf: cut
                moved = max(moved, abs(float(processed[tok]) - float(ref[tok])))
    assert moved > 0.05  # raw and processed differ here, so the test tells them apart


def test_config_rejects_unknown_values(ckpt):
    with pytest.raises(ValueError, match=r"EngineConfig.logprobs_mode must be one of \('processed', 'raw'\)"):
        EngineConfig(model=str(ckpt), logprobs_mode="raw_logprobs")
    with pytest.raises(ValueError, match=r"EngineConfig.head_dtype must be one of \('auto', 'float32'\)"):
        EngineConfig(model=str(ckpt), head_dtype="bfloat16")
    config = EngineConfig(model=str(ckpt))
    assert (config.logprobs_mode, config.head_dtype) == ("processed", "auto")


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    """A bf16 checkpoint whose layers add nothing (o_proj and down_proj are zero), so every readout is
    norm(embedding), and whose lm_head is 0.5 x the embedding, so logits are large and coherent, as a
    trained model's are. The only bf16 errors left are the readout's rounding and the head's; an fp32
    head removes the second. (On random tiny checkpoints the loops amplify bf16 noise far above the
    head's rounding, which then cannot be seen.)"""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "m", seed=4, dtype=torch.bfloat16,
                                eos_token_id=None, hidden_size=64, intermediate_size=64, vocab_size=50)
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["lm_head.weight"] = (0.5 * tensors["model.embed_tokens.weight"].float()).bfloat16()
    save_file(tensors, path / "model.safetensors")
    return path


def test_float32_head_is_closer_to_the_oracle_on_a_bf16_engine(bf16_ckpt):
    oracle = load_oracle(bf16_ckpt)  # float64 from the very bf16 weights the engine runs
    prompts = [[i] for i in range(0, 50, 3)]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logprobs=5, ignore_eos=True)
    model = load_model(bf16_ckpt, torch.bfloat16, "cpu")
    errors = {}
    for head in ("auto", "float32"):
        config = EngineConfig(model=str(bf16_ckpt), dtype="bfloat16", head_dtype=head, logprobs_mode="raw")
        with SyncEngine(config) as llm:
            outs = [o.outputs[0] for o in llm.generate_batch(prompts, params)]
        errs = []
        for prompt, c in zip(prompts, outs):
            logits = oracle.forward(prompt + c.token_ids[:-1]).logits
            for j, (loop, top) in enumerate(zip(c.readout_loops, c.top_logprobs), 1):
                ref = torch.log_softmax(logits[loop - 1, readout_position(len(prompt), j)], -1)
                errs += [abs(lp - float(ref[t])) for t, lp in top.items()]
        errors[head] = torch.tensor(errs).mean().item()
        # the learner's replay with the same head dtype reports the same numbers (the readouts are equal)
        replay = readout_logprobs(model, [p + c.token_ids for p, c in zip(prompts, outs)],
                                  [c.readout_loops for c in outs], prompt_len=1,
                                  head_dtype=torch.float32 if head == "float32" else None)
        assert replay.dtype == torch.float32
        assert torch.allclose(replay, torch.tensor([c.logprobs for c in outs]), atol=1e-5), head
    assert errors["float32"] < 0.6 * errors["auto"], errors
