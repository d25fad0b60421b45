"""Replay scoring for the learner: a rollout's log-probs recomputed with one dense, differentiable forward.

Why one dense forward is enough (docs/semantics.md, "Replay"): loop r's readout at position p depends only
on loops 1..r at positions <= p, and the engine's deep loops always run at the original positions against
the true deep KV. So the log-prob the engine reported for generated token j is a function of the dense
model alone: take loop ``readout_loops[j-1]``'s readout at position ``prompt_len + j - 2`` (the position
before the token), apply the lm_head, and log_softmax (raw) or process it as the sampler did (processed).
That is exact for deferred, eager and verify rollouts and for preempted requests, as long as the weights
did not change while the request ran (``CompletionOutput.weight_versions`` says when they did).

The model contract (``LoopedModel``): ``loop_readouts(input_ids [b, S]) -> T tensors [b, S, hidden]``,
each loop's normed readout (Ouro applies ``model.norm`` at the end of every loop; that output is loop t's
readout and loop t+1's input), and ``lm_head_weight`` [vocab, hidden]. ``as_looped_model`` adapts
ourobatch's own ``OuroForCausalLM``; ``NormHookModel`` adapts any other implementation of the same
checkpoint (the Hugging Face remote code, a trainer's own class) by hooking its final norm, which runs
once per loop.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from engine.model import OuroForCausalLM, head_logits
from engine.sampler import processed_logprobs, raw_logprobs
from scheduler.params import LOGPROBS_MODES, SamplingParams

ParamsLike = SamplingParams | Mapping[str, Any] | None


@runtime_checkable
class LoopedModel(Protocol):
    """What readout_logprobs needs of a model (any implementation of an Ouro checkpoint)."""

    def loop_readouts(self, input_ids: torch.Tensor) -> Sequence[torch.Tensor]:
        """input_ids [b, S] -> T tensors [b, S, hidden]: each loop's normed readout, causal, no cache."""
        ...

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]"""
        ...


class OurobatchLoopedModel:
    """ourobatch's OuroForCausalLM as a LoopedModel (its dense_loops; fused projections are fine)."""

    def __init__(self, model: OuroForCausalLM) -> None:
        self.model = model

    def loop_readouts(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        return self.model.dense_loops(input_ids)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight


class NormHookModel:
    """Any implementation of an Ouro checkpoint as a LoopedModel: one call of `forward(input_ids)` with a
    forward hook on `norm`, the module Ouro applies at the end of every loop, collects the T readouts.

    Defaults follow the Hugging Face layout: `norm` = model.model.norm, `lm_head_weight` =
    model.lm_head.weight, `forward` = ``model.model(input_ids=ids)`` (the base model: no [b, S, vocab]
    logits). Pass `forward` for other call conventions (e.g. ``lambda ids: m.model(input_ids=ids,
    use_cache=False)``). Each forward must call `norm` exactly total_ut_steps times."""

    def __init__(self, model: nn.Module, *, norm: nn.Module | None = None,
                 lm_head_weight: torch.Tensor | None = None,
                 forward: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.model = model
        self.norm = norm if norm is not None else model.model.norm
        self._lm_head_weight = lm_head_weight
        self.forward = forward if forward is not None else (lambda ids: model.model(input_ids=ids))

    def loop_readouts(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        readouts: list[torch.Tensor] = []
        handle = self.norm.register_forward_hook(lambda module, args, out: readouts.append(out))
        try:
            self.forward(input_ids)
        finally:
            handle.remove()
        return readouts

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head_weight if self._lm_head_weight is not None else self.model.lm_head.weight


def as_looped_model(model: Any) -> LoopedModel:
    """ourobatch's OuroForCausalLM (adapted) or anything that already meets the LoopedModel contract."""
    if isinstance(model, OuroForCausalLM):
        return OurobatchLoopedModel(model)
    if isinstance(model, LoopedModel):
        return model
    raise TypeError(f"model must be an ourobatch OuroForCausalLM or a LoopedModel (loop_readouts(input_ids) -> "
                    f"T x [b, S, hidden] and lm_head_weight; wrap other implementations in NormHookModel), "
                    f"got {type(model).__name__}")


def _per_row(name: str, value: Any, b: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != b:
            raise ValueError(f"{name} has {len(value)} entries for {b} sequences")
        return list(value)
    return [value] * b


def readout_logprobs(model: Any, input_ids: torch.Tensor | Sequence[Sequence[int]],
                     readout_loops: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor, *,
                     prompt_len: int | Sequence[int], params: ParamsLike | Sequence[ParamsLike] = None,
                     logprobs_mode: str = "raw", head_dtype: torch.dtype | None = None,
                     eos_token_ids: int | Sequence[int] | None = None) -> torch.Tensor:
    """The log-prob of every generated token under the loop that produced it; differentiable.

    - `model`: ourobatch's OuroForCausalLM or a LoopedModel (see the module docstring). Gradients flow
      into its parameters when they require grad.
    - `input_ids`: one sequence [S] or a batch [b, S] (a tensor, or a list of token lists of any lengths):
      row i is its prompt, then its completion, then anything (right padding is never read).
    - `readout_loops`: one list per row (`CompletionOutput.readout_loops`); its length is the number of
      generated tokens C_i, and token j (1-based) is scored from loop readout_loops[j-1] at position
      prompt_len + j - 2. For a full-depth rollout it is [T] * C_i.
    - `prompt_len`: one int, or one per row.
    - `params`: the SamplingParams (or dict) the rollout used, one for all rows or one per row; only
      logprobs_mode="processed" reads them (temperature, top_k, top_p, min_p, and min_tokens, which masks
      stop_token_ids and the checkpoint's eos unless ignore_eos, as the engine's sampler did).
    - `eos_token_ids`: the checkpoint's eos, for that mask. None: ourobatch's model knows its own; any
      other LoopedModel must be told when a processed row has min_tokens and not ignore_eos (ValueError
      otherwise, rather than a silently unmasked eos), unless that row's params already carry the
      engine's stop set (``params.with_checkpoint_eos(eos_ids)``).
    - `logprobs_mode`: "raw" (log_softmax of the logits, the default: what the engine reports with
      ``EngineConfig(logprobs_mode="raw")``) or "processed" (the engine's default).
    - `head_dtype`: the lm_head matmul's dtype (None: the weight's; torch.float32 for
      ``EngineConfig(head_dtype="float32")``).

    Returns [b, C] (or [C] for one unbatched sequence), float32 (float64 for a float64 model), C the
    longest completion; entries past a row's completion are 0.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    lm = as_looped_model(model)
    weight = lm.lm_head_weight
    single = (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1) or (
        not isinstance(input_ids, torch.Tensor) and len(input_ids) > 0 and isinstance(input_ids[0], numbers.Integral))
    ids, lengths = _as_batch(input_ids, weight.device, single)  # [b, S], each row's own length
    loops, prompt_lens, row_params = _rows(model, ids, readout_loops, prompt_len, params, eos_token_ids,
                                           logprobs_mode, single, lengths)
    ids = _read_part(ids, [P + len(L) for P, L in zip(prompt_lens, loops)], weight.shape[0])
    readouts = lm.loop_readouts(ids)  # T x [b, S, hidden]
    entries = _entries(prompt_lens, loops, len(readouts))
    C = max((len(L) for L in loops), default=0)
    dev = weight.device
    if not entries:
        out = torch.zeros(ids.shape[0], C, dtype=torch.float64 if weight.dtype == torch.float64 else torch.float32,
                          device=dev)
        return out[0] if single else out
    rows, cols, pos, loop_ids, token_index = (torch.tensor(v, dtype=torch.int64, device=dev)
                                              for v in zip(*entries))
    tokens = ids[rows, pos + 1]  # generated token j sits one position after its readout
    logits = head_logits(_gather_readouts(readouts, rows, pos, loop_ids), weight, head_dtype)  # [N, vocab]
    if logprobs_mode == "raw":
        lp = raw_logprobs(logits)
    else:
        lp = processed_logprobs(logits, [row_params[i] for i, *_ in entries], token_index.tolist())
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)  # [N]
    out = torch.zeros(ids.shape[0], C, dtype=chosen.dtype, device=dev).index_put((rows, cols), chosen)
    return out[0] if single else out


def _rows(model: Any, ids: torch.Tensor, readout_loops: Any, prompt_len: Any, params: Any,
          eos_token_ids: int | Sequence[int] | None, logprobs_mode: str,
          single: bool, lengths: list[int]) -> tuple[list[list], list, list[SamplingParams]]:
    """readout_loops, prompt_len and params, one per row of ids [b, S] (row i `lengths[i]` tokens long),
    checked against each other."""
    b, S = ids.shape
    if isinstance(readout_loops, torch.Tensor):
        readout_loops = readout_loops.tolist()
    loops = [list(readout_loops)] if single else list(readout_loops)
    if len(loops) != b:
        raise ValueError(f"readout_loops has {len(loops)} rows for {b} sequences")
    prompt_lens = _per_row("prompt_len", prompt_len, b)
    row_params = _engine_params(model, _per_row("params", params, b), eos_token_ids, logprobs_mode)
    for i, (P, L) in enumerate(zip(prompt_lens, loops)):
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"prompt_len must be an int >= 1, got {P!r} for row {i}")
        if P + len(L) > lengths[i]:
            raise ValueError(f"row {i}: prompt_len {P} + {len(L)} readout loops exceed its {lengths[i]} input "
                             f"tokens")
    return loops, prompt_lens, row_params


def _entries(prompt_lens: list, loops: list[list], T: int) -> list[tuple[int, int, int, int, int]]:
    """One entry per generated token: (row, column j-1, readout position, loop, token index j); every loop
    an int in 1..T."""
    entries = [(i, j, P + j - 1, r, j + 1) for i, (P, L) in enumerate(zip(prompt_lens, loops))
               for j, r in enumerate(L)]
    bad = [(i, r) for i, _, _, r, _ in entries if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= T]
    if bad:
        raise ValueError(f"readout_loops must be ints in 1..{T} (the model's loops), got {bad[0][1]!r} in row "
                         f"{bad[0][0]}")
    return entries


def _gather_readouts(readouts: Sequence[torch.Tensor], rows: torch.Tensor, pos: torch.Tensor,
                     loop_ids: torch.Tensor) -> torch.Tensor:
    """Each entry's readout row from its own loop: readouts T x [b, S, hidden] -> [N, hidden], entry order."""
    parts, order = [], []
    for r in sorted(set(loop_ids.tolist())):
        sel = (loop_ids == r).nonzero().squeeze(1)
        parts.append(readouts[r - 1][rows[sel], pos[sel]])
        order.append(sel)
    return torch.cat(parts)[torch.argsort(torch.cat(order))]


def _engine_params(model: Any, rows: list, eos_token_ids: int | Sequence[int] | None,
                   logprobs_mode: str) -> list[SamplingParams]:
    """Each row's params with the stop set the engine's sampler masked while fewer than min_tokens tokens
    exist: stop_token_ids plus the checkpoint's eos unless ignore_eos (the one derivation the engine
    uses, SamplingParams.with_checkpoint_eos)."""
    if eos_token_ids is None and isinstance(model, OuroForCausalLM):
        eos_token_ids = model.config.eos_token_ids
    if isinstance(eos_token_ids, int):
        eos_token_ids = (eos_token_ids,)
    out = []
    for i, p in enumerate(SamplingParams.coerce(p) for p in rows):
        if eos_token_ids is not None:
            p = p.with_checkpoint_eos(tuple(eos_token_ids))
        elif (logprobs_mode == "processed" and p.min_tokens and not p.ignore_eos
              and p.all_stop_token_ids == frozenset(p.stop_token_ids)):
            raise ValueError(f"row {i}: min_tokens={p.min_tokens} masks the checkpoint's eos, which this "
                             f"{type(model).__name__} does not say: pass eos_token_ids (the engine's "
                             f"generation_config / config.json eos_token_id)")
        out.append(p)
    return out


def _as_batch(input_ids: Any, device: torch.device, single: bool) -> tuple[torch.Tensor, list[int]]:
    """[b, S] int64 ids (lists right-padded with 0) and each row's own length."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids[None] if single else input_ids
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [S] or [b, S], got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        return ids.to(device=device, dtype=torch.int64), [ids.shape[1]] * ids.shape[0]
    rows = [list(input_ids)] if single else [list(r) for r in input_ids]
    if not rows:
        raise ValueError("input_ids is empty")
    for i, row in enumerate(rows):
        bad = next((t for t in row if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise TypeError(f"input_ids row {i} holds {bad!r}: token ids must be ints")
    S = max(len(r) for r in rows)
    return (torch.tensor([[int(t) for t in r] + [0] * (S - len(r)) for r in rows], dtype=torch.int64, device=device),
            [len(r) for r in rows])


def _read_part(ids: torch.Tensor, ends: list[int], vocab: int) -> torch.Tensor:
    """ids with each row's tokens past `ends[i]` (padding, never read: positions attend only backwards) set
    to 0; a token the readouts read outside the vocabulary is a ValueError."""
    cols = torch.arange(ids.shape[1], device=ids.device)
    used = cols[None, :] < torch.tensor(ends, device=ids.device)[:, None]
    bad = used & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"input_ids[{row}][{col}] = {int(ids[row, col])} is outside the vocabulary [0, {vocab})")
    return torch.where(used, ids, torch.zeros_like(ids))


@torch.inference_mode()
def score(model: OuroForCausalLM, prompt: Sequence[int], completion: Sequence[int],
          readout_loops: Sequence[int] | None = None, *, params: ParamsLike = None,
          logprobs_mode: str, head_dtype: torch.dtype | None = None) -> list[float]:
    """No-grad log-probs of `completion` after `prompt` through an engine's model (Engine.score): one per
    completion token, from loop readout_loops[j-1] (default: every token from loop T, full depth). With
    the rollout's params, processed log-probs are the engine's: min_tokens masks the model's eos (unless
    ignore_eos) and stop_token_ids, as the sampler did. `logprobs_mode` has no default here: the engine's
    (EngineConfig.logprobs_mode, the facade's default) is the one score_on_executor passes."""
    prompt, completion = list(prompt), list(completion)
    config = model.config
    T, V = config.total_ut_steps, config.vocab_size
    if not prompt:
        raise ValueError("prompt must hold at least one token id")
    bad = [t for t in prompt + completion if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
    if bad:
        raise ValueError(f"token ids must be ints in 0..{V - 1}, got {bad[0]!r}")
    if len(prompt) + len(completion) > config.max_position_embeddings:
        raise ValueError(f"prompt + completion ({len(prompt) + len(completion)} tokens) exceed the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    loops = [T] * len(completion) if readout_loops is None else list(readout_loops)
    if len(loops) != len(completion):
        raise ValueError(f"readout_loops has {len(loops)} entries for {len(completion)} completion tokens")
    if not completion:
        return []
    ids = torch.tensor(prompt + completion, dtype=torch.int64, device=model.lm_head.weight.device)
    lps = readout_logprobs(model, ids, loops, prompt_len=len(prompt), params=params, logprobs_mode=logprobs_mode,
                           head_dtype=head_dtype)
    return lps.tolist()


def score_on_executor(executor: Any, prompt: Sequence[int], completion: Sequence[int],
                      readout_loops: Sequence[int] | None = None, params: ParamsLike = None) -> list[float]:
    """score() through an engine's executor: its model, logprobs_mode and head_dtype (Engine.score and
    SyncEngine.score call this on the thread that runs steps, never during one)."""
    return score(executor.model, prompt, completion, readout_loops, params=params,
                 logprobs_mode=executor.logprobs_mode, head_dtype=executor.head_dtype)


__all__ = ["LoopedModel", "NormHookModel", "OurobatchLoopedModel", "as_looped_model", "readout_logprobs", "score",
           "score_on_executor"]
