import itertools
import random

import pytest

from ourobatch.scheduler import BlockManager


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
