"""The Collector's options: each checked once, with a message naming the option and the allowed values."""

from __future__ import annotations

from scheduler.params import SamplingParams

ON_UPDATE = ("continue", "recompute", "abort")
SURPLUS = ("carry", "abort")
ON_REWARD_ERROR = ("drop", "raise")


def positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value  # type: ignore[return-value]


def non_negative_or_none(name: str, value: object, meaning: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be an int >= 0{meaning}, got {value!r}")
    return value  # type: ignore[return-value]


def sample_params(params: SamplingParams | dict | None) -> SamplingParams:
    p = SamplingParams.coerce(params)
    if p.n != 1:
        raise ValueError(f"SamplingParams.n={p.n}: give the group size as Collector(n=...), and params with n=1")
    return p  # each sample is one generate() (FINAL_ONLY): it wakes its task only when it ends


def rounds(max_tokens_per_round: object, max_staleness: int | None) -> int | None:
    """Partial rollouts carry tokens across an update, which max_staleness=0 forbids."""
    if max_tokens_per_round is None:
        return None
    k = positive("max_tokens_per_round", max_tokens_per_round)
    if max_staleness == 0:
        raise ValueError("max_tokens_per_round needs max_staleness >= 1 or None: a paused sample continues after "
                         "the next update, so its group would always be over max_staleness=0 and regenerated")
    return k
