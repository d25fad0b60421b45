"""What the collector hands out: Sample, Group, Batch (plain data), and ready-made group filters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass
class Sample:
    """One completion of a task, with everything the learner's replay needs
    (``ourobatch.training.readout_logprobs(model, prompt + tokens, readout_loops)``)."""

    index: int  # within its group, 0..n-1
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each token, as drawn (the engine's logprobs_mode)
    readout_loops: list[int]  # the loop each token was read from
    weight_versions: list[int]  # the weight version each token was drawn under
    finish_reason: str  # "stop" | "length" (an aborted sample is resubmitted or its group dropped)
    weight_version: int  # the version it was admitted under (no tokens: its only version)
    reward: float | None = None
    num_restarts: int = 0  # times it was resubmitted from scratch (on_update="abort")
    round_starts: list[int] = field(default_factory=lambda: [0])  # token index where each round began
    # (max_tokens_per_round: a later round continued prompt + earlier tokens, prefilled under newer weights)

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions, default=self.weight_version)

    @property
    def num_rounds(self) -> int:
        return len(self.round_starts)

    @property
    def is_mixed(self) -> bool:
        """Its tokens came from more than one weight version (on_update="continue" / "recompute")."""
        return len(set(self.weight_versions)) > 1


@dataclass
class Group:
    """The n samples of one task (GRPO's group)."""

    task: Any  # the task as the iterable gave it (a dict passes through to the reward)
    task_index: int  # position in the task iterable (requeued tasks keep theirs)
    samples: list[Sample] = field(default_factory=list)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    @property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


@dataclass
class Batch:
    """groups_per_batch complete groups (the last batch may hold fewer), in the order they completed."""

    index: int
    groups: list[Group]
    weight_version: int  # the version current when the batch was handed over

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.groups)


def keep_varied_rewards(group: Group) -> bool:
    """DAPO's dynamic sampling: drop a group whose rewards are all equal (its advantages are all zero)."""
    rewards = group.rewards
    return any(r != rewards[0] for r in rewards[1:])


def prompt_of(task: Any) -> list[int]:
    """A task's prompt: the task itself (a list of token ids) or its ``prompt_token_ids``."""
    prompt = task.get("prompt_token_ids") if isinstance(task, Mapping) else task
    if prompt is None:
        raise ValueError("a task given as a dict needs a 'prompt_token_ids' key (a list of token ids)")
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"a task must be a list of prompt token ids or a dict with 'prompt_token_ids', got "
                        f"{type(prompt).__name__}")
    return list(prompt)
