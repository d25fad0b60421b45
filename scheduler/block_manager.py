"""Which KV blocks are free, and which hold a known prefix? Int-only accounting of the paged pool.

One block holds ``block_size`` positions in every loop plane at once (the pool is
``[T, layers, blocks, block_size, kv_heads, head_dim]``), so a request needs
ceil(positions / block_size) blocks whatever the number of loops.

Blocks are reference-counted: the n samples of a request, and requests with a common prompt prefix,
hold the same full prompt blocks. A full block whose every plane was computed by a prefill can be
*registered* under the key of its token prefix (prefix caching). The key is a 256-bit BLAKE2b digest
chained over the whole prefix and salted with the weight version (``prefix_block_keys``), so a hit needs
the same tokens in the block and in every block before it, computed under the same weights: a hit on
another prompt's KV would take a BLAKE2b collision (the chain once went through Python's 64-bit
``hash()``). When its last holder frees it, a registered block is not returned to the free list but
kept, evictable, in LRU order: a later request with the same prefix takes it back (``lookup`` +
``share``) instead of computing it again, and ``allocate`` evicts the least recently freed one only
when no plain free block is left.

Invariants (tests/scheduler/test_block_manager.py checks them after every operation):
- every block is in exactly one of: free list, evictable (ref 0, registered), used (ref > 0);
- a registered block's key maps back to it;
- ``num_used + num_free == num_blocks``, where ``num_free`` counts free and evictable blocks.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from hashlib import blake2b
from typing import Iterable, Sequence

BlockKey = bytes  # prefix_block_keys: the digest of a block's whole token prefix and weight version

KEY_BYTES = 32  # 256-bit digests: a collision between two prefixes is out of reach (vLLM uses sha256)
KEY_PERSON = b"ourobatch-kv"  # BLAKE2b personalisation: these digests are prefix-cache keys, nothing else


def prefix_block_keys(token_ids: Sequence[int], block_size: int, weight_version: object = 0) -> list[bytes]:
    """Keys of the full blocks of `token_ids`, chained: key i identifies tokens[0 : (i+1) * block_size] and
    the weights that compute their KV.

    key -1 = BLAKE2b(repr((block_size, weight_version))); key i = BLAKE2b(key i-1 || block i's token ids,
    8 bytes each). Every input has a fixed width after the root, so different prefixes (or versions) give
    different byte strings, and equal keys mean equal prefixes unless BLAKE2b-256 collides."""
    ids = array("q", token_ids)  # validated token ids: ints in [0, vocab), 8 bytes each
    data, width = ids.tobytes(), ids.itemsize * block_size
    prev = blake2b(repr((block_size, weight_version)).encode(), digest_size=KEY_BYTES, person=KEY_PERSON).digest()
    keys: list[bytes] = []
    for start in range(0, len(token_ids) // block_size * width, width):
        prev = blake2b(prev + data[start:start + width], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._num_used = 0
        self._cache: dict[BlockKey, int] = {}  # prefix key -> registered block
        self._key_of: dict[int, BlockKey] = {}  # registered block -> its key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, ref 0; oldest first

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks an allocate() can hand out: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_uncached_free(self) -> int:
        """Free blocks that hold no cached prefix: what allocate() hands out before it evicts."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached prefix blocks no request holds: allocate() takes them, oldest first, once the free list is empty."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Registered prefix blocks, held or evictable."""
        return len(self._cache)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        """Fresh private blocks (reference count 1); evicts least recently freed cached blocks if needed."""
        assert self.can_allocate(num_blocks), f"allocate({num_blocks}) with {self.num_free} free"
        ids = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._cache[self._key_of.pop(block)]
            self._ref[block] = 1
            ids.append(block)
        self._num_used += num_blocks
        return tuple(ids)

    def share(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block: a used block, or an evictable cached one (taken back)."""
        for block in block_ids:
            if self._ref[block] == 0:
                assert block in self._evictable, f"block {block} is free, not shareable"
                del self._evictable[block]
                self._num_used += 1
            self._ref[block] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """One holder fewer for each block. Freed last-first, so a chain's tail is evicted before its head."""
        for block in reversed(block_ids):
            assert self._ref[block] > 0, f"block {block} freed twice or never allocated"
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._num_used -= 1
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, keys: Sequence[BlockKey]) -> list[int]:
        """Registered blocks of the longest prefix of `keys` (does not take them: call share())."""
        hits = []
        for key in keys:
            block = self._cache.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def register(self, key: BlockKey, block_id: int) -> None:
        """Mark a held block as holding the computed prefix `key`. A key already cached keeps its block."""
        assert self._ref[block_id] > 0, f"register({block_id}): block not held"
        if key in self._cache or block_id in self._key_of:
            return
        self._cache[key] = block_id
        self._key_of[block_id] = key

    def reset_prefix_cache(self) -> int:
        """Forget every registered prefix (after a weight update the KV is stale). Evictable blocks become
        free; held ones stay with their holders, unregistered. Returns the number of entries dropped."""
        dropped = len(self._cache)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cache.clear()
        self._key_of.clear()
        return dropped
