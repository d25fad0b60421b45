"""From a step's readouts to tokens: one batched lm_head + sampling pass over every readout row that
carries a SampleSpec, and the check that no non-finite logit is ever sampled or reported.

The pass is split for async scheduling: ``launch_sample`` queues the logits, the draws and the
finiteness flags on the device (and their copy to the host); ``PendingSample.read()`` is the one wait,
when the step's result is read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.plan import SampledToken, SampleSpec

from .model import OuroForCausalLM
from .sampler import DeviceSample, sample_on_device, to_host


@dataclass
class Readout:
    """Rows of one readout tensor to sample from, with their specs."""

    hidden: torch.Tensor  # [n, hidden]
    items: list[tuple[str, SampleSpec]]


@dataclass
class PendingSample:
    """A sampling pass queued on the device; read() waits for it."""

    items: list[tuple[str, SampleSpec]]
    drawn: DeviceSample
    finite: torch.Tensor  # [rows] bool: the row's logits are all finite (on the host once copied)

    @property
    def token_ids(self) -> torch.Tensor:
        """[rows] int64, on the device until read (the executor feeds them to the next step from there)."""
        return self.drawn.token_ids

    def read(self) -> tuple[list[SampledToken], list[str]]:
        """Every row's token, and the requests whose logits were not finite (their tokens are meaningless:
        the caller fails the step, unless those requests had already ended)."""
        result = self.drawn.read()  # waits for the copies (finite was copied before them)
        flags = self.finite.tolist()
        bad = list(dict.fromkeys(rid for (rid, _), ok in zip(self.items, flags) if not ok))
        tokens = [SampledToken(rid, tok, lp, spec.loop, top) for (rid, spec), tok, lp, top
                  in zip(self.items, result.token_ids, result.logprobs, result.top_logprobs)]
        return tokens, bad


def launch_sample(model: OuroForCausalLM, readouts: list[Readout], head_dtype: torch.dtype | None,
                  logprobs_mode: str) -> PendingSample:
    """One token per readout row, in the order of `readouts`, queued on the device (no host sync)."""
    h = torch.cat([r.hidden for r in readouts]) if len(readouts) > 1 else readouts[0].hidden
    items = [it for r in readouts for it in r.items]
    logits = model.logits(h, head_dtype)
    try:
        drawn = sample_on_device(logits, [spec.params for _, spec in items], [spec.token_index for _, spec in items],
                                 logprobs_mode)
    except Exception:  # what NaNs broke in the sampler: the non-finite logits are the error to report
        require_finite(torch.isfinite(logits).all(-1), [rid for rid, _ in items])
        raise
    # [rows]: the fast path's kernels check the logits as they read them; otherwise a pass of its own
    finite = drawn.finite if drawn.finite is not None else torch.isfinite(logits).all(-1)
    if finite.is_cuda:
        finite = to_host(finite)  # queued before the draws' copies, read after them
    drawn.start_copy()
    return PendingSample(items, drawn, finite)


def non_finite_message(request_ids: list[str]) -> str:
    more = " ..." if len(request_ids) > 8 else ""
    return (f"non-finite logits (NaN or inf) for request(s) {request_ids[:8]}{more}: the weights or activations "
            f"overflowed")


def require_finite(finite: torch.Tensor, row_ids: list[str]) -> None:
    """A NaN/inf logit would be sampled as a NaN log-prob: raise instead, so the phase fails its requests
    (finish_reason "error") and no such token or log-prob is ever emitted. finite: [rows] bool."""
    flags = finite.tolist()
    if not all(flags):
        bad = list(dict.fromkeys(rid for rid, ok in zip(row_ids, flags) if not ok))
        raise FloatingPointError(non_finite_message(bad))
