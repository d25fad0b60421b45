"""Fused sampling for rows with temperature only (no top-k / top-p / min-p, no top log-probs):
the common RL rollout case. Same function as sampler.sample: the same counter-based uniforms (the hash
is the same integer arithmetic, with the 16-bit split that never overflows), the same exponential race,
the same processed log-prob, the same tie rule (the lowest token id wins). Reads the logits once instead
of the dozens of [rows, vocab] passes of the torch path, in two kernels: one program per (row, chunk of
BLOCK tokens) finds the chunk's exp-mass and its race winner, then one per row combines the chunks. (One
program per row, looping over the vocabulary twice, took 131 us per decode step at 8 rows on the H200,
2% of a full-depth step: 8 programs, each waiting on 48 loads in a row; docs/benchmarks.md, session 10.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    # sampler._mix32 on uint32 lanes: Triton's uint32 multiply wraps mod 2**32, which is what sampler._mulmod32's
    # 16-bit split computes in int64 (torch has no wrapping uint32 multiply); the same bits, at a fraction of
    # the int64 path's instructions
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _u32(x):
    # the low 32 bits of an int64 as uint32
    return (x & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _chunk_kernel(logits_ptr, stride, V, temps_ptr, seeds_ptr, counters_ptr, greedy_ptr, mass_ptr, key_ptr, idx_ptr,
                  z_ptr, bad_ptr, n_chunks, STREAM: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK tokens of one row -> their max and exp-mass of z = logit / T, the chunk's
    # winner (its race key, token id and z), and how many of its logits are not finite
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < V
    x = tl.load(logits_ptr + row * stride + idx, mask=valid, other=float("-inf")).to(tl.float32)
    z = x / temp
    m = tl.max(z, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf logits only: no mass
    out = row * n_chunks + chunk
    tl.store(mass_ptr + 2 * out, m)
    tl.store(mass_ptr + 2 * out + 1, tl.sum(tl.exp(z - m_safe), 0))
    tl.store(bad_ptr + out, tl.sum((valid & ~(tl.abs(x) < float("inf"))).to(tl.int32), 0))  # NaN fails < too

    seed = tl.load(seeds_ptr + row)
    h = _mix32(_u32(seed) ^ tl.full([], 0x9E3779B9, tl.uint32))
    h = _mix32(h ^ _u32(seed >> 32))
    h = _mix32(h ^ _u32(tl.load(counters_ptr + row)))
    h = _mix32(h ^ tl.full([], STREAM, tl.uint32))
    bits = _mix32(_mix32(h ^ _mix32(idx.to(tl.uint32))) ^ tl.full([], 0x85EBCA6B, tl.uint32))
    u = (bits.to(tl.float64) + 0.5) / 4294967296.0
    # The race of sampler.sample is argmax(logprob - log(-log u)); the log-sum-exp is the same for the whole
    # row, so z - log(-log u) has the same winner, and the chunks need not know it.
    key = tl.where(greedy, z.to(tl.float64), z.to(tl.float64) - tl.log(-tl.log(u)))
    key = tl.where(valid & (key == key), key, float("-inf"))  # a NaN never wins: the id stays in the vocabulary
    best = tl.argmax(key, 0, tie_break_left=True)  # ties: the lowest token id, as torch.argmax
    tl.store(key_ptr + out, tl.max(key, 0))
    tl.store(idx_ptr + out, chunk * BLOCK + best)
    tl.store(z_ptr + out, tl.sum(tl.where(tl.arange(0, BLOCK) == best, z, 0.0), 0))


@triton.jit
def _finish_kernel(mass_ptr, key_ptr, idx_ptr, z_ptr, bad_ptr, tok_ptr, lp_ptr, finite_ptr, n_chunks,
                   CHUNKS: tl.constexpr):
    # one program per row: the log-sum-exp from the chunks' masses, the winner of the chunks' winners (the
    # first chunk among equal keys: the lowest token id), its log-prob z - lse, and whether every logit was finite
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    valid = c < n_chunks
    base = row * n_chunks + c
    m_c = tl.load(mass_ptr + 2 * base, mask=valid, other=float("-inf"))
    s_c = tl.load(mass_ptr + 2 * base + 1, mask=valid, other=0.0)
    m = tl.max(m_c, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse = m + tl.log(tl.sum(tl.where(m_c == float("-inf"), 0.0, s_c * tl.exp(m_c - m_safe)), 0))
    key = tl.load(key_ptr + base, mask=valid, other=float("-inf"))
    win = tl.argmax(key, 0, tie_break_left=True)
    pick = c == win
    tl.store(tok_ptr + row, tl.sum(tl.where(pick, tl.load(idx_ptr + base, mask=valid, other=0), 0), 0))
    tl.store(lp_ptr + row, tl.sum(tl.where(pick, tl.load(z_ptr + base, mask=valid, other=0.0), 0.0), 0) - lse)
    tl.store(finite_ptr + row, tl.sum(tl.load(bad_ptr + base, mask=valid, other=0), 0) == 0)


BLOCK = 2048  # tokens per program of _chunk_kernel


def sample_plain(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                 greedy: torch.Tensor, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [rows, vocab]; per-row temperature (1 for greedy rows), seed, counter, greedy flag.
    Returns token ids [rows] int64, their processed log-probs [rows] float32, and whether each row's logits are
    all finite [rows] bool (torch.isfinite(logits).all(-1), from the same read of the logits, as the float32 values
    the race reads: a float64 logit past float32's range counts as not finite)."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    finite = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows:
        chunks = triton.cdiv(vocab, BLOCK)
        mass = torch.empty(rows, chunks, 2, dtype=torch.float32, device=logits.device)
        key = torch.empty(rows, chunks, dtype=torch.float64, device=logits.device)
        idx = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
        z = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
        bad = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
        _chunk_kernel[(rows, chunks)](logits, logits.stride(0), vocab, temperatures, seeds, counters,
                                      greedy.to(torch.int32), mass, key, idx, z, bad, chunks, STREAM=stream,
                                      BLOCK=BLOCK, num_warps=8)
        _finish_kernel[(rows,)](mass, key, idx, z, bad, tokens, logprobs, finite, chunks,
                                CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return tokens, logprobs, finite
