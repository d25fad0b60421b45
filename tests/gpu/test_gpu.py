"""GPU suite (`pytest -m gpu`, skipped without CUDA; run on the H200 by benchmarks/gpu_suite.sh)."""

from __future__ import annotations

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from engine.attention import SeqSpan, paged_attention
from engine.kv_cache import KVPool
from ourobatch.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 16, 128), (8, 2, 64), (4, 1, 32), (32, 8, 128)])
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
def test_triton_kernel_matches_reference(dtype, heads, kv_heads, head_dim, rows):
    from engine.triton_attention import triton_paged_attention

    g = torch.Generator(device="cuda").manual_seed(heads * 1000 + rows * 10 + head_dim)
    block_size, num_blocks, seqs = 16, 300, 7
    pool = KVPool(2, 1, num_blocks, block_size, kv_heads, head_dim, dtype, "cuda")
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    perm = torch.randperm(num_blocks, generator=g, device="cuda").tolist()
    ctx = torch.randint(rows, 700, (seqs,), generator=g, device="cuda").tolist()
    ctx[0] = rows  # a request whose new rows are its whole context
    width, spans, tables, used = 64, [], [], 0
    for i, c in enumerate(ctx):
        nb = -(-c // block_size)
        ids = tuple(perm[used:used + nb])
        used += nb
        spans.append(SeqSpan(i * rows, rows, c, ids))
        tables.append(list(ids) + [0] * (width - nb))
    q = torch.randn(seqs * rows, heads, head_dim, generator=g, device="cuda", dtype=dtype)
    scale = head_dim**-0.5
    ref = paged_attention(q.double(), _as_double(pool), 1, 0, spans, scale)
    out = torch.full_like(q, float("nan"))
    out = triton_paged_attention(q, pool.k[0, 0], pool.v[0, 0], torch.tensor(tables, dtype=torch.int32, device="cuda"),
                                 torch.tensor(ctx, dtype=torch.int32, device="cuda"),
                                 torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * rows, rows, scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def _as_double(pool: KVPool) -> KVPool:
    d = KVPool.__new__(KVPool)
    d.k, d.v, d.block_size, d.num_blocks, d.scratch_block = pool.k.double(), pool.v.double(), pool.block_size, \
        pool.num_blocks, pool.scratch_block
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # head_dim 32 so the Triton kernel serves it; loops differ strongly (see make_tiny_checkpoint)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "m", seed=3, eos_token_id=None,
                                hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                intermediate_size=128, vocab_size=97)


PROMPTS = [[1, 2, 3, 4], [5, 6], [7], [8, 9, 10, 11, 12, 13], [14, 15, 16]]


@pytest.mark.parametrize("mode,B", [("deferred", 4), ("deferred", 1), ("eager", 3)])
def test_graph_path_equals_eager_path(ckpt, mode, B):
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    outs = {}
    for graphs in (True, False):
        cfg = EngineConfig(model=str(ckpt), device="cuda", dtype="float32", mode=mode, deep_interval=B,
                           num_kv_blocks=128, max_num_seqs=8, cuda_graphs=graphs)
        with SyncEngine(cfg) as llm:
            outs[graphs] = llm.generate_batch(PROMPTS, params)
            assert llm.stats()["cuda_graphs"] is graphs and llm.stats()["attention_backend"] == "triton"
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-4)


def test_bf16_gpu_agrees_with_float32_cpu(ckpt):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(5)]
    with SyncEngine(EngineConfig(model=str(ckpt), dtype="float32", deep_interval=4, num_kv_blocks=128)) as cpu:
        ref_g = cpu.generate_batch(PROMPTS, greedy)
        ref_s = cpu.generate_batch(PROMPTS, sampled)
        # the CPU engine's own logits decide which greedy prefixes have a clear margin
    with SyncEngine(EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", deep_interval=4,
                                 num_kv_blocks=128, max_num_seqs=8)) as gpu:
        out_g = gpu.generate_batch(PROMPTS, greedy)
        out_s = gpu.generate_batch(PROMPTS, sampled)
    agree = [a.outputs[0].token_ids[:3] == b.outputs[0].token_ids[:3] for a, b in zip(out_g, ref_g)]
    assert sum(agree) >= 4  # the first tokens of most prompts (bf16 may flip a near-tie)
    # Where the sampled tokens agree, log-probs agree to bf16 precision. The tiny model is deliberately
    # chaotic (every loop moves the stream by O(1)), so bf16 rounding compounds over 4 loops x 2 layers:
    # the bound is on the first token (one prefill) and on the mean over the agreeing prefix.
    diffs, first = [], []
    for a, b in zip(out_s, ref_s):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        if n == 0:
            continue  # a draw that flipped on a near-tie of the race
        d = [abs(la - lb) for la, lb in zip(a.outputs[0].logprobs[:n], b.outputs[0].logprobs[:n])]
        first.append(d[0])
        diffs += d
    assert len(first) >= 3, "most first draws agree"
    assert max(first) < 0.15, first
    assert sum(diffs) / len(diffs) < 0.15, diffs


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_fused_kernels_match_their_references(dtype, tol):
    from engine import triton_fused as fused
    from engine.model import RMSNorm, RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(1)
    rows, H, eps = 37, 2048, 1e-6
    h, y = (torch.randn(rows, H, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    wa, wb = (1 + 0.2 * torch.randn(H, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    na, nb = RMSNorm(H, eps).cuda().to(dtype), RMSNorm(H, eps).cuda().to(dtype)
    na.weight.data.copy_(wa)
    nb.weight.data.copy_(wb)
    h_ref = h + na(y)
    h_out, x_out = fused.add_rms_norm2(h, y, wa, wb, eps)
    assert rel_err(h_out, h_ref) < tol and rel_err(x_out, nb(h_ref)) < tol
    assert rel_err(fused.rms_norm(h, wb, eps), nb(h)) < tol
    gu = torch.randn(rows, 2 * 5632, generator=g, device="cuda", dtype=dtype)
    ref = torch.nn.functional.silu(gu[:, :5632].float()) * gu[:, 5632:].float()
    assert rel_err(fused.silu_mul(gu), ref) < tol
    # RoPE + KV store: q rotated, k rotated into its slot, v copied into its slot
    Hq, Hkv, d = 8, 2, 128
    qkv = torch.randn(rows, (Hq + 2 * Hkv) * d, generator=g, device="cuda", dtype=dtype)
    pos = torch.randint(0, 60000, (rows,), generator=g, device="cuda")
    slots = torch.randperm(200, generator=g, device="cuda")[:rows]
    k_plane = torch.full((200, Hkv, d), float("nan"), device="cuda", dtype=dtype)
    v_plane = torch.full_like(k_plane, float("nan"))
    inv_freq = 1e6 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    q = fused.rope_store_kv(qkv, pos, slots, inv_freq, k_plane, v_plane, Hq, Hkv, d)
    rope = RotaryEmbedding(d, 1e6)
    q_ref = rope(qkv[:, :Hq * d].double().view(rows, Hq, d), pos)
    k_ref = rope(qkv[:, Hq * d:(Hq + Hkv) * d].double().view(rows, Hkv, d), pos)
    # float32 angles (pos * inv_freq, as the reference implementation computes them) at positions up to
    # 60000 carry ~1e-4 relative error, in both kernels and in Hugging Face's float32 RoPE
    rope_tol = max(tol, 1e-3)
    assert rel_err(q, q_ref) < rope_tol and rel_err(k_plane[slots], k_ref) < rope_tol
    assert torch.equal(v_plane[slots], qkv[:, (Hq + Hkv) * d:].view(rows, Hkv, d))


def test_fused_triton_engine_equals_reference_engine(ckpt):
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True) for i in range(5)]
    outs = {}
    for backend in ("triton", "torch"):
        cfg = EngineConfig(model=str(ckpt), device="cuda", dtype="float32", deep_interval=4, num_kv_blocks=128,
                           max_num_seqs=8, attention_backend=backend)
        with SyncEngine(cfg) as llm:
            outs[backend] = llm.generate_batch(PROMPTS, params)
    for a, b in zip(outs["triton"], outs["torch"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-3)


@pytest.mark.parametrize("vocab", [97, 49152])
def test_triton_sampler_equals_the_torch_sampler(vocab):
    from engine.sampler import processed_logprobs, race
    from engine.triton_sampler import sample_plain

    g = torch.Generator(device="cuda").manual_seed(vocab)
    rows = 300
    logits = torch.randn(rows, vocab, generator=g, device="cuda") * 3
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.6][i % 4], seed=7919 * i + 2**40 * (i % 3))
              for i in range(rows)]
    counters = [1 + i % 11 for i in range(rows)]
    temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device="cuda")
    seeds = torch.tensor([p.seed for p in params], device="cuda")
    cnt = torch.tensor(counters, device="cuda")
    greedy = torch.tensor([p.is_greedy for p in params], device="cuda")
    logits[5, 3] = float("nan")
    logits[9, -1] = float("-inf")
    tokens, lps, finite = sample_plain(logits, temps, seeds, cnt, greedy)
    assert torch.equal(finite, torch.isfinite(logits).all(-1)) and finite.sum() == rows - 2
    logits[5, 3] = logits[9, -1] = 0.0
    tokens, lps, _ = sample_plain(logits, temps, seeds, cnt, greedy)
    ref_lp = processed_logprobs(logits, params)
    ref_tok = race(ref_lp, greedy, seeds, cnt)  # the torch race (triton_kernel off): counter uniforms, float64 keys
    assert (tokens == ref_tok).float().mean() > 0.99  # float32 vs float64 rounding may flip a near-tie
    same = tokens == ref_tok
    torch.testing.assert_close(lps[same], ref_lp.gather(1, ref_tok[:, None]).squeeze(1)[same], atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows", [8, 64, 300])
def test_processed_rows_draw_on_the_gpu_as_on_the_cpu(rows):
    """Rows with top-k / top-p / min-p / top log-probs (the torch path, whose race runs in the fast path's
    kernels on CUDA: sampler.race) against the same logits sampled on the CPU (the torch race)."""
    from engine.sampler import sample

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, 49152, generator=g, device="cuda") * 3
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 50, 0, 200][i % 4],
                             top_p=[1.0, 0.95, 0.8][i % 3], min_p=[0.0, 0.02][i % 2], logprobs=i % 3,
                             seed=7919 * i + 2**40 * (i % 3)) for i in range(rows)]
    js = [1 + i % 11 for i in range(rows)]
    gpu, cpu = sample(logits, params, js), sample(logits.cpu(), params, js)
    same = [a == b for a, b in zip(gpu.token_ids, cpu.token_ids)]
    assert sum(same) >= 0.99 * rows  # float32 log-probs computed on two devices may flip a near-tie
    for i in (i for i, ok in enumerate(same) if ok):
        assert abs(gpu.logprobs[i] - cpu.logprobs[i]) < 1e-4


def test_kv_pool_is_sized_from_free_memory(ckpt):
    with SyncEngine(EngineConfig(model=str(ckpt), device="cuda", gpu_memory_utilization=0.2,
                                 max_num_seqs=4, max_model_len=1 << 20)) as llm:
        stats = llm.stats()
    total = torch.cuda.get_device_properties(0).total_memory
    assert stats["kv_pool_bytes"] < 0.2 * total
    assert stats["kv_capacity_tokens"] > 0 and stats["peak_memory_bytes"] > stats["kv_pool_bytes"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [24, 5000])  # 5000: ties across the Triton sampler's 2048-wide blocks
def test_tied_logits_draw_the_same_alone_and_in_a_batch_of_64(dtype, vocab):
    """The tie rule (the lower token id first) on CUDA: the torch path (top-p/top-k/min-p/top log-probs)
    and the Triton path (temperature only) give each row the same result alone and in a batch of 64,
    greedy picks the lowest tied id, and top-p keeps the tokens the oracle keeps."""
    from engine.sampler import processed_logprobs, sample
    from tests.engine.test_sampler import ranked_by_id_on_ties, tie_heavy_rows
    from tests.oracle import processed_logprobs as oracle_logprobs

    cpu_logits, params = tie_heavy_rows(64, seed=21, V=vocab)
    logits = cpu_logits.to("cuda", dtype)
    plain = [SamplingParams(temperature=p.temperature, seed=p.seed) for p in params]  # the Triton sampler
    counters = [1 + i % 9 for i in range(64)]
    for ps in (params, plain):
        together = sample(logits, ps, counters)
        for i in range(64):
            alone = sample(logits[i:i + 1], [ps[i]], [counters[i]])
            assert alone.token_ids[0] == together.token_ids[i], i
            assert alone.logprobs[0] == together.logprobs[i], i
            assert alone.top_logprobs[0] == together.top_logprobs[i], i
            if ps[i].is_greedy:
                assert together.token_ids[i] == ranked_by_id_on_ties(logits[i].double().cpu(), 1)[0], i
    got = processed_logprobs(logits, params).cpu()
    for i, p in enumerate(params):
        ref = oracle_logprobs(logits[i].double().cpu(), p.temperature, p.top_k, p.top_p, p.min_p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref)), i


@pytest.mark.parametrize("mode,B", [("deferred", 1), ("deferred", 4), ("verify", 4)])
def test_nan_logits_on_cuda_end_requests_with_error(ckpt, mode, B):
    """bf16 on CUDA (Triton sampler, CUDA graphs): a NaN weight set after loading fails the requests with
    an error naming non-finite logits, no NaN log-prob is emitted, and the engine keeps serving."""
    import math

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)
    with SyncEngine(EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", mode=mode,
                                 deep_interval=B)) as llm:
        weight = llm.core.executor.model.lm_head.weight
        kept = weight[5, 0].item()
        weight[5, 0] = float("nan")
        outs = llm.generate_batch(PROMPTS, params)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "error" and "non-finite logits" in c.error
            assert all(math.isfinite(lp) for lp in c.logprobs)
        weight[5, 0] = kept
        again = llm.generate_batch(PROMPTS, params)
        assert all(o.outputs[0].finish_reason == "length" for o in again)
        assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("vocab", [97, 50000])
def test_nan_logits_draw_ids_inside_the_vocabulary_on_cuda(vocab):
    """Rows with NaN logits, plain (the Triton sampler) and processed (top-k, top log-probs: the drawn ids'
    log-probs are gathered on the device): every id stays inside the vocabulary, so a NaN row reaches the
    engine's non-finite check instead of a device-side assert that ends the process (session 21); a row of NaN
    draws id 0 and every row with a NaN reports a NaN log-prob."""
    import math

    from engine.sampler import sample

    g = torch.Generator(device="cuda").manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g, device="cuda") * 3
    nan = torch.rand(rows, vocab, generator=g, device="cuda") < 0.5
    nan[::4] = True  # rows of NaN only
    nan[-1] = False
    logits[nan] = float("nan")
    for processed in (False, True):
        params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=20 if processed else 0,
                                 logprobs=i % 3 if processed else 0, seed=i) for i in range(rows)]
        out = sample(logits, params, [1 + i % 5 for i in range(rows)])
        assert all(0 <= t < vocab for t in out.token_ids), out.token_ids
        assert all(out.token_ids[i] == 0 for i in range(0, rows, 4))
        assert [math.isnan(lp) for lp in out.logprobs] == [True] * (rows - 1) + [False]
