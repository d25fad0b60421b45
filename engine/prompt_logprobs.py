"""Prompt log-probs: the log-prob of each prompt token under loop T's readout at the position before it.

They come from the prefill the request runs anyway: the executor hands over a prefill call's loop-T
readouts [rows, hidden] and each PrefillWork's PromptLogprobSpec says which of its rows (positions) to
score and against which prompt tokens. Log-probs are raw (log_softmax of the logits) or processed (after
the request's temperature, min-p, top-k and top-p, as its sampled tokens are; no min_tokens mask, which
concerns generated tokens) per the engine's logprobs_mode, so a prompt token's log-prob is what its
sampled counterpart would report at that position. Ranks and top-k follow the sampler's tie rule: the
lower token id ranks first. Rows are scored in slices so the [rows, vocab] logits of a long prompt chunk
never exist at once.
"""

from __future__ import annotations

import torch

from scheduler.plan import PrefillWork, PromptLogprobs

from .sampler import processed_logprobs, raw_logprobs

ROWS_PER_SLICE = 512  # rows scored at once: bounds the [rows, vocab] logits of a long prompt chunk


def prompt_logprobs(model, h_T: torch.Tensor, works: list[PrefillWork], row_starts: list[int],
                    logprobs_mode: str, head_dtype: torch.dtype | None, check_finite) -> list[PromptLogprobs]:
    """One PromptLogprobs per work with a spec. h_T: [rows, hidden], the call's loop-T readouts; row_starts:
    each work's first row in h_T (its row for position work.start_position). `check_finite(finite, ids)`
    raises on non-finite logits ([rows] bool), as sampling does."""
    out = []
    for w, row0 in zip(works, row_starts):
        spec = w.prompt_logprobs
        if spec is None:
            continue
        first = row0 + spec.start_position - w.start_position
        lps, ranks, tops = [], [], []
        for lo in range(0, len(spec.target_token_ids), ROWS_PER_SLICE):
            targets = spec.target_token_ids[lo:lo + ROWS_PER_SLICE]
            logits = model.logits(h_T[first + lo:first + lo + len(targets)], head_dtype)  # [n, vocab]
            check_finite(torch.isfinite(logits).all(-1), [w.request_id] * len(targets))
            if logprobs_mode == "raw":
                reported = raw_logprobs(logits)
            else:
                reported = processed_logprobs(logits, [spec.params] * len(targets))
            lp, rank, top = score_rows(reported, list(targets), spec.num_top)
            lps += lp
            ranks += rank
            tops += top
        out.append(PromptLogprobs(w.request_id, spec.start_position, tuple(lps), tuple(ranks), tuple(tops)))
    return out


def score_rows(logprobs: torch.Tensor, targets: list[int], num_top: int
               ) -> tuple[list[float], list[int], list[tuple[tuple[int, float], ...]]]:
    """logprobs: [rows, vocab]; targets: one token per row. Returns each target's log-prob, its 1-based
    rank (1 + the tokens above it + the tied ones with a lower id) and, for num_top != 0, the num_top best
    (-1: all) (token, log-prob) pairs of each row in rank order (a stable sort: ties, lower id first)."""
    rows, vocab = logprobs.shape
    tgt = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    value = logprobs.gather(1, tgt[:, None])  # [rows, 1]
    ids = torch.arange(vocab, device=logprobs.device)[None, :]
    ahead = (logprobs > value) | ((logprobs == value) & (ids < tgt[:, None]))
    ranks = (ahead.sum(-1) + 1).tolist()
    k = vocab if num_top < 0 else min(num_top, vocab)
    tops: list[tuple[tuple[int, float], ...]] = []
    if k:
        vals, order = logprobs.sort(dim=-1, descending=True, stable=True)
        vals, order = vals[:, :k].tolist(), order[:, :k].tolist()
        tops = [tuple(zip(o, v)) for o, v in zip(order, vals)]
    return value[:, 0].tolist(), ranks, tops
