"""HashedBlockIndex specs, a hypothesis model check, and radix >= hashed."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.hashed import HashedBlockIndex
from shared.engine.kv.radix import RadixTree

from .test_radix import BS, CacheMachine, admit, blocks_slots, cache_sequence, finish


def hashed_content(idx: HashedBlockIndex) -> dict[tuple[int, ...], int]:
    """Every cached full-block prefix -> the slot of its last token."""
    out: dict[tuple[int, ...], int] = {}
    for entry in idx._by_block.values():
        prefix: tuple[int, ...] = ()
        e = entry
        while e is not None:
            prefix = e.tokens + prefix
            e = e.parent
        out[prefix] = entry.block_id * BS + BS - 1
    return out


def test_two_requests_share_two_full_blocks():
    pool = BlockPool(11, BS)
    idx = HashedBlockIndex(pool)
    prompt = list(range(10))  # blocks [0..3] [4..7] | partial [8, 9]
    a = admit(idx, pool, prompt)
    assert a.block_table == [1, 2, 3]
    assert idx.num_cached_blocks == 2  # the partial block is never cached
    b = admit(idx, pool, list(range(8)) + [20, 21, 22])
    assert b.block_table == [1, 2, 4]
    m = idx.match(list(range(12)))
    assert (m.num_tokens, m.slots, m.handle) == (8, tuple(blocks_slots(1, 2)), (1, 2))
    assert [pool.ref_count(x) for x in (1, 2, 3, 4)] == [3, 3, 1, 1]
    finish(idx, pool, a)
    finish(idx, pool, b)
    assert [pool.ref_count(x) for x in (1, 2, 3, 4)] == [1, 1, 0, 0]
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 10, 3, 4]
    idx.check_integrity()


def test_match_stops_at_the_first_miss_and_counts_whole_blocks():
    pool = BlockPool(11, BS)
    idx = HashedBlockIndex(pool)
    cache_sequence(idx, pool, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])  # blocks 1, 2, 3
    assert idx.match([1, 1, 1, 1, 2, 2, 2]).num_tokens == 4  # block 2 not whole in the query
    assert idx.match([1, 1, 1, 1, 9, 9, 9, 9, 3, 3, 3, 3]).num_tokens == 4
    assert idx.match([2, 2, 2, 2]).num_tokens == 0  # same tokens, other position in the chain
    assert idx.match([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]).handle == (1, 2, 3)
    idx.check_integrity()


def test_eviction_is_lru_tail_first_with_exact_block_ids():
    pool = BlockPool(11, BS)
    idx = HashedBlockIndex(pool)
    cache_sequence(idx, pool, [1] * 8)  # blocks 1, 2
    cache_sequence(idx, pool, [2] * 4)  # block 3
    cache_sequence(idx, pool, [3] * 4)  # block 4
    idx.match([1] * 8)  # touches 2 then 1: [1]*8 is the most recent chain
    assert idx.evict(1) == 1
    assert pool.free_block_ids()[-1] == 3
    assert idx.evict(2) == 2
    assert pool.free_block_ids()[-2:] == [4, 2]  # the chain's tail goes before its head
    assert idx.evict(5) == 1 and pool.num_used == 0
    idx.check_integrity()


def test_evict_skips_locked_and_request_held_blocks():
    pool = BlockPool(11, BS)
    idx = HashedBlockIndex(pool)
    cache_sequence(idx, pool, [1] * 4)  # block 1
    cache_sequence(idx, pool, [2] * 4)  # block 2
    req = admit(idx, pool, [3] * 5)  # blocks 3 (cached), 4; the request holds both
    m = idx.match([1] * 4)
    idx.lock(m.handle)
    assert idx.evict(10) == 1  # only block 2
    assert idx.match([1] * 4).num_tokens == idx.match([3] * 4).num_tokens == 4
    idx.unlock(m.handle)
    finish(idx, pool, req)
    assert idx.evict(10) == 2 and pool.num_used == 0
    idx.check_integrity()


def test_evicting_a_parent_drops_its_unreachable_descendants():
    pool = BlockPool(11, BS)
    idx = HashedBlockIndex(pool)
    r2 = admit(idx, pool, [1] * 4)  # block 1
    r1_blocks = pool.allocate(2)  # r1 computed [1]*4 concurrently, into its own block 2
    idx.insert([1] * 4 + [2] * 4, blocks_slots(*r1_blocks))  # keeps block 1; caches block 3
    assert r1_blocks == [2, 3] and idx.match([1] * 4 + [2] * 4).handle == (1, 3)
    finish(idx, pool, r2)
    assert [pool.ref_count(x) for x in (1, 2, 3)] == [1, 1, 2]
    assert idx.evict(1) == 1  # block 1 (held by the index only); block 3 became unreachable
    assert idx.num_cached_blocks == 0 and pool.ref_count(3) == 1  # r1's ref only
    pool.decref(r1_blocks)
    assert pool.num_used == 0
    idx.check_integrity()


def test_a_hash_collision_never_returns_wrong_kv():
    pool = BlockPool(11, BS)
    idx = HashedBlockIndex(pool, hash_fn=lambda parent, tokens: b"same")
    cache_sequence(idx, pool, [1, 2, 3, 4])  # block 1 owns the only hash
    cache_sequence(idx, pool, [5, 6, 7, 8])  # collides: not cached, block 2 freed
    assert idx.match([5, 6, 7, 8]).num_tokens == 0
    assert idx.match([1, 2, 3, 4, 1, 2, 3, 4]).num_tokens == 4  # child collides with parent
    assert idx.num_cached_blocks == 1 and pool.num_used == 1
    idx.check_integrity()


def test_insert_stops_at_a_block_that_is_not_one_physical_block():
    pool = BlockPool(11, BS)
    idx = HashedBlockIndex(pool)
    a, b = pool.allocate(2)
    slots = blocks_slots(a) + blocks_slots(b, n=2) + blocks_slots(a, n=4)[2:]  # block 1 mixed
    handle = idx.insert(list(range(12)), slots + blocks_slots(b)[:4])
    assert handle == (a,) and idx.num_cached_tokens == 4
    pool.decref([a, b])
    idx.check_integrity()


class HashedMachine(CacheMachine):
    def make_index(self, pool):
        return HashedBlockIndex(pool)

    def content(self):
        return hashed_content(self.idx)

    STEP = BS

    def assert_nothing_evictable(self):
        for block_id, entry in self.idx._by_block.items():
            assert entry.lock_count > 0 or self.pool.ref_count(block_id) > 1


TestHashedModel = HashedMachine.TestCase
TestHashedModel.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _both(sequences):
    radix_pool, hashed_pool = BlockPool(64, BS), BlockPool(64, BS)
    radix, hashed = RadixTree(radix_pool), HashedBlockIndex(hashed_pool)
    for tokens in sequences:
        cache_sequence(radix, radix_pool, tokens)
        cache_sequence(hashed, hashed_pool, tokens)
    return radix, hashed


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), max_size=5),
    st.lists(st.integers(0, 2), max_size=14),
)
def test_radix_matches_at_least_as_much_as_hashed(sequences, query):
    radix, hashed = _both(sequences)
    r, h = radix.match(query), hashed.match(query)
    assert r.num_tokens >= h.num_tokens
    assert h.num_tokens == r.num_tokens // BS * BS  # hashed = the radix hit, whole blocks
    radix.check_integrity()
    hashed.check_integrity()


def test_radix_beats_hashed_when_the_shared_prefix_ends_mid_block():
    radix, hashed = _both([[1, 2, 3, 4, 5, 6, 7]])
    query = [1, 2, 3, 4, 5, 6, 9, 9]
    assert (radix.match(query).num_tokens, hashed.match(query).num_tokens) == (6, 4)
    assert radix.match([1, 2, 3]).num_tokens == 3 and hashed.match([1, 2, 3]).num_tokens == 0
