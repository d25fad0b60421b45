"""How many KV blocks does a request hold, and when does it get more? Lazy growth, shared prefixes.

Policies (SchedulerConfig.kv_allocation):
- ``"lazy"`` (default, vLLM's): a request holds blocks for the positions it has written plus what its
  next step writes. Admission needs the (re)prefill's blocks plus a watermark of free blocks, so a
  decode step rarely runs dry; when it does, the scheduler preempts (admission.py).
- ``"reserve"``: admission reserves the whole P + max_tokens - 1 positions at once (the control the
  rollout benchmark compares with); a running request never needs another block.

Shared prefixes. A (re)prefill feeds ``prompt + outputs``. Its full blocks are keyed by their token
prefix and the weight version of the step that admits it (block_manager.prefix_block_keys), so a block
is shared only by an equal prefix under the same weights. At admission the request takes, instead of
computing them (except where it still needs prompt log-probs: no block holding such a position is
shared, Request.prompt_logprobs_from), (a) blocks registered in the prefix cache by earlier prefills
(``enable_prefix_caching``), and
(b) blocks that another request admitted in the same plan is computing in that same prefill call
(``pending``: the n samples of a request), which works even with the cache off: within one layer,
every row's keys are written before any row attends. The block holding the last fed token is never
shared: its readout must be computed to sample from it, and a shared block is never written. Except
for a *fork*: when the prompt ends exactly at a block boundary and another prefill of the same plan
computes that whole prompt, the sample shares every block and draws its first token (own seed) from
that prefill's loop-T readout at the last position: the n samples of a request prefill it once.
A prefill longer than a step's token budget runs in chunks (prefill.py): ``admit`` takes the shared
blocks and those of the first chunk, ``take_chunk`` grows the request by what each later chunk writes,
and each chunk's full blocks are offered to its step and registered once that step succeeded
(``on_prefilled``), never before. ``epoch`` counts prefix-cache resets: a prefill under way since an
earlier epoch, or admitted under another weight version, neither offers nor registers its blocks (part
of its prefix is stale).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_manager import BlockKey, BlockManager, prefix_block_keys
from .request import Request

KV_ALLOCATIONS = ("lazy", "reserve")


@dataclass(frozen=True)
class Admission:
    """What admitting one request takes from the pool."""

    tokens: tuple[int, ...]  # the (re)prefill's tokens: prompt + outputs so far
    shared: tuple[int, ...]  # blocks taken as they are (cached or computed by a sibling this step)
    num_new: int  # fresh blocks the whole (re)prefill needs (reserve: the whole request); chunks take them lazily
    keys: tuple[BlockKey, ...]  # keys of every full block of `tokens`
    num_taken_evictable: int  # shared blocks that are evictable now (sharing takes them off the free count)
    sample_from: str | None = None  # fork: every block shared, token 1 from this request's prefill readout
    num_from_cache: int = 0  # of `shared`, the blocks the prefix cache held (the rest: prefilled this step)


@dataclass
class PendingPrefills:
    """What the prefills planned in this step compute, and under which weights: blocks by prefix key, and
    for each prefill that ends exactly at a block boundary, the key of its last block -> its request
    (forks read its readout)."""

    weight_version: object = 0  # the scheduler's weight_version this step runs under: salts every key
    blocks: dict = field(default_factory=dict)
    last_block_owner: dict = field(default_factory=dict)


class KVManager:
    def __init__(self, blocks: BlockManager, allocation: str, enable_prefix_caching: bool,
                 watermark_blocks: int) -> None:
        if allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation must be one of {KV_ALLOCATIONS}, got {allocation!r}")
        self.blocks = blocks
        self.allocation = allocation
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks if allocation == "lazy" else 0
        self.epoch = 0  # prefix-cache resets so far

    def plan_admission(self, r: Request, pending: PendingPrefills) -> Admission:
        tokens = r.all_token_ids
        bs = self.blocks.block_size
        keys = prefix_block_keys(tokens, bs, pending.weight_version)
        owner = pending.last_block_owner.get(keys[-1]) if keys and len(tokens) % bs == 0 else None
        # A fork shares every block (its token comes from the owner's readout); anything else never shares
        # the block of its last token, whose readout it must compute.
        limit = len(keys) if owner is not None else (len(tokens) - 1) // bs
        needed = r.prompt_logprobs_from  # prompt log-probs need that position's readout computed: share no
        if needed is not None:           # block holding it (a fork would skip it too)
            limit = min(limit, needed // bs)
        shared: list[int] = []
        cached = self.blocks.lookup(keys) if self.enable_prefix_caching else []
        from_cache = 0
        for i, key in enumerate(keys[:limit]):
            block = pending.blocks.get(key)
            if block is None and i < len(cached):
                block, from_cache = cached[i], from_cache + 1
            if block is None:
                break
            shared.append(block)
        if len(shared) < len(keys):
            owner = None
        positions = len(tokens) if self.allocation == "lazy" else r.num_cache_positions
        num_new = self.blocks.blocks_for(positions) - len(shared)
        taken = sum(self.blocks.is_evictable(b) for b in shared)
        return Admission(tokens, tuple(shared), num_new, tuple(keys), taken, owner, from_cache)

    def can_admit(self, a: Admission, alone: bool) -> bool:
        """Room for the prefill, plus the watermark unless nothing else runs (a request that fits the pool
        alone must always be admissible, or a tiny pool would wait forever)."""
        headroom = 0 if alone else self.watermark_blocks
        return self.blocks.can_allocate(a.num_new + a.num_taken_evictable + headroom)

    def admit(self, r: Request, a: Admission, num_tokens: int) -> int:
        """Take the shared blocks, and fresh ones for a first chunk of `num_tokens` tokens (reserve: for the
        whole request); returns the prefill's start (tokens whose KV is already there)."""
        self.blocks.share(a.shared)
        start = len(a.shared) * self.blocks.block_size
        num_new = a.num_new
        if self.allocation == "lazy":
            num_new = self.blocks.blocks_for(start + num_tokens) - len(a.shared)
        r.block_ids = a.shared + self.blocks.allocate(num_new)
        return start

    def fit_chunk(self, r: Request, start: int, num_tokens: int) -> int:
        """The part of a chunk of `num_tokens` from `start` (a block boundary) that the blocks `r` holds and
        the free ones can take: all of it, or whole blocks."""
        bs = self.blocks.block_size
        room = (len(r.block_ids) + self.blocks.num_free) * bs - start
        return num_tokens if num_tokens <= room else max(0, room // bs * bs)

    def take_chunk(self, r: Request, keys: tuple[BlockKey, ...], start: int, end: int, pending: PendingPrefills,
                   shareable: bool = True) -> None:
        """`r` computes positions [start, end) of its (re)prefill in this step: grow its blocks to hold them;
        offer the full blocks it computes to the step's other prefills, to be registered once the step
        succeeded (unless not `shareable`). The keys of an earlier chunk whose step is still in flight (async
        scheduling) stay pending beside them until that step's update."""
        self.grow(r, max(0, self.blocks.blocks_for(end) - len(r.block_ids)))
        if not shareable:
            return
        bs = self.blocks.block_size
        r.pending_keys_epoch = self.epoch  # (a shareable chunk's prefill began in this epoch: so did its others)
        for i in range(start // bs, end // bs):  # full blocks this chunk computes
            pending.blocks.setdefault(keys[i], r.block_ids[i])
            r.pending_block_keys.append((keys[i], r.block_ids[i]))
        total = r.num_tokens
        if end == total > start and total % bs == 0:  # the last chunk computes the last readout
            pending.last_block_owner.setdefault(keys[-1], r.request_id)

    def on_prefilled(self, r: Request, end: int) -> None:
        """The chunk of `r` ending at position `end` succeeded: its full blocks (and any before them) hold
        every plane of their prefix. Registered in the cache unless it was reset since they were planned (a
        step in flight across reset_prefix_cache computed them before it)."""
        done = set(r.block_ids[:end // self.blocks.block_size])
        if self.enable_prefix_caching and r.pending_keys_epoch == self.epoch:
            for key, block in r.pending_block_keys:
                if block in done:
                    self.blocks.register(key, block)
        r.pending_block_keys = [(key, block) for key, block in r.pending_block_keys if block not in done]

    def blocks_to_write(self, r: Request, position: int) -> int:
        """New blocks `r` needs before it writes `position`."""
        return max(0, position // self.blocks.block_size + 1 - len(r.block_ids))

    def grow(self, r: Request, num_blocks: int) -> None:
        if num_blocks:
            r.block_ids = r.block_ids + self.blocks.allocate(num_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (see BlockManager.reset_prefix_cache); a new epoch begins."""
        self.epoch += 1
        return self.blocks.reset_prefix_cache()

    def free(self, r: Request) -> None:
        """Give back `r`'s blocks. Its block_ids stay readable (tests read a finished request's planes)."""
        self.blocks.free(r.block_ids)
        r.pending_block_keys = []
