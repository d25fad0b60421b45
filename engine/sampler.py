"""Sampling with counter-based randomness and processed log-probabilities.

Processing order (every row, vectorised): min_tokens (the stop set is masked while fewer than min_tokens
tokens exist), temperature (greedy rows use 1), min-p, top-k, top-p; the
processed log-probs are log_softmax over the tokens kept. That is the distribution a token is drawn
from, and its log-prob is what is reported (vLLM's processed_logprobs). With logprobs_mode="raw" the
reported log-probs (the token's and the top ones) are log_softmax of the logits before any processing
instead (vLLM's raw_logprobs: what a trainer's own forward computes); the draw is the same either way.

Ties have one rule on every path: the lower token id ranks first (top-p's cut, top log-probs, the greedy
argmax; the exponential race's argmax too, though its keys almost never tie), so a row's result never
depends on an unstable sort, the batch around it, or the device.

Randomness is a pure function: the uniform for vocabulary entry i of a request's j-th generated token is
hash(seed, j, stream, i), so a draw never depends on which other rows share the batch, on the device,
on when the request arrived, or on the mode. The draw is an exponential race,
argmax_i p_i / E_i with E_i = -log(u_i), which picks i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.params import SamplingParams

from .batch import to_device

_M32 = 0xFFFFFFFF
STREAM_TOKEN = 0  # the draw of a generated token (other streams are reserved for verification)
TOPK_MAX = 1024  # top-k's threshold from torch.topk up to this k (sorted values), from a full sort past it


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x in [0, 2**32) without int64 overflow: split x into 16-bit halves.
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A bijective 32-bit integer mixer (xor-shift-multiply, "lowbias32" constants).
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int,
                     stream: int = STREAM_TOKEN) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per (row, vocabulary entry): [rows, vocab]."""
    # seeds, counters: [rows] int64, seeds in [0, 2**63), counters >= 0
    h = _mix32((seeds & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    h = _mix32(h ^ (counters & _M32))
    h = _mix32(h ^ (stream & _M32))
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(h[:, None] ^ _mix32(idx)[None, :]) ^ 0x85EBCA6B)
    return (bits.to(torch.float64) + 0.5) / 2.0**32


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...] | None]


def processed_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                       token_indices: list[int] | None = None) -> torch.Tensor:
    """logits: [rows, vocab] -> processed log-probs [rows, vocab] (float32 or float64), -inf when excluded.

    `token_indices` (j of each row's generated token) applies min_tokens first: a row whose j is at most
    its min_tokens has its stop set masked (vLLM's min-tokens logits processor)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dtype)
    rows, vocab = z.shape
    dev = z.device
    if token_indices is not None and any(p.min_tokens for p in params):
        masked = [(i, t) for i, (p, j) in enumerate(zip(params, token_indices))
                  for t in p.masked_token_ids(j) if t < vocab]
        if masked:
            r, t = to_device(masked, torch.int64, dev).T
            z = z.index_put((r, t), torch.full((), float("-inf"), dtype=dtype, device=dev))
    temps = to_device([1.0 if p.is_greedy else p.temperature for p in params], dtype, dev)
    z = z / temps[:, None]
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=dev)

    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        probs = torch.softmax(z, dim=-1)
        thresh = to_device(min_ps, dtype, dev)[:, None] * probs.amax(dim=-1, keepdim=True)
        z = torch.where(probs < thresh, neg_inf, z)

    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_ks):
        # each row's k-th largest value: the k_max largest of every row (ties do not move a value), not a sort
        # of the whole vocabulary
        k_max = max(top_ks)
        largest = z.topk(k_max, dim=-1).values if k_max <= TOPK_MAX else z.sort(dim=-1, descending=True).values
        kth = largest.gather(1, to_device(top_ks, torch.int64, dev)[:, None] - 1)
        z = torch.where(z < kth, neg_inf, z)

    top_ps = [p.top_p for p in params]
    if any(tp < 1.0 for tp in top_ps):
        probs = torch.softmax(z, dim=-1)
        # Stable: tied probabilities rank the lower token id first, so which of them survive the cut is
        # defined (the same alone, in any batch, on any device), not left to an unstable sort.
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass ranked strictly before each token
        keep_sorted = before < to_device(top_ps, dtype, dev)[:, None]
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        z = torch.where(keep, z, neg_inf)

    return torch.log_softmax(z, dim=-1)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] -> log_softmax before temperature, filters and min_tokens [rows, vocab],
    float32 (float64 for float64 logits): logprobs_mode="raw"."""
    return torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), dim=-1)


def _is_plain(p: SamplingParams, vocab: int, token_index: int) -> bool:
    return ((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0 and not p.num_top_logprobs
            and token_index > p.min_tokens)


def sample(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
           logprobs_mode: str = "processed") -> SamplerOutput:
    """Draw one token per row. logits: [rows, vocab]; token_indices: j of each row's generated token.
    logprobs_mode: which log-probs are reported ("processed" or "raw"); the draws do not depend on it."""
    return sample_on_device(logits, params, token_indices, logprobs_mode).read()


@dataclass
class DeviceSample:
    """A sampling pass whose results are still on the device: ``start_copy()`` queues their copy to the host
    (pinned memory, no wait), ``read()`` waits for it and returns the SamplerOutput."""

    token_ids: torch.Tensor  # [rows] int64 (stays on the device: the executor feeds the next step from it)
    logprobs: torch.Tensor  # [rows]: each token's reported log-prob
    num_top: list[int]  # per row: params.logprobs (top log-probs to report)
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # values, ids [rows with num_top > 0, k_max]
    finite: torch.Tensor | None = None  # [rows] bool, every logit finite: the fast path's, from its one read
    _host: tuple | None = None  # (token_ids, logprobs, top) copies on the host, once queued
    _copied: object = None  # the CUDA event after those copies

    def start_copy(self) -> None:
        if self._host is not None:
            return
        if not self.token_ids.is_cuda:
            self._host = (self.token_ids, self.logprobs, self.top)
            return
        top = None if self.top is None else (to_host(self.top[0]), to_host(self.top[1]))
        self._host = (to_host(self.token_ids), to_host(self.logprobs), top)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def read(self) -> SamplerOutput:
        self.start_copy()
        if self._copied is not None:
            self._copied.synchronize()
        token_ids, logprobs, top = self._host
        tokens, chosen = token_ids.tolist(), logprobs.tolist()
        return SamplerOutput(tokens, chosen, _top_entries(top, tokens, chosen, self.num_top))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor `t` in pinned host memory, queued (valid once the stream reaches it)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
                     logprobs_mode: str = "processed") -> DeviceSample:
    """sample() without reading anything back: the draws and log-probs stay on the device."""
    vocab = logits.shape[1]
    raw = logprobs_mode == "raw"
    num_top = [p.num_top_logprobs for p in params]
    if logits.is_cuda and all(_is_plain(p, vocab, j) for p, j in zip(params, token_indices)):
        from .triton_sampler import sample_plain

        dev = logits.device
        temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32)
        ints = torch.tensor([[p.seed or 0 for p in params], token_indices, [p.is_greedy for p in params]],
                            dtype=torch.int64)
        ints, temps = ints.to(dev, non_blocking=True), temps.to(dev, non_blocking=True)
        tokens, lps, finite = sample_plain(logits, temps, ints[0], ints[1], ints[2])
        if raw and any(p.temperature != 1.0 and not p.is_greedy for p in params):  # else raw == processed
            z = logits.float()  # [rows, vocab]
            lps = z.gather(1, tokens[:, None]).squeeze(1) - z.logsumexp(dim=-1)
        return DeviceSample(tokens, lps, num_top, finite=finite)
    logprobs = processed_logprobs(logits, params, token_indices)  # [rows, vocab]
    dev = logprobs.device
    greedy = to_device([p.is_greedy for p in params], torch.bool, dev)
    seeds = to_device([p.seed or 0 for p in params], torch.int64, dev)
    counters = to_device(token_indices, torch.int64, dev)
    drawn = race(logprobs, greedy, seeds, counters, triton_kernel=logprobs.is_cuda)
    reported = raw_logprobs(logits) if raw else logprobs  # [rows, vocab]
    chosen = reported.gather(1, drawn[:, None]).squeeze(1)
    return DeviceSample(drawn, chosen, num_top, _top_rows(reported, num_top))


def race(logprobs: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
         triton_kernel: bool = False) -> torch.Tensor:
    """The draw from processed log-probs [rows, vocab] (-inf: excluded): argmax(logprob - log(-log u)) with
    the counter uniforms, argmax(logprob) for greedy rows; ties to the lowest id; a NaN is never drawn (a row of
    NaN draws id 0: the non-finite check fails its request) -> token ids [rows] int64.

    With `triton_kernel` (CUDA, float32 log-probs) the fast path's kernels run it with temperature 1
    (engine/triton_sampler.py: the same uniforms, key and tie rule, float64 keys), reading the log-probs
    once; the torch race below makes ~45 passes of int64 [rows, vocab] for the uniforms alone."""
    if triton_kernel and logprobs.dtype == torch.float32:
        from .triton_sampler import sample_plain

        ones = torch.ones(logprobs.shape[0], dtype=torch.float32, device=logprobs.device)
        return sample_plain(logprobs, ones, seeds, counters, greedy)[0]
    u = counter_uniforms(seeds, counters, logprobs.shape[1])
    logprobs = logprobs.masked_fill(logprobs.isnan(), float("-inf"))  # a NaN never wins, as in the kernels
    keys = logprobs.to(torch.float64) - torch.log(-torch.log(u))  # log(p_i / E_i)
    return torch.where(greedy, logprobs.argmax(dim=-1), keys.argmax(dim=-1))  # argmax: the first (lowest id) max


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], chosen: list[float],
                 num_top: list[int]) -> list[tuple[tuple[int, float], ...] | None]:
    """Per row with num_top[i] = k > 0: the k best reported log-probs, then the sampled token (as vLLM
    reports it) with its log-prob `chosen[i]`; None for rows with k = 0. logprobs: [rows, vocab].
    Ties rank the lower token id first (a stable sort; topk leaves the order of ties unspecified)."""
    return _top_entries(_top_rows(logprobs, num_top), token_ids, chosen, num_top)


def _top_rows(logprobs: torch.Tensor, num_top: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The best k_max = max(num_top) log-probs and their ids of each row with num_top > 0, on the device."""
    wanted = [i for i, k in enumerate(num_top) if k > 0]
    if not wanted:
        return None
    k_max = min(max(num_top), logprobs.shape[1])
    rows = logprobs if len(wanted) == len(num_top) else logprobs[to_device(wanted, torch.int64, logprobs.device)]
    vals, ids = rows.sort(dim=-1, descending=True, stable=True)
    return vals[:, :k_max], ids[:, :k_max]


def _top_entries(top: tuple[torch.Tensor, torch.Tensor] | None, token_ids: list[int], chosen: list[float],
                 num_top: list[int]) -> list[tuple[tuple[int, float], ...] | None]:
    """top_logprobs' entries from _top_rows' values and ids (read back here)."""
    tops: list[tuple[tuple[int, float], ...] | None] = [None] * len(num_top)
    if top is None:
        return tops
    vals, ids = top[0].tolist(), top[1].tolist()
    for n, i in enumerate(i for i, k in enumerate(num_top) if k > 0):
        entries = dict(zip(ids[n][:num_top[i]], vals[n][:num_top[i]]))
        entries[token_ids[i]] = chosen[i]
        tops[i] = tuple(entries.items())
    return tops
