"""Verify mode's acceptance test: speculative rejection sampling of loop-s drafts against loop T.

Row i of a request's deep call holds the loop-s readout (the draft distribution p_s) and, after the
deep loops, the loop-T readout (the target p_T) of the position where draft i was drawn. Draft x is
accepted with probability min(1, p_T(x) / p_s(x)) (greedy: iff x is loop T's argmax); at the first
rejection the token is redrawn from the residual max(0, p_T - p_s), renormalised; if every draft is
accepted and a row follows them, the next token is drawn from that row's p_T. The output follows p_T
exactly. Randomness is counter-based: acceptance uses stream 1 and the residual draw stream 2 at the
draft's token index, the next token the ordinary stream 0, so verification is reproducible and
independent of the batch.
"""

from __future__ import annotations

import torch

from ourobatch.scheduler.params import SamplingParams
from ourobatch.scheduler.plan import VerifyResult

from .sampler import counter_uniforms, processed_logprobs, sample

STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2


def verify_drafts(request_id: str, drafts: tuple[int, ...], first_index: int, params: SamplingParams,
                  logits_s: torch.Tensor, logits_T: torch.Tensor) -> VerifyResult:
    """logits_s, logits_T: [rows, vocab] at the request's retained rows (rows == len(drafts) or + 1)."""
    n = len(drafts)
    rows = logits_T.shape[0]
    lp_T = processed_logprobs(logits_T, [params] * rows).double()  # [rows, vocab]
    lp_s = processed_logprobs(logits_s[:n], [params] * n).double() if n else lp_T[:0]
    dev = lp_T.device
    seeds = torch.full((max(n, 1),), params.seed or 0, dtype=torch.int64, device=dev)
    counters = torch.arange(first_index, first_index + max(n, 1), dtype=torch.int64, device=dev)
    accepted, logprobs = 0, []
    if n:
        x = torch.tensor(drafts, dtype=torch.int64, device=dev)
        t_lp = lp_T[:n].gather(1, x[:, None]).squeeze(1)
        if params.is_greedy:
            ok = x == lp_T[:n].argmax(-1)
        else:
            s_lp = lp_s.gather(1, x[:, None]).squeeze(1)
            u = counter_uniforms(seeds, counters, 1, stream=STREAM_ACCEPT)[:, 0]
            ok = torch.log(u) < (t_lp - s_lp)  # u < min(1, p_T / p_s)
        ok_list = ok.tolist()
        accepted = ok_list.index(False) if False in ok_list else n
        logprobs = t_lp[:accepted].tolist()
    j = first_index + accepted
    if accepted < n:  # the first rejection: draw from the residual
        row_T = lp_T[accepted]
        if params.is_greedy:
            token = int(row_T.argmax())
        else:
            residual = (row_T.exp() - lp_s[accepted].exp()).clamp_min(0)
            if float(residual.sum()) <= 0:  # p_T == p_s: nothing to correct
                residual = row_T.exp()
            u = counter_uniforms(seeds[:1], counters[accepted:accepted + 1], residual.shape[0],
                                 stream=STREAM_RESIDUAL)[0]
            token = int((residual.log() - torch.log(-torch.log(u))).argmax())
        return VerifyResult(request_id, accepted, tuple(logprobs), token, float(row_T[token]))
    if rows > n:  # every draft accepted: the next token from the last row's loop T
        out = sample(logits_T[n:n + 1], [params], [j])
        return VerifyResult(request_id, accepted, tuple(logprobs), out.token_ids[0], out.logprobs[0])
    return VerifyResult(request_id, accepted, tuple(logprobs), None, None)
