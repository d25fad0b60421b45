"""SchedulerConfig: the scheduler's limits and the looped model's shape (torch-free, frozen)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["deferred", "eager", "verify"]
MODES: tuple[str, ...] = ("deferred", "eager", "verify")


@dataclass(frozen=True)
class SchedulerConfig:
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int  # per step: decode rows + prefill tokens (prefill.py); >= block_size
    total_ut_steps: int  # T
    shallow_loops: int  # s
    deep_interval: int  # B
    mode: str
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()
    kv_allocation: str = "lazy"  # "lazy": blocks as positions are written, preempt when dry; "reserve": all at admission
    enable_prefix_caching: bool = True  # keep computed prompt blocks for later requests with the same prefix
    kv_watermark: float = 0.01  # lazy: share of the pool kept free at admission, so decode rarely runs dry
