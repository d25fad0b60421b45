"""Verify mode's acceptance test: speculative rejection sampling of loop-s drafts against loop T.

Row i of a request's deep call holds the loop-s readout (the draft distribution p_s) and, after the
deep loops, the loop-T readout (the target p_T) of the position where draft i was drawn. Draft x is
accepted with probability min(1, p_T(x) / p_s(x)) (greedy: iff x is loop T's argmax); at the first
rejection the token is redrawn from the residual max(0, p_T - p_s), renormalised; if every draft is
accepted and a row follows them, the next token is drawn from that row's p_T. The output follows p_T
exactly. Randomness is counter-based: acceptance uses stream 1 and the residual draw stream 2 at the
draft's token index, the next token the ordinary stream 0, so verification is reproducible and
independent of the batch. All requests of a deep call are verified together (three host syncs, a
fourth for top log-probs). Every verified token reports loop T's log-prob and, with `logprobs=k`, loop
T's top log-probs at its position, as full-depth decoding would: processed, or with logprobs_mode="raw"
loop T's raw log_softmax (acceptance always compares the processed distributions the tokens follow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.params import SamplingParams
from scheduler.plan import VerifyResult

from .sampler import counter_uniforms, processed_logprobs, raw_logprobs, sample, top_logprobs

STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2


@dataclass
class VerifyItem:
    request_id: str
    drafts: tuple[int, ...]
    first_index: int  # token index of drafts[0]
    params: SamplingParams
    row_start: int  # first row of the request in the logits
    num_rows: int  # len(drafts) or len(drafts) + 1


def verify_batch(items: list[VerifyItem], logits_s: torch.Tensor, logits_T: torch.Tensor,
                 logprobs_mode: str) -> list[VerifyResult]:
    """logits_s, logits_T: [rows, vocab], the requests' rows concatenated in `items` order."""
    dev = logits_T.device
    row_params = [it.params for it in items for _ in range(it.num_rows)]
    row_index = [it.first_index + i for it in items for i in range(it.num_rows)]  # j of the token row i yields
    lp_T = processed_logprobs(logits_T, row_params, row_index).double()  # [rows, vocab]
    lp_s = processed_logprobs(logits_s, row_params, row_index).double()
    # what is reported: loop T's processed log-probs, or its raw ones (the acceptance test uses lp_T)
    rep_T = raw_logprobs(logits_T).double() if logprobs_mode == "raw" else lp_T
    # every draft of every request at once
    d_rows = [it.row_start + i for it in items for i in range(len(it.drafts))]
    accepted = [0] * len(items)
    draft_lps: list[list[float]] = [[] for _ in items]  # loop-T reported log-prob of each draft
    if d_rows:
        rows_t = torch.tensor(d_rows, dtype=torch.int64, device=dev)
        x = torch.tensor([t for it in items for t in it.drafts], dtype=torch.int64, device=dev)
        t_lp = lp_T[rows_t].gather(1, x[:, None]).squeeze(1)
        s_lp = lp_s[rows_t].gather(1, x[:, None]).squeeze(1)
        seeds = torch.tensor([it.params.seed or 0 for it in items for _ in it.drafts], dtype=torch.int64, device=dev)
        counters = torch.tensor([it.first_index + i for it in items for i in range(len(it.drafts))],
                                dtype=torch.int64, device=dev)
        greedy = torch.tensor([it.params.is_greedy for it in items for _ in it.drafts], device=dev)
        u = counter_uniforms(seeds, counters, 1, stream=STREAM_ACCEPT)[:, 0]
        ok = torch.where(greedy, x == lp_T[rows_t].argmax(-1), torch.log(u) < (t_lp - s_lp))  # u < p_T/p_s
        ok_list = ok.tolist()
        t_lp_list = (rep_T[rows_t].gather(1, x[:, None]).squeeze(1) if rep_T is not lp_T else t_lp).tolist()
        pos = 0
        for n, it in enumerate(items):
            flags = ok_list[pos:pos + len(it.drafts)]
            accepted[n] = flags.index(False) if False in flags else len(it.drafts)
            draft_lps[n] = t_lp_list[pos:pos + len(it.drafts)]
            pos += len(it.drafts)

    # the token after the accepted drafts, at row row_start + accepted: (token, loop-T log-prob) or None
    nxt: list[tuple[int, float] | None] = [None] * len(items)
    rejected = [n for n, it in enumerate(items) if accepted[n] < len(it.drafts)]
    if rejected:  # residual draws at the first rejection
        for n, drawn in zip(rejected, _residual_draws([items[n] for n in rejected], [accepted[n] for n in rejected],
                                                      lp_T, lp_s, rep_T)):
            nxt[n] = drawn
    bonus = [n for n, it in enumerate(items) if nxt[n] is None and it.num_rows > len(it.drafts)]
    if bonus:  # every draft accepted: the next token from the last row's loop T
        rows_t = torch.tensor([items[n].row_start + len(items[n].drafts) for n in bonus], dtype=torch.int64,
                              device=dev)
        out = sample(logits_T[rows_t], [items[n].params for n in bonus],
                     [items[n].first_index + len(items[n].drafts) for n in bonus], logprobs_mode)
        for n, t, lp in zip(bonus, out.token_ids, out.logprobs):
            nxt[n] = (t, lp)

    tops = _verified_top_logprobs(items, accepted, draft_lps, nxt, rep_T)
    results = []
    for n, it in enumerate(items):  # nxt is None when all were accepted and no row follows them
        token, lp = nxt[n] if nxt[n] is not None else (None, None)
        results.append(VerifyResult(it.request_id, accepted[n], tuple(draft_lps[n][:accepted[n]]), token, lp, tops[n]))
    return results


def _residual_draws(items: list[VerifyItem], accepted: list[int], lp_T: torch.Tensor, lp_s: torch.Tensor,
                    rep_T: torch.Tensor) -> list[tuple[int, float]]:
    """The token each rejecting request draws at its first rejected row (row_start + accepted) from the
    residual max(p_T - p_s, 0) (p_T where that is empty; argmax of p_T when greedy), with its reported
    loop-T log-prob. lp_T, lp_s, rep_T: [rows, vocab] float64."""
    dev = lp_T.device
    rows_t = torch.tensor([it.row_start + a for it, a in zip(items, accepted)], dtype=torch.int64, device=dev)
    p_T, p_s = lp_T[rows_t].exp(), lp_s[rows_t].exp()
    residual = (p_T - p_s).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p_T == p_s: nothing to correct
    residual = torch.where(empty, p_T, residual)
    seeds = torch.tensor([it.params.seed or 0 for it in items], dtype=torch.int64, device=dev)
    counters = torch.tensor([it.first_index + a for it, a in zip(items, accepted)], dtype=torch.int64, device=dev)
    u = counter_uniforms(seeds, counters, residual.shape[1], stream=STREAM_RESIDUAL)
    greedy = torch.tensor([it.params.is_greedy for it in items], device=dev)
    tok = torch.where(greedy, lp_T[rows_t].argmax(-1), (residual.log() - torch.log(-torch.log(u))).argmax(-1))
    tok_lp = rep_T[rows_t].gather(1, tok[:, None]).squeeze(1)
    return list(zip(tok.tolist(), tok_lp.tolist()))


def _verified_top_logprobs(items: list[VerifyItem], accepted: list[int], draft_lps: list[list[float]],
                           nxt: list[tuple[int, float] | None], reported: torch.Tensor):
    """Loop T's top log-probs at every verified token (the accepted drafts, then the next token) of the
    requests that ask for them: like any other token's, the k best reported log-probs plus the token."""
    rows, tokens, lps, ks, owner = [], [], [], [], []
    for n, it in enumerate(items):
        if it.params.num_top_logprobs <= 0:
            continue
        verified = list(zip(it.drafts[:accepted[n]], draft_lps[n][:accepted[n]]))
        if nxt[n] is not None:
            verified.append(nxt[n])
        for i, (token, lp) in enumerate(verified):  # verified token i was read at row row_start + i
            rows.append(it.row_start + i)
            tokens.append(token)
            lps.append(lp)
            ks.append(it.params.num_top_logprobs)
            owner.append(n)
    per_request: list[list] = [[] for _ in items]
    if rows:
        flat = top_logprobs(reported[torch.tensor(rows, dtype=torch.int64, device=reported.device)], tokens, lps, ks)
        for n, top in zip(owner, flat):
            per_request[n].append(top)
    return [tuple(t) for t in per_request]
