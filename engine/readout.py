"""From a step's readouts to tokens: one batched lm_head + sampling pass over every readout row that
carries a SampleSpec, and the check that no non-finite logit is ever sampled or reported."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ourobatch.scheduler.plan import SampledToken, SampleSpec

from .model import OuroForCausalLM
from .sampler import sample


@dataclass
class Readout:
    """Rows of one readout tensor to sample from, with their specs."""

    hidden: torch.Tensor  # [n, hidden]
    items: list[tuple[str, SampleSpec]]


def sample_readouts(model: OuroForCausalLM, readouts: list[Readout], head_dtype: torch.dtype | None,
                    logprobs_mode: str) -> list[SampledToken]:
    """One token per readout row, in the order of `readouts`; FloatingPointError on a non-finite logit."""
    h = torch.cat([r.hidden for r in readouts]) if len(readouts) > 1 else readouts[0].hidden
    items = [it for r in readouts for it in r.items]
    logits = model.logits(h, head_dtype)
    finite = torch.isfinite(logits).all(-1)  # [rows]
    try:
        result = sample(logits, [spec.params for _, spec in items], [spec.token_index for _, spec in items],
                        logprobs_mode)
    finally:  # checked after the sampler's own sync (no extra stall); wins over what NaNs broke there
        require_finite(finite, [rid for rid, _ in items])
    return [
        SampledToken(rid, tok, lp, spec.loop, top)
        for (rid, spec), tok, lp, top in zip(items, result.token_ids, result.logprobs, result.top_logprobs)
    ]


def require_finite(finite: torch.Tensor, row_ids: list[str]) -> None:
    """A NaN/inf logit would be sampled as a NaN log-prob: raise instead, so the phase fails its requests
    (finish_reason "error") and no such token or log-prob is ever emitted. finite: [rows] bool."""
    flags = finite.tolist()
    if not all(flags):
        bad = list(dict.fromkeys(rid for rid, ok in zip(row_ids, flags) if not ok))
        raise FloatingPointError(f"non-finite logits (NaN or inf) for request(s) {bad[:8]}"
                                 f"{' ...' if len(bad) > 8 else ''}: the weights or activations overflowed")
