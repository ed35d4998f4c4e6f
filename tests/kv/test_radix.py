"""RadixTree specs (tiny numbers, exact block ids) and a hypothesis model check.

`CacheMachine` drives any PrefixCache through the KV manager's real flow (match, lock, share
full aligned blocks, copy the rest, insert, relock, finish) against a naive reference:
a dict from every cached token prefix to the slot of its last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.engine.kv.block_pool import BlockPool, OutOfBlocks
from shared.engine.kv.prefix_cache import PrefixCache
from shared.engine.kv.radix import RadixTree

BS = 4


def blocks_slots(*block_ids: int, n: int | None = None, bs: int = BS) -> list[int]:
    """Aligned slots of the given blocks, truncated to n tokens."""
    slots = [b * bs + i for b in block_ids for i in range(bs)]
    return slots if n is None else slots[:n]


def cache_sequence(idx: PrefixCache, pool: BlockPool, tokens: list[int]) -> list[int]:
    """Insert `tokens` on fresh blocks as a finished request would; returns its slots."""
    blocks = pool.allocate(-(-len(tokens) // pool.block_size))
    slots = blocks_slots(*blocks, n=len(tokens), bs=pool.block_size)
    idx.insert(tokens, slots)
    pool.decref(blocks)
    return slots


# ---- the request flow, as the KV manager runs it -------------------------------------------


@dataclass
class Req:
    tokens: list[int]
    block_table: list[int]
    handle: object


def _allocate(idx: PrefixCache, pool: BlockPool, n: int) -> list[int] | None:
    if n > pool.num_free:
        idx.evict(n - pool.num_free)
    try:
        return pool.allocate(n)
    except OutOfBlocks:
        return None


def _slots(block_table: list[int], num_tokens: int, bs: int) -> list[int]:
    return [block_table[p // bs] * bs + p % bs for p in range(num_tokens)]


def admit(idx: PrefixCache, pool: BlockPool, tokens: list[int]) -> Req | None:
    """Match, lock, share the full aligned blocks of the hit, copy the rest, insert."""
    bs = pool.block_size
    m = idx.match(tokens)
    idx.lock(m.handle)
    shared = []
    for k in range(m.num_tokens // bs):
        block_id = m.slots[k * bs] // bs
        if list(m.slots[k * bs : (k + 1) * bs]) != blocks_slots(block_id, bs=bs):
            break  # block k's tokens are not one physical block: copy from here on
        shared.append(block_id)
    new = _allocate(idx, pool, -(-len(tokens) // bs) - len(shared))
    if new is None:
        idx.unlock(m.handle)
        return None
    pool.incref(shared)
    table = shared + new
    handle = idx.insert(tokens, _slots(table, len(tokens), bs))
    idx.lock(handle)
    idx.unlock(m.handle)
    return Req(list(tokens), table, handle)


def extend(idx: PrefixCache, pool: BlockPool, req: Req, extra: list[int]) -> bool:
    """The request computed `extra` more tokens: grow its table, insert, move its lock."""
    bs = pool.block_size
    tokens = req.tokens + extra
    new = _allocate(idx, pool, -(-len(tokens) // bs) - len(req.block_table))
    if new is None:
        return False
    req.tokens, req.block_table = tokens, req.block_table + new
    handle = idx.insert(tokens, _slots(req.block_table, len(tokens), bs))
    idx.lock(handle)
    idx.unlock(req.handle)
    req.handle = handle
    return True


def finish(idx: PrefixCache, pool: BlockPool, req: Req) -> None:
    idx.unlock(req.handle)
    pool.decref(reversed(req.block_table))


# ---- model check ---------------------------------------------------------------------------


def radix_content(tree: RadixTree) -> dict[tuple[int, ...], int]:
    """Every cached token prefix -> the slot of its last token."""
    out: dict[tuple[int, ...], int] = {}
    stack = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for token, slot in zip(node.token_ids, node.slots):
            prefix = (*prefix, token)
            out[prefix] = slot
        stack.extend((child, prefix) for child in node.children.values())
    return out


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=12)


class CacheMachine(RuleBasedStateMachine):
    """Model check of a PrefixCache; subclasses say how to build and read the index.

    `ref` maps each cached prefix whose length is a multiple of STEP to the slot of its last
    token (the first inserter's); `content()` reads the same map out of the index.
    """

    NUM_BLOCKS = 25

    def make_index(self, pool: BlockPool) -> PrefixCache:
        raise NotImplementedError

    def content(self) -> dict[tuple[int, ...], int]:
        raise NotImplementedError

    STEP = 1  # cache granularity in tokens: reference keys are prefixes of STEP multiples

    def cacheable(self, n: int) -> int:
        """How many leading tokens of an n-token insert the index keeps."""
        return n // self.STEP * self.STEP

    def assert_nothing_evictable(self) -> None:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, BS)
        self.idx = self.make_index(self.pool)
        self._evict = self.idx.evict
        self.idx.evict = self._evict_and_resync  # the request flow evicts too
        self.ref: dict[tuple[int, ...], int] = {}
        self.running: list[Req] = []
        self.pinned: list[tuple[int, ...]] = []

    def _evict_and_resync(self, num_blocks: int) -> int:
        freed = self._evict(num_blocks)
        self._resync()
        return freed

    def _record(self, req: Req) -> None:
        """Reference insert: the first inserter's slot wins."""
        slots = _slots(req.block_table, len(req.tokens), BS)
        for p in range(self.STEP, self.cacheable(len(req.tokens)) + 1, self.STEP):
            self.ref.setdefault(tuple(req.tokens[:p]), slots[p - 1])

    def _resync(self) -> None:
        """Eviction may only drop cached prefixes, never locked or pinned ones."""
        content = self.content()
        for prefix, slot in content.items():
            assert self.ref.get(prefix) == slot, f"{prefix} at {slot}, ref {self.ref.get(prefix)}"
        for tokens in [tuple(r.tokens[: self.cacheable(len(r.tokens))]) for r in self.running]:
            assert not tokens or tokens in content, f"locked {tokens} was evicted"
        self.ref = content

    @precondition(lambda self: len(self.running) < 4)
    @rule(tokens=sequences)
    def start(self, tokens):
        req = admit(self.idx, self.pool, tokens)
        if req is not None:
            self.running.append(req)
            self._record(req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 3), extra=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def grow(self, i, extra):
        req = self.running[i % len(self.running)]
        if extend(self.idx, self.pool, req, extra):
            self._record(req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 3))
    def finish(self, i):
        finish(self.idx, self.pool, self.running.pop(i % len(self.running)))

    @rule(tokens=sequences)
    def match(self, tokens):
        m = self.idx.match(tokens)
        n, step = 0, self.STEP
        while n + step <= len(tokens) and tuple(tokens[: n + step]) in self.ref:
            n += step
        last_slots = [self.ref[tuple(tokens[:p])] for p in range(step, n + 1, step)]
        assert m.num_tokens == n
        assert list(m.slots) == [s for last in last_slots for s in range(last - step + 1, last + 1)]

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks):
        free_before = self.pool.num_free
        freed = self.idx.evict(num_blocks)
        assert freed == self.pool.num_free - free_before
        if freed < num_blocks:
            self.assert_nothing_evictable()
        for tokens in self.pinned:
            assert tokens in self.ref, f"pinned {tokens} was evicted"

    @invariant()
    def integrity(self):
        self.idx.check_integrity()
        assert self.content() == self.ref

    def teardown(self):
        while self.running:
            finish(self.idx, self.pool, self.running.pop())
        while self.pinned:
            self.idx.unpin(self.pinned.pop())  # type: ignore[attr-defined]
        self.idx.evict(self.NUM_BLOCKS)
        self.idx.check_integrity()
        assert self.idx.num_cached_tokens == 0
        assert self.pool.num_used == 0, "leaked block refs"


class RadixMachine(CacheMachine):
    def make_index(self, pool):
        return RadixTree(pool)

    def content(self):
        return radix_content(self.idx)

    def assert_nothing_evictable(self):
        assert not self.idx.evictable_leaves
        ends = {tuple(r.tokens) for r in self.running} | set(self.pinned)
        for prefix in self.ref:
            is_leaf = not any(len(p) == len(prefix) + 1 and p[:-1] == prefix for p in self.ref)
            assert not is_leaf or prefix in ends, f"unlocked leaf {prefix} survived"

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def pin(self, data):
        tokens = data.draw(st.sampled_from(sorted(self.ref)))
        self.idx.pin(tokens)
        self.pinned.append(tokens)

    @precondition(lambda self: self.pinned)
    @rule(i=st.integers(0, 3))
    def unpin(self, i):
        self.idx.unpin(self.pinned.pop(i % len(self.pinned)))


TestRadixModel = RadixMachine.TestCase
TestRadixModel.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- specs ---------------------------------------------------------------------------------


def test_match_is_token_exact_and_ends_mid_block():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    slots = cache_sequence(tree, pool, [1, 2, 3, 4, 5, 6])  # blocks 1, 2
    assert slots == blocks_slots(1, 2, n=6)
    m = tree.match([1, 2, 3, 4, 5, 9, 9])
    assert (m.num_tokens, m.slots) == (5, (4, 5, 6, 7, 8))
    assert tree.match([7]).num_tokens == 0
    assert tree.match([]).slots == ()
    assert [pool.ref_count(b) for b in (1, 2)] == [1, 1]  # the tree's refs only
    assert tree.num_nodes == 1  # match never splits
    tree.check_integrity()


def test_two_requests_sharing_a_prefix_then_exact_free_order():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    a = admit(tree, pool, [1, 2, 3, 4, 5, 6])  # blocks [1, 2]
    b = admit(tree, pool, [1, 2, 3, 4, 5, 7, 8])  # shares 1; copies token 5 into block 3
    assert (a.block_table, b.block_table) == ([1, 2], [1, 3])
    assert tree.match([1, 2, 3, 4, 5, 7, 8]).slots == (4, 5, 6, 7, 8, 13, 14)
    # split [1..5 | 6] inside block 2: both halves hold a ref to it
    assert [pool.ref_count(x) for x in (1, 2, 3)] == [3, 3, 2]
    assert tree.num_nodes == 3 and tree.num_cached_tokens == 8
    finish(tree, pool, a)
    finish(tree, pool, b)
    assert [pool.ref_count(x) for x in (1, 2, 3)] == [1, 2, 1]
    # LRU leaf [6] goes first but frees nothing (block 2 is still held by [1..5]); then [7, 8]
    assert tree.evict(1) == 1
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 3]
    assert tree.evict(10) == 2
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 1, 2]
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_eviction_is_lru_by_leaf_with_exact_block_ids():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    cache_sequence(tree, pool, [1] * 4)  # block 1
    cache_sequence(tree, pool, [2] * 4)  # block 2
    cache_sequence(tree, pool, [3] * 4)  # block 3
    tree.match([1] * 4)  # [1] is now the most recent
    assert tree.evict(1) == 1
    assert pool.free_block_ids()[-1] == 2
    assert tree.evict(2) == 2
    assert pool.free_block_ids()[-2:] == [3, 1]
    assert tree.evict(1) == 0
    tree.check_integrity()


def test_evicting_a_leaf_exposes_its_parent():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    cache_sequence(tree, pool, [1, 1, 1, 1, 2, 2, 2, 2])  # blocks 1, 2
    cache_sequence(tree, pool, [1, 1, 1, 1, 3, 3])  # blocks 3, 4: [1]*4 at block 1 kept
    assert pool.ref_count(3) == 0  # the duplicate prefix block went back on decref
    assert tree.evict(3) == 3  # [2]*4 (block 2), [3, 3] (block 4), then the parent (1)
    assert pool.free_block_ids()[-3:] == [2, 4, 1]
    assert tree.num_nodes == 0 and pool.num_used == 0
    tree.check_integrity()


def test_locked_and_pinned_entries_survive_eviction():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    cache_sequence(tree, pool, [1, 2, 3, 4, 5])  # blocks 1, 2
    cache_sequence(tree, pool, [7, 7])  # block 3
    cache_sequence(tree, pool, [8, 8, 8])  # block 4
    m = tree.match([1, 2, 3])
    tree.lock(m.handle)
    tree.pin([7, 7])
    assert tree.evict(10) == 1  # only [8, 8, 8]
    assert tree.match([1, 2, 3, 4, 5]).num_tokens == 5  # the whole locked node stays
    assert tree.match([7, 7]).num_tokens == 2
    tree.unlock(m.handle)
    tree.unpin([7, 7])
    assert tree.evict(10) == 3 and pool.num_used == 0
    tree.check_integrity()


def test_pin_splits_and_requires_a_cached_sequence():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    cache_sequence(tree, pool, [1, 2, 3, 4, 5, 6])  # blocks 1, 2
    with pytest.raises(ValueError):
        tree.pin([1, 2, 9])
    with pytest.raises(ValueError):
        tree.pin([1, 2, 3, 4, 5, 6, 7])
    tree.pin([1, 2])  # splits inside block 1
    assert tree.num_nodes == 2 and pool.ref_count(1) == 2
    with pytest.raises(ValueError):
        tree.unpin([1, 2, 3])
    assert tree.evict(10) == 1  # [3..6] goes: block 2 freed, block 1 still held by [1, 2]
    assert tree.match([1, 2, 3]).num_tokens == 2
    tree.unpin([1, 2])
    with pytest.raises(ValueError):
        tree.unpin([1, 2])
    assert tree.evict(10) == 1 and pool.num_used == 0
    tree.check_integrity()


def test_insert_returns_a_node_ending_at_the_sequence():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    cache_sequence(tree, pool, [1, 2, 3, 4, 5, 6])
    blocks = pool.allocate(1)
    handle = tree.insert([1, 2, 3], blocks_slots(*blocks, n=3))  # all cached: split only
    pool.decref(blocks)
    assert handle.token_ids == (1, 2, 3)
    tree.lock(handle)
    assert tree.evict(10) == 1  # [4, 5, 6]: block 2
    assert tree.match([1, 2, 3, 4]).num_tokens == 3
    tree.unlock(handle)
    tree.check_integrity()


def test_insert_rejects_misaligned_slots():
    pool = BlockPool(11, BS)
    tree = RadixTree(pool)
    with pytest.raises(ValueError):
        tree.insert([1, 2], [5, 7])
    with pytest.raises(ValueError):
        tree.insert([1, 2], [0, 1])  # NULL_BLOCK
    with pytest.raises(ValueError):
        tree.insert([1, 2], [4])
