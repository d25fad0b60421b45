"""SchedulerConfig: the scheduler's limits and the looped model's shape (torch-free, frozen).

This module owns the rules of the settings the scheduler and the facade share (mode and kv_allocation
through CHOICES, shallow_loops, deep_interval, block_size, num_kv_blocks, max_num_batched_tokens,
kv_watermark, enable_prefix_caching): one check per rule, below. SchedulerConfig runs them on
construction and ourobatch.EngineConfig calls the same functions (the torch-free layer owns the rule, the
facade, which checks first, reuses it), so a bad value gets the same message whichever way it comes in;
only the owner named in front differs (``EngineConfig.mode ...`` / ``SchedulerConfig.mode ...``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .kv_manager import KV_ALLOCATIONS

Mode = Literal["deferred", "eager", "verify"]
MODES: tuple[str, ...] = ("deferred", "eager", "verify")
#: The allowed values of the str settings the scheduler reads (EngineConfig's CHOICES holds these too).
CHOICES: dict[str, tuple[str, ...]] = {"mode": MODES, "kv_allocation": KV_ALLOCATIONS}


def check_int(owner: str, name: str, value: object, low: int = 1) -> None:
    """An int (not a bool) >= `low`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{owner}.{name} must be >= {low}, got {value}")


def check_choice(owner: str, name: str, value: object, allowed: tuple[object, ...]) -> None:
    """One of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {allowed}, got {value!r}")


def check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be True or False, got {value!r}")


def check_shallow_loops(owner: str, shallow_loops: object, total_ut_steps: int | None = None) -> None:
    """1 <= s <= T - 1; the upper bound only where T (the checkpoint's total_ut_steps) is known."""
    if isinstance(shallow_loops, bool) or not isinstance(shallow_loops, int):
        raise TypeError(f"{owner}.shallow_loops must be an int, got {type(shallow_loops).__name__} "
                        f"{shallow_loops!r}")
    rule = f"{owner}.shallow_loops must satisfy 1 <= shallow_loops <="
    if shallow_loops < 1:
        raise ValueError(f"{rule} total_ut_steps - 1, got {shallow_loops}")
    if total_ut_steps is not None and shallow_loops > total_ut_steps - 1:
        raise ValueError(f"{rule} {total_ut_steps - 1} (total_ut_steps - 1; this checkpoint's total_ut_steps is "
                         f"{total_ut_steps}), got {shallow_loops}")


def check_deep_interval(owner: str, deep_interval: object) -> None:
    check_int(owner, "deep_interval", deep_interval)


def check_block_size(owner: str, block_size: object) -> None:
    check_int(owner, "block_size", block_size)


def check_num_kv_blocks(owner: str, num_kv_blocks: object) -> None:
    check_int(owner, "num_kv_blocks", num_kv_blocks)


def check_max_num_batched_tokens(owner: str, max_num_batched_tokens: int, block_size: int) -> None:
    """>= block_size: a chunk that is not a prompt's last is whole blocks (prefill.py)."""
    check_int(owner, "max_num_batched_tokens", max_num_batched_tokens)
    if max_num_batched_tokens < block_size:
        raise ValueError(f"{owner}.max_num_batched_tokens must be >= block_size ({block_size}): a step prefills "
                         f"at least one whole block, got {max_num_batched_tokens}")


def check_max_prefill_tokens_while_decoding(owner: str, value: object, block_size: int) -> None:
    """None, or an int >= block_size: a step that prefills computes at least one whole block (prefill.py)."""
    if value is None:
        return
    check_int(owner, "max_prefill_tokens_while_decoding", value)
    if value < block_size:
        raise ValueError(f"{owner}.max_prefill_tokens_while_decoding must be None or >= block_size ({block_size}): "
                         f"a step prefills at least one whole block, got {value}")


def check_kv_watermark(owner: str, kv_watermark: object) -> None:
    if (isinstance(kv_watermark, bool) or not isinstance(kv_watermark, (int, float))
            or not 0 <= kv_watermark < 1):
        raise ValueError(f"{owner}.kv_watermark must be a number in [0, 1), got {kv_watermark!r}")


def check_enable_prefix_caching(owner: str, enable_prefix_caching: object) -> None:
    check_bool(owner, "enable_prefix_caching", enable_prefix_caching)


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
    # "lazy": blocks as positions are written, preempt when dry; "reserve": all at admission
    kv_allocation: str = "lazy"
    enable_prefix_caching: bool = True  # keep computed prompt blocks for later requests with the same prefix
    kv_watermark: float = 0.01  # lazy: share of the pool kept free at admission, so decode rarely runs dry
    # most prompt tokens a step prefills while requests are decoding (None: only max_num_batched_tokens
    # bounds them): a step that prefills then stays near a decode step (serve's default; prefill.py)
    max_prefill_tokens_while_decoding: int | None = None

    def __post_init__(self) -> None:
        owner = "SchedulerConfig"
        check_num_kv_blocks(owner, self.num_kv_blocks)
        check_block_size(owner, self.block_size)
        check_max_num_batched_tokens(owner, self.max_num_batched_tokens, self.block_size)
        check_shallow_loops(owner, self.shallow_loops, self.total_ut_steps)
        check_deep_interval(owner, self.deep_interval)
        for name, allowed in CHOICES.items():
            check_choice(owner, name, getattr(self, name), allowed)
        check_enable_prefix_caching(owner, self.enable_prefix_caching)
        check_kv_watermark(owner, self.kv_watermark)
        check_max_prefill_tokens_while_decoding(owner, self.max_prefill_tokens_while_decoding, self.block_size)
