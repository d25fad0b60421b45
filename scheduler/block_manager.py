"""Which KV blocks are free? Int-only accounting of the paged pool.

One block holds ``block_size`` positions in every loop plane at once (the pool is
``[T, layers, blocks, block_size, kv_heads, head_dim]``), so a request needs
ceil(positions / block_size) blocks whatever the number of loops. A request reserves its whole need
at admission and returns it on any end, so decode never runs out of blocks mid-request.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        assert self.can_allocate(num_blocks), f"allocate({num_blocks}) with {len(self._free)} free"
        ids = tuple(self._free.popleft() for _ in range(num_blocks))
        self._used.update(ids)
        return ids

    def free(self, block_ids: tuple[int, ...]) -> None:
        for block_id in block_ids:
            assert block_id in self._used, f"block {block_id} freed twice or never allocated"
            self._used.remove(block_id)
            self._free.append(block_id)
