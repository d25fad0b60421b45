"""Verify mode's acceptance test: speculative rejection sampling of loop-s drafts against loop T.

Row i of a request's deep call holds the loop-s readout (the draft distribution p_s) and, after the
deep loops, the loop-T readout (the target p_T) of the position where draft i was drawn. Draft x is
accepted with probability min(1, p_T(x) / p_s(x)) (greedy: iff x is loop T's argmax); at the first
rejection the token is redrawn from the residual max(0, p_T - p_s), renormalised; if every draft is
accepted and a row follows them, the next token is drawn from that row's p_T. The output follows p_T
exactly. Randomness is counter-based: acceptance uses stream 1 and the residual draw stream 2 at the
draft's token index, the next token the ordinary stream 0, so verification is reproducible and
independent of the batch. All requests of a deep call are verified together (three host syncs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ourobatch.scheduler.params import SamplingParams
from ourobatch.scheduler.plan import VerifyResult

from .sampler import counter_uniforms, processed_logprobs, sample

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


def verify_batch(items: list[VerifyItem], logits_s: torch.Tensor, logits_T: torch.Tensor) -> list[VerifyResult]:
    """logits_s, logits_T: [rows, vocab], the requests' rows concatenated in `items` order."""
    dev = logits_T.device
    row_params = [it.params for it in items for _ in range(it.num_rows)]
    lp_T = processed_logprobs(logits_T, row_params).double()  # [rows, vocab]
    lp_s = processed_logprobs(logits_s, row_params).double()
    # every draft of every request at once
    d_rows = [it.row_start + i for it in items for i in range(len(it.drafts))]
    accepted = [0] * len(items)
    t_lp_list: list[float] = []
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
        ok_list, t_lp_list = ok.tolist(), t_lp.tolist()
        pos = 0
        for n, it in enumerate(items):
            flags = ok_list[pos:pos + len(it.drafts)]
            accepted[n] = flags.index(False) if False in flags else len(it.drafts)
            pos += len(it.drafts)

    results: list[VerifyResult | None] = [None] * len(items)
    starts, pos = [], 0
    for it in items:
        starts.append(pos)
        pos += len(it.drafts)
    rejected = [n for n, it in enumerate(items) if accepted[n] < len(it.drafts)]
    if rejected:  # residual draws at the first rejection
        rows_t = torch.tensor([items[n].row_start + accepted[n] for n in rejected], dtype=torch.int64, device=dev)
        p_T, p_s = lp_T[rows_t].exp(), lp_s[rows_t].exp()
        residual = (p_T - p_s).clamp_min(0)
        empty = residual.sum(-1, keepdim=True) <= 0  # p_T == p_s: nothing to correct
        residual = torch.where(empty, p_T, residual)
        seeds = torch.tensor([items[n].params.seed or 0 for n in rejected], dtype=torch.int64, device=dev)
        counters = torch.tensor([items[n].first_index + accepted[n] for n in rejected], dtype=torch.int64,
                                device=dev)
        u = counter_uniforms(seeds, counters, residual.shape[1], stream=STREAM_RESIDUAL)
        greedy = torch.tensor([items[n].params.is_greedy for n in rejected], device=dev)
        tok = torch.where(greedy, lp_T[rows_t].argmax(-1), (residual.log() - torch.log(-torch.log(u))).argmax(-1))
        tok_lp = lp_T[rows_t].gather(1, tok[:, None]).squeeze(1)
        for n, t, lp in zip(rejected, tok.tolist(), tok_lp.tolist()):
            it, a = items[n], accepted[n]
            results[n] = VerifyResult(it.request_id, a, tuple(t_lp_list[starts[n]:starts[n] + a]), t, lp)
    bonus = [n for n, it in enumerate(items) if results[n] is None and it.num_rows > len(it.drafts)]
    if bonus:  # every draft accepted: the next token from the last row's loop T
        rows_t = torch.tensor([items[n].row_start + len(items[n].drafts) for n in bonus], dtype=torch.int64,
                              device=dev)
        out = sample(logits_T[rows_t], [items[n].params for n in bonus],
                     [items[n].first_index + len(items[n].drafts) for n in bonus])
        for n, t, lp in zip(bonus, out.token_ids, out.logprobs):
            it = items[n]
            results[n] = VerifyResult(it.request_id, len(it.drafts), tuple(t_lp_list[starts[n]:starts[n] + len(it.drafts)]),
                                      t, lp)
    for n, it in enumerate(items):
        if results[n] is None:  # all accepted, no row after them (the request ends on its last draft)
            results[n] = VerifyResult(it.request_id, len(it.drafts),
                                      tuple(t_lp_list[starts[n]:starts[n] + len(it.drafts)]), None, None)
    return results  # type: ignore[return-value]
