"""The paged KV pool: one plane per loop, one block table per request shared by every plane.

    k, v: [T, layers, num_blocks + 1, block_size, kv_heads, head_dim]

A position's slot (block_ids[pos // block_size] * block_size + pos % block_size) is the same in every
loop plane, so blocks are allocated per position, not per loop. Loop t's attention reads only plane t.
Rolling a request back to an earlier position needs no work here: later slots are simply overwritten
when those positions are fed again (the scheduler owns the lengths).

The pool owns its geometry (``shape``, ``bytes_per_block``: the one place that computes them) and its
memory: ``release()`` frees k and v while the engine sleeps, ``reallocate()`` gives them back.
"""

from __future__ import annotations

import torch

from .batch import to_device
from .config import OuroConfig


class KVPool:
    def __init__(self, num_loops: int, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        # One extra block at index num_blocks: the scratch block that padding rows of a CUDA graph write to.
        self.shape = (num_loops, num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.reallocate()

    @classmethod
    def for_model(cls, config: OuroConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> "KVPool":
        """A pool with one plane per loop and layer of `config`'s model."""
        return cls(config.total_ut_steps, config.num_hidden_layers, num_blocks, block_size,
                   config.num_key_value_heads, config.head_dim, dtype, device)

    @staticmethod
    def bytes_per_block(config: OuroConfig, block_size: int, dtype: torch.dtype) -> int:
        """Device bytes one block of `config`'s pool takes (K and V, every loop plane and layer)."""
        return (2 * config.total_ut_steps * config.num_hidden_layers * block_size * config.num_key_value_heads
                * config.head_dim * torch.empty((), dtype=dtype).element_size())

    def release(self) -> None:
        """Free k and v (the engine sleeps); the geometry stays, reallocate() gives the memory back."""
        self.k = self.v = None
        self._views = None

    def reallocate(self) -> None:
        """(Re)allocate k and v at the pool's geometry. Their contents are undefined: nothing is read
        before a request writes it."""
        # Uninitialised on purpose: only slots a request has written are ever read, and untouched pages
        # of a large CPU pool cost no memory.
        self.k = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.v = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self._views = None

    @property
    def num_bytes(self) -> int:
        if self.k is None:  # the engine sleeps: the pool is freed until wake_up()
            return 0
        return 2 * self.k.numel() * self.k.element_size()

    def _plane_views(self, loop: int, layer: int) -> tuple[torch.Tensor, ...]:
        """(k, v flat, k, v paged) views of one plane, made once per (loop, layer) and k / v tensor: a layer
        pass asks for them every call, and each view is a few host ops."""
        views = getattr(self, "_views", None)  # a pool built field by field (tests) has no cache yet
        if views is None or views[0] is not self.k or views[1] is not self.v:
            views = self._views = (self.k, self.v, {})
        per = views[2].get((loop, layer))
        if per is None:
            k, v = self.k[loop - 1, layer], self.v[loop - 1, layer]
            per = views[2][loop, layer] = (k.view(-1, *k.shape[-2:]), v.view(-1, *v.shape[-2:]), k, v)
        return per

    def plane(self, loop: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Loop `loop` (1-based) and layer's K and V as flat slots: [num_blocks * block_size, kv_heads, d]."""
        return self._plane_views(loop, layer)[:2]

    def block_plane(self, loop: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Loop `loop` (1-based) and layer's K and V by block: [num_blocks + 1, block_size, kv_heads, d]."""
        return self._plane_views(loop, layer)[2:]

    def write(self, loop: int, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [rows] flat slot ids; k, v: [rows, kv_heads, head_dim]
        k_plane, v_plane = self.plane(loop, layer)
        k_plane.index_copy_(0, slots, k.to(k_plane.dtype))
        v_plane.index_copy_(0, slots, v.to(v_plane.dtype))

    def slots_for(self, block_ids: tuple[int, ...] | list[int], positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ids of `positions` (a [rows] long tensor) under one request's block table."""
        table = to_device(list(block_ids), torch.long, positions.device)  # queued: no wait for the device
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def read(self, loop: int, layer: int, block_ids: tuple[int, ...] | list[int],
             length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..length-1 of one request's plane: two [length, kv_heads, head_dim] tensors."""
        k_plane, v_plane = self.plane(loop, layer)
        positions = torch.arange(length, device=k_plane.device)
        slots = self.slots_for(block_ids, positions)
        return k_plane[slots], v_plane[slots]
