"""Which replica serves a new request? Least outstanding work, with prompt-prefix affinity. Pure Python.

Load is the work a replica still owes: for every request in flight there, n x max_tokens less the tokens
already seen (an upper bound: a request may stop early). A new request goes to the ready replica with
the least load (ties: the lowest index).

Affinity: requests whose prompts share their first `affinity_tokens` tokens (block-aligned, so they share
whole KV blocks) go to the replica the first of them went to, so the prefix cache and the shared prompt
blocks pay off. Affinity yields to balance: when that replica's load exceeds the least load by more
than `affinity_slack_tokens`, the request goes to the least loaded replica instead (and the prefix keeps
its home). The n samples of one request are one Engine request, so they always stay together.
"""

from __future__ import annotations

import collections
from typing import Sequence

DEFAULT_AFFINITY_BLOCKS = 4  # prefix key: the first 4 KV blocks of a prompt (fewer when it is shorter)
MAX_AFFINITY_KEYS = 65536  # prefix homes remembered (least recently used are forgotten)


class Router:
    """Chooses a replica per request. Not thread-safe: the pool calls it from its event loop."""

    def __init__(self, num_replicas: int, block_size: int, affinity_tokens: int | None = None,
                 affinity_slack_tokens: int = 8192, max_keys: int = MAX_AFFINITY_KEYS) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if affinity_tokens is None:
            affinity_tokens = DEFAULT_AFFINITY_BLOCKS * block_size
        if isinstance(affinity_tokens, bool) or not isinstance(affinity_tokens, int) or affinity_tokens < 0:
            raise ValueError(f"affinity_tokens must be an int >= 0 (0 turns prefix affinity off), got "
                             f"{affinity_tokens!r}")
        if (isinstance(affinity_slack_tokens, bool) or not isinstance(affinity_slack_tokens, int)
                or affinity_slack_tokens < 0):
            raise ValueError(f"affinity_slack_tokens must be an int >= 0, got {affinity_slack_tokens!r}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.affinity_tokens = affinity_tokens
        self.affinity_slack_tokens = affinity_slack_tokens
        self._homes: collections.OrderedDict[int, int] = collections.OrderedDict()  # prefix key -> replica
        self._max_keys = max_keys

    def affinity_key(self, prompt_token_ids: Sequence[int]) -> int | None:
        """Hash of the prompt's first affinity_tokens tokens, cut to whole KV blocks; None when the prompt
        has no full block (nothing of it would be shared) or affinity is off."""
        length = min(self.affinity_tokens, len(prompt_token_ids)) // self.block_size * self.block_size
        if length == 0:
            return None
        return hash(tuple(prompt_token_ids[:length]))

    def choose(self, prompt_token_ids: Sequence[int], loads: Sequence[int | None]) -> int | None:
        """The replica for a new request; `loads[i]` is replica i's outstanding tokens, None when it is not
        ready. Returns None when no replica is ready."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"got {len(loads)} loads for {self.num_replicas} replicas")
        ready = [i for i, load in enumerate(loads) if load is not None]
        if not ready:
            return None
        least = min(ready, key=lambda i: (loads[i], i))
        key = self.affinity_key(prompt_token_ids)
        if key is None:
            return least
        home = self._homes.get(key)
        if home is not None and loads[home] is not None:
            self._homes.move_to_end(key)
            if loads[home] - loads[least] <= self.affinity_slack_tokens:  # type: ignore[operator]
                return home
            return least  # balance wins; the prefix keeps its home for when the load evens out
        self._homes[key] = least  # new prefix (or its home is down): it lives where it lands
        self._homes.move_to_end(key)
        while len(self._homes) > self._max_keys:
            self._homes.popitem(last=False)
        return least
