"""ourobatch.training.readout_logprobs (the learner's replay) against the engine's own log-probs in every
mode, through ourobatch's model and through an independent trainer-style implementation of the same
checkpoint; its gradient against finite differences; Engine.score / SyncEngine.score."""

from __future__ import annotations

import dataclasses
import json

import anyio
import numpy
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ourobatch import Engine, EngineBusyError, EngineConfig, SamplingParams, SyncEngine
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint
from ourobatch.training import NormHookModel, readout_logprobs
from tests.helpers import GatedExecutor, until
from tests.oracle import apply_rope, rms_norm, rope_cos_sin, silu

T = 4
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
PARAMS = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=13, temperature=0.7, top_k=6, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=11, temperature=1.3, top_p=0.8, min_p=0.02, seed=6, ignore_eos=True)]
# deferred with every B and s, eager, verify: the readout schedules a rollout can have
CASES = [("deferred", 1, 2)] + [("deferred", B, s) for B in (2, 4) for s in (1, 2, 3)] + [
    ("eager", 3, 2), ("verify", 2, 2), ("verify", 4, 1)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train") / "m", seed=3, eos_token_id=None)


@pytest.fixture(scope="module")
def model64(ckpt):
    return load_model(ckpt, torch.float64, "cpu")


def rollouts(ckpt, mode, B, s, logprobs_mode, dtype="float64", **kw):
    config = EngineConfig(model=str(ckpt), dtype=dtype, mode=mode, deep_interval=B, shallow_loops=s,
                          logprobs_mode=logprobs_mode, block_size=4, **{"num_kv_blocks": 256, **kw})
    with SyncEngine(config) as llm:
        outs = [o.outputs[0] for o in llm.generate_batch(PROMPTS, PARAMS)]
        return outs, llm.stats()


def replay(model, outs, logprobs_mode, **kw) -> torch.Tensor:
    """readout_logprobs over the whole batch at once (ragged rows, one SamplingParams per row)."""
    return readout_logprobs(model, [p + c.token_ids for p, c in zip(PROMPTS, outs)], [c.readout_loops for c in outs],
                            prompt_len=[len(p) for p in PROMPTS], params=PARAMS, logprobs_mode=logprobs_mode, **kw)


def differences(got: torch.Tensor, outs) -> torch.Tensor:
    diffs = []
    for row, c in zip(got, outs):
        n = len(c.logprobs)
        assert (row[n:] == 0).all()
        diffs.append((row[:n].double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs())
    return torch.cat(diffs)


@pytest.mark.parametrize("mode,B,s", CASES)
def test_readout_logprobs_equal_the_engines(ckpt, model64, mode, B, s):
    """float64: the dense replay is the engine's computation (raw and processed, each token's own loop)."""
    runs = {lm: rollouts(ckpt, mode, B, s, lm)[0] for lm in ("raw", "processed")}
    for lm, outs in runs.items():
        assert differences(replay(model64, outs, lm), outs).max() < 1e-9, lm
    raw, processed = runs["raw"], runs["processed"]
    assert [c.token_ids for c in raw] == [c.token_ids for c in processed]  # the draws never change
    # the modes report different numbers where temperature or filters act (rows 1 and 2), the same for greedy
    assert raw[0].logprobs == pytest.approx(processed[0].logprobs, abs=1e-12)
    assert max(abs(a - b) for a, b in zip(raw[1].logprobs, processed[1].logprobs)) > 1e-2
    if mode != "verify" and B > 1:  # the mixed schedule is exercised
        assert any(r == s for c in raw for r in c.readout_loops)


def test_readout_logprobs_after_preemption(ckpt, model64):
    """A preempted request is re-prefilled and reads loop T at the readmission: its readout_loops say so."""
    outs, stats = rollouts(ckpt, "deferred", 4, 2, "raw", num_kv_blocks=9, max_num_seqs=3)
    assert stats["preemptions"] > 0
    assert differences(replay(model64, outs, "raw"), outs).max() < 1e-9


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("eager", 3), ("verify", 4)])
def test_readout_logprobs_match_a_float32_engine(ckpt, mode, B):
    """float32: the engine's paged, batched computation and the dense replay round differently; both stay
    within float32 noise of each other (about 1e-5 at worst on these sharp random weights, 1e-6 typical)."""
    model = load_model(ckpt, torch.float32, "cpu")
    for lm in ("raw", "processed"):
        outs, _ = rollouts(ckpt, mode, B, 2, lm, dtype="float32")
        d = differences(replay(model, outs, lm), outs)
        assert d.max() < 1e-4 and d.mean() < 1e-5, (lm, d.max().item(), d.mean().item())


# ---------------------------------------------------------------- a trainer's own implementation


class _RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class TrainerOuro(nn.Module):
    """The checkpoint as a trainer might write it (Hugging Face layout: .model.norm applied after every
    loop, .lm_head), sharing no code with ourobatch: weights by their HF names, plain differentiable ops."""

    def __init__(self, path) -> None:
        super().__init__()
        cfg = json.loads((path / "config.json").read_text())
        state = {k: v.double() for k, v in load_file(path / "model.safetensors").items()}
        self.cfg, self.eps = cfg, cfg["rms_norm_eps"]
        self.w = nn.ParameterDict({k.replace(".", "/"): nn.Parameter(v) for k, v in state.items()
                                   if k not in ("model.norm.weight", "lm_head.weight")})
        self.model = nn.Module()
        self.model.norm = _RMSNorm(state["model.norm.weight"], self.eps)
        self.model.forward = self.base
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False, dtype=torch.float64)
        self.lm_head.weight = nn.Parameter(state["lm_head.weight"])

    def base(self, input_ids):
        c, w = self.cfg, lambda name: self.w[name.replace(".", "/")]
        heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        b, S = input_ids.shape
        cos, sin = rope_cos_sin(S, d, c["rope_theta"])
        h = F.embedding(input_ids, w("model.embed_tokens.weight"))
        for _ in range(c["total_ut_steps"]):
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}."
                x = rms_norm(h, w(p + "input_layernorm.weight"), self.eps)
                q, k, v = ((x @ w(p + f"self_attn.{n}_proj.weight").T).reshape(b, S, -1, d) for n in "qkv")
                q, k = (torch.stack([apply_rope(t[j], cos, sin) for j in range(b)]) for t in (q, k))
                k, v = (t.repeat_interleave(heads // kv, dim=2) for t in (k, v))
                a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True).transpose(1, 2).reshape(b, S, -1)
                h = h + rms_norm(a @ w(p + "self_attn.o_proj.weight").T, w(p + "input_layernorm_2.weight"), self.eps)
                x = rms_norm(h, w(p + "post_attention_layernorm.weight"), self.eps)
                m = (silu(x @ w(p + "mlp.gate_proj.weight").T) * (x @ w(p + "mlp.up_proj.weight").T))
                h = h + rms_norm(m @ w(p + "mlp.down_proj.weight").T, w(p + "post_attention_layernorm_2.weight"),
                                 self.eps)
            h = self.model.norm(h)
        return h


@pytest.mark.parametrize("mode,B,s", [("deferred", 4, 2), ("verify", 2, 1)])
def test_a_trainers_own_model_through_the_norm_hook(ckpt, mode, B, s):
    trainer = TrainerOuro(ckpt)
    for lm in ("raw", "processed"):
        outs, _ = rollouts(ckpt, mode, B, s, lm)
        got = replay(NormHookModel(trainer), outs, lm)
        assert got.requires_grad  # the trainer's parameters require grad: the replay is differentiable
        assert differences(got, outs).max() < 1e-9, lm


# ---------------------------------------------------------------- gradient


@pytest.mark.parametrize("logprobs_mode", ["raw", "processed"])
def test_gradient_matches_finite_differences(ckpt, logprobs_mode):
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=5, seed=9, ignore_eos=True)
    prompts = [[3, 1, 4, 1], [2, 7, 1, 8, 2]]
    with SyncEngine(EngineConfig(model=str(ckpt), dtype="float64", deep_interval=2, shallow_loops=1)) as llm:
        outs = [o.outputs[0] for o in llm.generate_batch(prompts, params)]  # tokens inside the top-k support
    ids = [p + c.token_ids for p, c in zip(prompts, outs)]
    loops = [c.readout_loops for c in outs]  # a mixed schedule
    assert loops[0] == [4, 1, 4, 1, 4]
    model = load_model(ckpt, torch.float64, "cpu").requires_grad_(True)
    weights = torch.tensor([[0.5, -1.0, 2.0, 0.3, -0.7], [1.1, 0.4, -0.2, 0.9, 0.6]], dtype=torch.float64)

    def objective() -> torch.Tensor:
        lp = readout_logprobs(model, ids, loops, prompt_len=[4, 5], params=params, logprobs_mode=logprobs_mode)
        return (lp * weights).sum()

    objective().backward()
    named = dict(model.named_parameters())
    probes = [("lm_head.weight", (3, 5)), ("model.layers.0.self_attn.q_proj.weight", (1, 2)),
              ("model.layers.1.self_attn.v_proj.weight", (0, 3)), ("model.layers.1.mlp.down_proj.weight", (2, 7)),
              ("model.norm.weight", (4,)), ("model.embed_tokens.weight", (3, 1)),
              ("model.layers.0.input_layernorm_2.weight", (6,))]
    eps = 1e-6
    for name, idx in probes:
        p = named[name]
        with torch.no_grad():
            p[idx] += eps
            up = objective().item()
            p[idx] -= 2 * eps
            down = objective().item()
            p[idx] += eps
        fd = (up - down) / (2 * eps)
        assert p.grad[idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-7), name
        assert abs(fd) > 1e-6, f"{name}: the probe must move the objective"


def test_readout_logprobs_rejects_bad_input(model64):
    ids = [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="logprobs_mode"):
        readout_logprobs(model64, ids, [4, 4], prompt_len=3, logprobs_mode="sampled")
    with pytest.raises(ValueError, match=r"readout_loops must be ints in 1\.\.4"):
        readout_logprobs(model64, ids, [4, 5], prompt_len=3)
    with pytest.raises(ValueError, match="exceed"):
        readout_logprobs(model64, ids, [4, 4, 4], prompt_len=3)
    with pytest.raises(ValueError, match="prompt_len"):
        readout_logprobs(model64, ids, [4], prompt_len=0)
    with pytest.raises(TypeError, match="LoopedModel"):
        readout_logprobs(object(), ids, [4], prompt_len=3)
    one = readout_logprobs(model64, ids, [4, 2], prompt_len=3)
    batched = readout_logprobs(model64, torch.tensor([ids]), [[4, 2]], prompt_len=3)
    assert one.shape == (2,) and batched.shape == (1, 2) and torch.equal(one, batched[0])
    # a ragged row is checked against its own length, not the padded width: padding is never scored
    with pytest.raises(ValueError, match="row 1: prompt_len 2 \\+ 3 readout loops exceed its 3 input tokens"):
        readout_logprobs(model64, [ids, [1, 2, 3]], [[4, 4], [4, 4, 4]], prompt_len=[3, 2])
    for bad in (31, -1):  # the tiny model's vocabulary is 31
        with pytest.raises(ValueError, match=rf"input_ids\[0\]\[3\] = {bad} is outside the vocabulary \[0, 31\)"):
            readout_logprobs(model64, [1, 2, 3, bad, 5], [4, 4], prompt_len=3)
    padded = torch.tensor([ids, [1, 2, 3, -100, -100]])  # -100 (a trainer's padding) past what is read
    both = readout_logprobs(model64, padded, [[4, 2], [4]], prompt_len=[3, 2])
    alone = readout_logprobs(model64, [1, 2, 3], [4], prompt_len=2)[0]
    assert torch.equal(both[0], one) and abs(float(both[1, 0] - alone)) < 1e-12  # float64, other batch shape
    assert torch.equal(readout_logprobs(model64, [numpy.int64(t) for t in ids], [4, 2], prompt_len=3), one)


# ---------------------------------------------------------------- Engine.score


def test_sync_score_equals_generation(ckpt):
    for mode, B in [("deferred", 1), ("deferred", 4)]:
        with SyncEngine(EngineConfig(model=str(ckpt), dtype="float64", deep_interval=B, mode=mode,
                                     logprobs_mode="processed")) as llm:
            c = llm.generate(PROMPTS[1], PARAMS[1]).outputs[0]
            assert llm.score(PROMPTS[1], c.token_ids, c.readout_loops, PARAMS[1]) == pytest.approx(c.logprobs, abs=1e-9)
            if B == 1:  # the default readout is full depth
                assert llm.score(PROMPTS[1], c.token_ids, params=PARAMS[1]) == pytest.approx(c.logprobs, abs=1e-9)
            with pytest.raises(ValueError, match="readout_loops has 1 entries"):
                llm.score(PROMPTS[1], c.token_ids, [4])
            with pytest.raises(ValueError, match="prompt"):
                llm.score([], c.token_ids)
            with pytest.raises(ValueError, match="token ids"):
                llm.score([1, 10_000], [2])
            assert llm.score([1], []) == []


def test_score_refuses_an_asleep_engine(ckpt):
    with SyncEngine(EngineConfig(model=str(ckpt), dtype="float64")) as llm:
        before = llm.score([1, 2, 3], [4, 5])
        llm.sleep(1)
        with pytest.raises(EngineBusyError, match="asleep"):
            llm.score([1, 2, 3], [4, 5])
        llm.wake_up()
        assert llm.score([1, 2, 3], [4, 5]) == before


@pytest.mark.asyncio
async def test_async_score_waits_for_the_step_in_flight(ckpt):
    config = EngineConfig(model=str(ckpt), dtype="float64", deep_interval=4, logprobs_mode="raw")
    async with Engine(config) as engine:
        done = await engine.generate(PROMPTS[0], PARAMS[2])
        c = done.outputs[0]
        gate = GatedExecutor(engine.core.executor)
        engine.core.executor = gate
        gate.hold(after=0)
        events: list[str] = []
        model = gate.inner.model
        dense = model.dense_loops
        model.dense_loops = lambda ids: (events.append("score"), dense(ids))[1]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.generate, PROMPTS[1], PARAMS[1])
                await gate.wait_entered()  # a step is in flight on the worker thread
                result: list[list[float]] = []

                async def score():
                    result.append(await engine.score(PROMPTS[0], c.token_ids, c.readout_loops))

                tg.start_soon(score)
                for _ in range(50):
                    await anyio.lowlevel.checkpoint()
                assert events == []  # the score waits behind the step
                gate.open()
                await until(lambda: bool(result))
        finally:
            model.dense_loops = dense
        assert result[0] == pytest.approx(c.logprobs, abs=1e-9)



# ---------------------------------------------------------------- min_tokens: the engine's eos masking

EOS = 0
MIN_PROMPT = [17, 20, 25]
MIN_PARAMS = [SamplingParams(max_tokens=9, min_tokens=5, temperature=1.0, seed=s, **kw)
              for s, kw in ((1, {}), (2, dict(stop_token_ids=(3, 7))), (3, dict(top_k=8, stop_token_ids=(5,))),
                            (4, dict(ignore_eos=True, stop_token_ids=(5,))))]


@pytest.fixture(scope="module")
def eos_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train_eos") / "m", seed=3, eos_token_id=EOS)


@pytest.fixture(scope="module")
def min_tokens_rollouts(eos_ckpt):
    """(mode, B) -> the engine's completions of MIN_PROMPT under each of MIN_PARAMS (processed log-probs)."""
    runs = {}
    for mode, B in [("deferred", 1), ("deferred", 3), ("verify", 3)]:
        config = EngineConfig(model=str(eos_ckpt), dtype="float64", mode=mode, deep_interval=B, block_size=4,
                              logprobs_mode="processed")
        with SyncEngine(config) as llm:
            outs = [llm.generate(MIN_PROMPT, p).outputs[0] for p in MIN_PARAMS]
            runs[mode, B] = outs, [llm.score(MIN_PROMPT, c.token_ids, c.readout_loops, p)
                                   for c, p in zip(outs, MIN_PARAMS)]
    return runs


def test_score_masks_the_eos_while_min_tokens_as_the_engine_does(eos_ckpt, min_tokens_rollouts):
    """score() with the rollout's own params reproduces its processed log-probs: the checkpoint's eos (unless
    ignore_eos) and stop_token_ids are masked while fewer than min_tokens tokens exist, as in the sampler."""
    model = load_model(eos_ckpt, torch.float64, "cpu")
    for (mode, B), (outs, scores) in min_tokens_rollouts.items():
        for c, p, got in zip(outs, MIN_PARAMS, scores):
            masked = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
            assert len(c.token_ids) > p.min_tokens and not masked & set(c.token_ids[:p.min_tokens])
            assert got == pytest.approx(c.logprobs, abs=1e-9), (mode, B, p)
        # the control: unmasked, the first min_tokens log-probs differ (the eos has mass there)
        plain = dataclasses.replace(MIN_PARAMS[0], min_tokens=0)
        c = outs[0]
        unmasked = readout_logprobs(model, MIN_PROMPT + c.token_ids, c.readout_loops, prompt_len=3, params=plain,
                                    logprobs_mode="processed")
        assert max(abs(a - b) for a, b in zip(unmasked.tolist()[:5], c.logprobs[:5])) > 1e-3


def test_readout_logprobs_masks_the_checkpoints_eos_while_min_tokens(eos_ckpt, min_tokens_rollouts):
    """The learner's replay: ourobatch's model knows its eos; another implementation is told it (and is
    refused rather than silently unmasked when a row needs it)."""
    outs, _ = min_tokens_rollouts["deferred", 3]
    ids = [MIN_PROMPT + c.token_ids for c in outs]
    loops = [c.readout_loops for c in outs]
    kw = dict(prompt_len=3, params=MIN_PARAMS, logprobs_mode="processed")
    model = load_model(eos_ckpt, torch.float64, "cpu")
    assert differences(readout_logprobs(model, ids, loops, **kw), outs).max() < 1e-9
    trainer = NormHookModel(TrainerOuro(eos_ckpt))
    assert differences(readout_logprobs(trainer, ids, loops, eos_token_ids=[EOS], **kw), outs).max() < 1e-9
    with pytest.raises(ValueError, match="eos_token_ids"):
        readout_logprobs(trainer, ids, loops, **kw)
    # rows that need no eos (raw mode; ignore_eos) need no eos_token_ids
    readout_logprobs(trainer, ids, loops, prompt_len=3, params=MIN_PARAMS, logprobs_mode="raw")
    readout_logprobs(trainer, ids[3], loops[3], prompt_len=3, params=MIN_PARAMS[3], logprobs_mode="processed")
