"""Chunked prefill: how many prompt tokens each prefill computes in a step, and where a long one stands.

Theory of operation. A step's token budget, ``max_num_batched_tokens``, counts the rows a step feeds
for the first time: one per shallow (decode) row, plus every prompt token it prefills. Decoding requests
are planned first and never held back; prefills share what they leave, oldest first: the prefills
already under way (by arrival), then new admissions (admission.py). Each prefill computes a *chunk*:
the rest of its (re)prefill when that fits, else the most whole blocks that fit, so every chunk but the
last ends on a block boundary (chunks start on one: after shared blocks or an earlier chunk) and its
full blocks enter the prefix cache as soon as its step succeeded. The first prefill of a step that
computes anything gets at least one block even when the decode rows leave less, or nothing: a long
prompt progresses in every step, and a step prefills at most max(budget - decode rows, block_size)
tokens (``max_num_batched_tokens >= block_size`` is required). While any request decodes,
``max_prefill_tokens_while_decoding`` (when set) caps the prompt tokens of the step too, so a step that
prefills stays near a decode step and the decoding requests' gaps stay even (serve's default); with no
request decoding the whole budget goes to prefills.

A request stays PREFILLING from admission until its last chunk, which alone samples (loop T at the
last position); it then joins the open cohort as an unchunked prefill does, so outputs do not depend on
the chunking. While PREFILLING, ``num_deep_positions`` is its progress: positions before it have every
loop plane filled (shared blocks and successful chunks). A chunk takes the blocks it writes (lazy
allocation; ``reserve`` took them all at admission). ``make_room`` counts one block for the next chunk
of every prefill under way, so preemption (newest first) keeps the oldest running request progressing;
a preempted prefill waits again and restarts from the blocks the prefix cache kept. An abort or a
failed chunk ends the request and frees its blocks like any end.

Sharing. A chunk offers the full blocks it computes to the other prefills of its step, as a whole
prefill does (the n samples of a request fork from its last chunk when the prompt ends on a block
boundary). A prompt longer than the budget takes all of it until its last chunk, so its samples are
admitted in that step or later; with the prefix cache on they share every full block (the earlier
chunks' from the cache, the last chunk's from the step); with it off they compute the prompt
themselves unless it fits one step, as without chunking. After a prefix-cache reset or a change of
weight version (a weight update) the blocks of a prefill under way are no longer shared or registered:
part of their prefix was computed by the old weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_manager import BlockKey
from .config import SchedulerConfig
from .counters import SchedulerCounters
from .kv_manager import Admission, KVManager, PendingPrefills
from .plan import PrefillWork, PromptLogprobs, PromptLogprobSpec, SampleSpec
from .request import Request, RequestStatus, set_status


@dataclass(eq=False)
class PartialPrefill:
    """A prefill under way: admitted, its last chunk not planned yet."""

    request: Request
    keys: tuple[BlockKey, ...]  # prefix keys of the full blocks of its tokens (prompt + outputs at admission)
    epoch: int  # KVManager.epoch at admission: after a prefix-cache reset its blocks are not shared
    weight_version: object  # Scheduler.weight_version at admission, its keys' salt: after a change, not shared


class Prefills:
    """The prefills under way, by request id (their one owner), and the planner of each step's chunks."""

    def __init__(self, config: SchedulerConfig, kv: KVManager, counters: SchedulerCounters) -> None:
        self.config = config
        self.kv = kv
        self.counters = counters  # admissions are counted here (the chunks from the plan, counters.py)
        self.under_way: dict[str, PartialPrefill] = {}

    def live(self) -> list[PartialPrefill]:
        """The prefills under way, oldest first; forgets those that ended or were preempted since (a request
        that is still PREFILLING is live, so it is the one that holds its id)."""
        for rid, p in list(self.under_way.items()):
            if p.request.status != RequestStatus.PREFILLING:
                del self.under_way[rid]
        return sorted(self.under_way.values(), key=lambda p: p.request.arrival_index)

    def next_chunk_blocks(self) -> int:
        """Blocks the prefills under way need for a next chunk of one block (make_room keeps them free)."""
        bs, blocks = self.config.block_size, self.kv.blocks
        need = 0
        for p in self.live():
            r = p.request
            end = min(r.num_deep_positions + bs, r.num_tokens)
            need += max(0, blocks.blocks_for(end) - len(r.block_ids))
        return need

    def plan_step(self, weight_version: int, num_decode_rows: int) -> "ChunkPlanner":
        """The planner of this step's prefills (under `weight_version`); it continues those under way."""
        return ChunkPlanner(self, weight_version, num_decode_rows)


def prompt_logprob_spec(r: Request, start: int, end: int) -> PromptLogprobSpec | None:
    """The prompt log-probs a chunk computing positions [start, end) of `r` gives: the readouts at the
    positions still needed (from r.prompt_logprobs_from) before the last prompt position, whose readout
    samples generated token 1 instead. Admission shares no block holding a needed position."""
    first = r.prompt_logprobs_from
    if first is None:
        return None
    assert start <= first, f"req {r.request_id}: prompt log-probs from {first}, but the prefill starts at {start}"
    last = min(end, r.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptLogprobSpec(first, r.prompt_token_ids[first + 1:last + 1], r.params.prompt_logprobs, r.params)


def record_prompt_logprobs(r: Request, work: PrefillWork, got: PromptLogprobs | None) -> str | None:
    """Append a successful chunk's prompt log-probs to `r`; the error to end `r` with if the executor's
    result does not match the spec (an executor bug must not pass silently)."""
    spec = work.prompt_logprobs
    if spec is None:
        return None
    n = len(spec.target_token_ids)
    if (got is None or got.start_position != spec.start_position or len(got.logprobs) != n or len(got.ranks) != n
            or spec.start_position != len(r.prompt_logprobs) or len(got.top_logprobs) not in (0, n)):
        return "the executor returned no (or mismatched) prompt log-probs for this request"
    tops = got.top_logprobs or ((),) * n
    r.prompt_logprobs.extend(zip(got.logprobs, got.ranks, tops))
    return None


def prefill_budget(config: SchedulerConfig, num_decode_rows: int) -> int:
    """Prompt tokens a step may prefill beside `num_decode_rows` decode rows (before the one-block minimum)."""
    left = max(0, config.max_num_batched_tokens - num_decode_rows)
    cap = config.max_prefill_tokens_while_decoding
    return min(left, cap) if cap is not None and num_decode_rows > 0 else left


class ChunkPlanner:
    """One step's prefills: the token budget the decode rows left, and the chunks planned so far.

    Made after the step's decode rows are planned; it continues the prefills under way at once, then
    admission.admit() asks it to size (``chunk_size``) and plan (``begin``) each new admission."""

    def __init__(self, prefills: Prefills, weight_version: int, num_decode_rows: int) -> None:
        self.prefills = prefills
        self.kv = prefills.kv
        self.block_size = prefills.config.block_size
        self.left = prefill_budget(prefills.config, num_decode_rows)
        self.num_tokens = 0  # prompt tokens planned in this step
        self.weight_version = weight_version
        # what this step's chunks compute (shared by its other prefills), under this step's weights
        self.pending = PendingPrefills(weight_version)
        self.works: list[PrefillWork] = []
        for p in prefills.live():
            r = p.request
            start = r.num_deep_positions
            n = self.kv.fit_chunk(r, start, self.chunk_size(r.num_tokens - start))
            if n:
                self._plan(p, start, n, None)

    def chunk_size(self, remaining: int) -> int:
        """Tokens a prefill with `remaining` tokens to compute (from a block boundary) computes now: all
        of them if they fit the budget left, else the most whole blocks that fit; the first prefill of the
        step that computes anything gets at least one block."""
        allowance = self.left if self.num_tokens else max(self.left, self.block_size)
        if remaining <= allowance:
            return remaining
        return allowance // self.block_size * self.block_size

    def begin(self, r: Request, a: Admission, num_tokens: int) -> None:
        """Admit `r` (already off the waiting queue) with a first chunk of `num_tokens` tokens."""
        first = r.admission_version is None
        if first:  # CompletionOutput.weight_version: the weights it started with
            r.admission_version = self.weight_version
        start = self.kv.admit(r, a, num_tokens)
        if first:  # RequestOutput.num_cached_tokens (vLLM's): the prompt tokens the prefix cache served (not
            r.num_cached_tokens = a.num_from_cache * self.kv.blocks.block_size  # those shared in this step)
        set_status(r, RequestStatus.PREFILLING)
        r.num_outputs_at_prefill = r.num_output_tokens  # > 0 after a preemption: prompt + outputs again
        r.num_deep_positions = start  # shared blocks hold every plane
        # a readmission after a preemption prefills again, outputs or not (one preempted between chunks has none)
        self.prefills.counters.count_admission(len(a.tokens), start, is_recompute=r.num_preemptions > 0)
        p = PartialPrefill(r, a.keys, self.kv.epoch, self.pending.weight_version)
        self._plan(p, start, num_tokens, a.sample_from)

    def _plan(self, p: PartialPrefill, start: int, n: int, sample_from: str | None) -> None:
        """One PrefillWork over positions [start, start + n); the last chunk samples from loop T."""
        r = p.request
        end, total = start + n, r.num_tokens
        fresh = p.epoch == self.kv.epoch and p.weight_version == self.pending.weight_version  # whole prefix
        self.kv.take_chunk(r, p.keys, start, end, self.pending, shareable=fresh)
        last = end == total
        loop_t = self.prefills.config.total_ut_steps
        spec = SampleSpec(loop_t, r.num_outputs_at_prefill + 1, r.params) if last else None
        tokens = r.all_token_ids[start:end]
        self.works.append(PrefillWork(r.request_id, tokens, start, r.block_ids, spec, sample_from,
                                      prompt_logprob_spec(r, start, end)))
        self.left = max(0, self.left - n)
        self.num_tokens += n
        if last:
            self.prefills.under_way.pop(r.request_id, None)
        else:
            self.prefills.under_way[r.request_id] = p
