"""BlockPool specs: 11 blocks of 4 tokens, exact block ids and free order."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.engine.kv.block_pool import NULL_BLOCK, BlockPool, OutOfBlocks


def test_allocate_pops_front_and_skips_null_block():
    pool = BlockPool(num_blocks=11, block_size=4)
    assert (pool.num_free, pool.num_used) == (10, 0)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    assert (pool.num_free, pool.num_used) == (5, 5)
    assert all(pool.ref_count(b) == 1 for b in [1, 2, 3, 4, 5])
    assert pool.ref_count(NULL_BLOCK) == 0
    pool.check_integrity()


def test_freed_blocks_go_to_the_back_in_the_order_given():
    pool = BlockPool(11, 4)
    pool.allocate(5)  # [1..5]
    assert pool.decref([3, 1]) == [3, 1]
    assert pool.free_block_ids() == [6, 7, 8, 9, 10, 3, 1]
    assert pool.allocate(6) == [6, 7, 8, 9, 10, 3]
    pool.check_integrity()


def test_shared_block_is_freed_by_its_last_ref():
    pool = BlockPool(11, 4)
    a = pool.allocate(2)  # request A: [1, 2]
    pool.incref(a)  # request B shares both
    assert pool.decref(a) == []
    assert pool.num_used == 2
    assert pool.decref(reversed(a)) == [2, 1]  # tail first
    assert pool.free_block_ids()[-2:] == [2, 1]
    pool.check_integrity()


def test_out_of_blocks_leaves_the_pool_unchanged():
    pool = BlockPool(11, 4)
    pool.allocate(8)
    before = pool.free_block_ids()
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    assert pool.free_block_ids() == before == [9, 10]
    assert pool.allocate(2) == [9, 10]
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_double_free_and_incref_of_free_block_assert():
    pool = BlockPool(11, 4)
    (b,) = pool.allocate(1)
    pool.decref([b])
    with pytest.raises(AssertionError):
        pool.decref([b])
    with pytest.raises(AssertionError):
        pool.incref([b])
    with pytest.raises(AssertionError):
        pool.incref([NULL_BLOCK])


@pytest.mark.parametrize("num_blocks, block_size", [(1, 4), (0, 4), (4, 0)])
def test_bad_sizes_raise(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 4))))
def test_pool_matches_a_naive_ref_count_model(ops):
    pool = BlockPool(9, 2)
    refs: dict[int, int] = {}
    free = list(range(1, 9))
    held: list[int] = []  # one entry per ref held
    for op, n in ops:
        if op == "alloc":
            if n > len(free):
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
                continue
            got, free = free[:n], free[n:]
            assert pool.allocate(n) == got
            held += got
            refs.update({b: 1 for b in got})
        elif op == "share" and held:
            b = held[n % len(held)]
            pool.incref([b])
            held.append(b)
            refs[b] += 1
        elif op == "free" and held:
            b = held.pop(n % len(held))
            refs[b] -= 1
            expected = [b] if refs[b] == 0 else []
            free += expected
            assert pool.decref([b]) == expected
        assert pool.free_block_ids() == free
        pool.check_integrity()
