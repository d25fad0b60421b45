"""One-kernel sampling for rows with temperature only (no top-k / top-p / min-p, no top log-probs):
the common RL rollout case. Same function as sampler.sample: the same counter-based uniforms (the hash
is the same integer arithmetic, with the 16-bit split that never overflows), the same exponential race,
the same processed log-prob, the same tie rule (the lowest token id wins). Reads each row of logits
twice (max/logsumexp, then the race) instead of the dozens of [rows, vocab] passes of the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mulmod32(x, c: tl.constexpr):
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(logits_ptr, stride, V, temps_ptr, seeds_ptr, counters_ptr, greedy_ptr, tok_ptr, lp_ptr,
                   STREAM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temps_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    base = logits_ptr + row * stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        z = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(s)

    seed = tl.load(seeds_ptr + row)
    h = _mix32((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF))
    h = _mix32(h ^ (tl.load(counters_ptr + row) & 0xFFFFFFFF))
    h = _mix32(h ^ STREAM)
    best = tl.full((), float("-inf"), tl.float64)
    best_idx = tl.zeros((), tl.int64)
    best_lp = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < V
        lp = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) / temp - lse
        bits = _mix32(_mix32(h ^ _mix32(idx.to(tl.int64))) ^ 0x85EBCA6B)
        u = (bits.to(tl.float64) + 0.5) / 4294967296.0
        race = lp.to(tl.float64) - tl.log(-tl.log(u))
        key = tl.where(greedy, lp.to(tl.float64), race)
        key = tl.where(valid, key, float("-inf"))
        # Ties go to the lowest token id, as torch.argmax: the first max within a block, and a later
        # block replaces the running best only when strictly greater.
        blk_best = tl.max(key, 0)
        blk_idx = tl.argmax(key, 0, tie_break_left=True)
        blk_lp = tl.sum(tl.where(tl.arange(0, BLOCK) == blk_idx, lp, 0.0), 0)
        better = blk_best > best
        best = tl.where(better, blk_best, best)
        best_idx = tl.where(better, start + blk_idx, best_idx)
        best_lp = tl.where(better, blk_lp, best_lp)
    tl.store(tok_ptr + row, best_idx)
    tl.store(lp_ptr + row, best_lp)


def sample_plain(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                 greedy: torch.Tensor, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [rows, vocab]; per-row temperature (1 for greedy rows), seed, counter, greedy flag.
    Returns token ids [rows] int64 and their processed log-probs [rows] float32."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](logits, logits.stride(0), vocab, temperatures, seeds, counters,
                                greedy.to(torch.int32), tokens, logprobs, STREAM=stream, BLOCK=2048, num_warps=8)
    return tokens, logprobs
