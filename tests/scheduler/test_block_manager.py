import itertools
import random

import pytest

from scheduler import BlockManager


def test_blocks_for_rounds_up():
    bm = BlockManager(10, 4)
    assert [bm.blocks_for(n) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


@pytest.mark.parametrize("num_blocks", [1, 2, 5])
def test_can_allocate_matches_allocate_exhaustively(num_blocks):
    # Every sequence of up to 4 allocate/free operations on a tiny pool.
    ops = [("alloc", k) for k in range(num_blocks + 2)] + [("free", i) for i in range(3)]
    for seq in itertools.product(ops, repeat=3):
        bm = BlockManager(num_blocks, 2)
        held: list[tuple[int, ...]] = []
        for op, arg in seq:
            if op == "alloc":
                ok = bm.can_allocate(arg)
                assert ok == (arg <= bm.num_free)
                if ok:
                    ids = bm.allocate(arg)
                    assert len(ids) == arg and len(set(ids)) == arg
                    held.append(ids)
            elif arg < len(held):
                bm.free(held.pop(arg))
            in_use = [b for ids in held for b in ids]
            assert len(in_use) == len(set(in_use)) == bm.num_used
            assert bm.num_used + bm.num_free == num_blocks


def test_double_free_is_caught():
    bm = BlockManager(4, 2)
    ids = bm.allocate(2)
    bm.free(ids)
    with pytest.raises(AssertionError):
        bm.free(ids)


def test_random_churn_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(64, 16)
    held = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            bm.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 8)
            if bm.can_allocate(n):
                held.append(bm.allocate(n))
    for ids in held:
        bm.free(ids)
    assert bm.num_used == 0 and bm.num_free == 64


@pytest.mark.parametrize("bad", [dict(num_blocks=0, block_size=4), dict(num_blocks=4, block_size=0)])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        BlockManager(**bad)


# ---------------------------------------------------------------- reference counts and the prefix cache

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from scheduler.block_manager import prefix_block_keys  # noqa: E402


def test_prefix_keys_chain_the_whole_prefix():
    a = prefix_block_keys([1, 2, 3, 4, 5, 6, 7], 2)
    b = prefix_block_keys([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3 and all(isinstance(k, bytes) and len(k) == 32 for k in a + b)
    assert a[1] != b[1] and a[2] != b[2]  # same tokens in blocks 1 and 2, different prefixes: different keys
    assert prefix_block_keys([1, 2, 3, 4], 2) == a[:2]
    assert prefix_block_keys([1, 2, 3, 4], 2, weight_version=1)[0] != a[0]  # salted with the weights
    assert prefix_block_keys([1, 2, 3, 4], 4) != prefix_block_keys([1, 2, 3, 4], 2)[1:]


def test_a_freed_registered_block_is_found_again_and_evicted_last_resort():
    bm = BlockManager(4, 2)
    keys = prefix_block_keys([1, 2, 3, 4], 2)
    held = bm.allocate(2)
    for key, block in zip(keys, held):
        bm.register(key, block)
    bm.free(held)
    assert bm.num_used == 0 and bm.num_free == 4 and bm.num_cached == 2
    assert bm.lookup(keys) == list(held)
    other = bm.allocate(2)  # plain free blocks first: the cached ones survive
    assert set(other).isdisjoint(held) and bm.lookup(keys) == list(held)
    bm.share(held)
    assert bm.num_used == 4 and bm.num_free == 0
    bm.free(held)
    bm.free(other)
    evicted = bm.allocate(3)  # two plain, then the least recently freed cached block: the chain's tail
    assert bm.lookup(keys) == [held[0]] and held[1] in evicted
    assert bm.reset_prefix_cache() == 1 and bm.num_cached == 0 and bm.num_free == 1


class BlockMachine(RuleBasedStateMachine):
    """Random allocate / share / free / register / lookup / reset against a plain model of the holders."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, 2)
        self.holdings: list[tuple[int, ...]] = []  # each: one holder's blocks
        self.keys = {}  # key -> block we registered and believe cached (may have been evicted)

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        if not self.bm.can_allocate(n):
            assert n > self.bm.num_free
            return
        held_now = {b for h in self.holdings for b in h}
        cached, evicts = self.bm.num_cached, max(0, n - self.bm.num_uncached_free)
        assert self.bm.num_uncached_free + self.bm.num_evictable == self.bm.num_free
        ids = self.bm.allocate(n)
        assert len(set(ids)) == n and held_now.isdisjoint(ids), "a held block was handed out"
        assert self.bm.num_cached == cached - evicts, "evicted a cached prefix while plain free blocks were left"
        self.holdings.append(ids)

    @precondition(lambda self: self.holdings)
    @rule(data=st.data())
    def share(self, data):
        h = data.draw(st.sampled_from(self.holdings))
        self.bm.share(h)
        self.holdings.append(h)

    @rule(data=st.data())
    def share_cached(self, data):
        if not self.keys:
            return
        key = data.draw(st.sampled_from(sorted(self.keys, key=repr)))
        hits = self.bm.lookup([key])
        if hits:
            self.bm.share(hits)
            self.holdings.append(tuple(hits))

    @precondition(lambda self: self.holdings)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.holdings) - 1))
        self.bm.free(self.holdings.pop(i))

    @precondition(lambda self: self.holdings)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=2, max_size=2))
    def register(self, data, tokens):
        h = data.draw(st.sampled_from([h for h in self.holdings if h] or [()]))
        if not h:
            return
        (key,) = prefix_block_keys(tokens, 2)
        self.bm.register(key, h[0])
        self.keys.setdefault(key, h[0])

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()
        self.keys.clear()
        assert self.bm.num_cached == 0

    @invariant()
    def refcounts_match_holders(self):
        counts: dict[int, int] = {}
        for h in self.holdings:
            for b in h:
                counts[b] = counts.get(b, 0) + 1
        for b in range(self.bm.num_blocks):
            assert self.bm.ref_count(b) == counts.get(b, 0)
        assert self.bm.num_used == len(counts)
        assert self.bm.num_used + self.bm.num_free == self.bm.num_blocks
        assert self.bm.num_cached <= self.bm.num_blocks

    def teardown(self):
        for h in self.holdings:
            self.bm.free(h)
        assert self.bm.num_used == 0 and self.bm.num_free == self.bm.num_blocks
        self.bm.reset_prefix_cache()
        assert self.bm.num_cached == 0


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True,
                                     suppress_health_check=[HealthCheck.too_slow])
