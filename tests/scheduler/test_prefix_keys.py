"""Prefix-cache keys (block_manager.prefix_block_keys): a request shares a block only when the tokens of
the block and of everything before it are equal, and only under the weight version that computed it.

The checker below follows the KV, not the keys: it records, for every slot of every block, the token
prefix whose KV the executor wrote there, and checks that every position a prefill takes as shared holds
the KV of exactly that request's own tokens up to it."""

from __future__ import annotations

import random

import pytest

from scheduler import SamplingParams, block_manager

from .conftest import check_block_refs, make_scheduler
from .fakes import FakeExecutor


def params(max_tokens: int, seed: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)


class ContentChecker(FakeExecutor):
    """The fake executor, plus the KV it would have written: slot -> the tokens 0..p whose KV it holds."""

    def __init__(self, sched, **kw) -> None:
        super().__init__(**kw)
        self.sched = sched
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> token prefix
        self.starts: dict[str, list[int]] = {}  # request -> the start of each of its prefill works

    def _slot(self, block_ids, position):
        bs = self.sched.config.block_size
        return block_ids[position // bs], position % bs

    def _write(self, block_ids, position, token):
        before = self.kv[self._slot(block_ids, position - 1)] if position else ()
        self.kv[self._slot(block_ids, position)] = before + (token,)

    def execute(self, plan):
        for w in plan.prefills:
            r = self.sched.requests[w.request_id]
            tokens = r.prompt_token_ids + tuple(r.output_token_ids)
            for p in range(w.start_position):  # shared: every slot must hold this request's own prefix
                got = self.kv.get(self._slot(w.block_ids, p))
                assert got == tokens[:p + 1], f"{w.request_id} shares position {p} holding the KV of {got}"
            for i, token in enumerate(w.token_ids):
                self._write(w.block_ids, w.start_position + i, token)
            self.starts.setdefault(w.request_id, []).append(w.start_position)
        for w in plan.shallow:
            self._write(w.block_ids, w.position, w.token_id)
        return super().execute(plan)


def run(sched, ex, requests) -> None:
    """Add `requests` (rid, prompt, params) and step until nothing is left."""
    for rid, prompt, p in requests:
        sched.add(rid, prompt, p)
    while sched.has_unfinished:
        plan = sched.schedule()
        sched.update(plan, ex.execute(plan))
        check_block_refs(sched)


def collide_every_chain(monkeypatch) -> None:
    """The old scheme chained a block's key to its parent through the builtin 64-bit hash(); make every
    such hash collide (a key function that no longer calls hash() is unaffected)."""
    monkeypatch.setattr(block_manager, "hash", lambda key: 0, raising=False)


def test_a_parent_hash_collision_never_shares_another_prompts_kv(monkeypatch):
    collide_every_chain(monkeypatch)
    sched = make_scheduler(block_size=4)
    ex = ContentChecker(sched)
    a = [1, 1, 1, 1, 5, 5, 5, 5, 9]
    b = [2, 2, 2, 2, 6, 6, 6, 6, 9]
    c = [2, 2, 2, 2, 5, 5, 5, 5, 7]  # b's first block, then a's second block after a different first block
    run(sched, ex, [("a", a, params(3))])
    run(sched, ex, [("b", b, params(3))])
    run(sched, ex, [("c", c, params(3))])
    assert ex.starts["c"] == [4]  # b's first block only: a's second block holds the KV of a's prefix


def test_chained_keys_differ_for_every_different_prefix(monkeypatch):
    collide_every_chain(monkeypatch)
    prompts = [[a, b, x, y] for a in range(3) for b in range(3) for x in range(3) for y in range(3)]
    second = {tuple(p): block_manager.prefix_block_keys(p, 2)[1] for p in prompts}
    assert len(set(second.values())) == len(prompts)


@pytest.mark.parametrize("collide", [False, True], ids=["hash", "colliding-hash"])
def test_random_prompts_share_only_equal_prefixes(monkeypatch, collide):
    """Few distinct blocks, many prompts: lots of sharing, and every shared slot holds the right KV."""
    if collide:
        collide_every_chain(monkeypatch)
    rng = random.Random(11)
    sched = make_scheduler(num_kv_blocks=48, block_size=2, max_num_seqs=8, max_num_batched_tokens=6)
    ex = ContentChecker(sched)
    blocks = [(1, 2), (2, 1), (3, 3)]
    for i in range(150):
        prompt = [t for _ in range(rng.randint(1, 6)) for t in rng.choice(blocks)] + [rng.randint(1, 9)] * (i % 2)
        sched.add(f"q{i}", prompt, params(rng.randint(1, 6), seed=i))
        for _ in range(rng.randint(0, 3)):
            plan = sched.schedule()
            sched.update(plan, ex.execute(plan))
            check_block_refs(sched)
    run(sched, ex, [])
    assert sched.stats()["prefix_cache_hits"] > 0 and sched.blocks.num_used == 0


def test_a_block_cached_under_one_weight_version_is_not_hit_under_another():
    sched = make_scheduler(block_size=4)
    ex = ContentChecker(sched)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    run(sched, ex, [("a", prompt, params(2))])
    assert sched.blocks.num_cached == 3
    sched.weight_version = 1  # what the front end does on a weight update, here without reset_prefix_cache
    run(sched, ex, [("b", prompt, params(2))])
    assert ex.starts["b"] == [0] and sched.stats()["prefix_cache_hits"] == 0
    run(sched, ex, [("c", prompt, params(2))])
    assert ex.starts["c"] == [12]  # b's blocks, cached under version 1


def test_a_prefill_under_way_across_a_version_change_leaves_no_hybrid_block():
    """Chunks computed after the version changed sit on a prefix computed before it: under no version are
    they that prefix's KV, so they are never registered (only the chunk wholly computed before is)."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=4)
    ex = ContentChecker(sched)
    prompt = list(range(1, 14))
    sched.add("a", prompt, params(2))
    plan = sched.schedule()
    sched.update(plan, ex.execute(plan))
    assert ex.starts["a"] == [0]
    sched.weight_version = 1
    run(sched, ex, [])
    assert ex.starts["a"] == [0, 4, 8, 12]
    run(sched, ex, [("b", prompt, params(2))])
    assert ex.starts["b"][0] == 0  # version 1: nothing cached
    sched.weight_version = 0
    run(sched, ex, [("c", prompt, params(2))])
    assert ex.starts["c"][0] == 4  # version 0: only a's first chunk
