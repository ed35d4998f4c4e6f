"""Radix-tree nodes across tiers: slot-less nodes backed by host/disk pages, per-tier locks,
matches across tiers, and a hypothesis check against a naive reference (token prefix -> tier).

`FakeTiers` stands in for HiCache: a dict from page hash to HOST or DISK, and the KV manager's
eviction hook over it (a node stays when every page it owns is in the dict).
"""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.page_hash import page_hashes
from shared.engine.kv.radix import RadixTree
from shared.engine.kv.tier_ops import Tier

BS = 4
HOST, DISK, DEVICE = Tier.HOST, Tier.DISK, Tier.DEVICE


class FakeTiers:
    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self.store: dict[bytes, Tier] = {}
        tree.pages.where = self.store.get
        tree.on_evict = self.on_evict

    def on_evict(self, node) -> dict[int, bytes]:
        keys = page_hashes(self.tree.path_tokens(node), BS)
        return {k: keys[k] for k in self.tree.pages.owned_range(node) if keys[k] in self.store}

    def back_up(self, tokens: list[int]) -> list[bytes]:
        keys = page_hashes(tokens, BS)
        for h in keys:
            self.move(h, self.store.get(h, HOST))
        return keys

    def move(self, page_hash: bytes, tier: Tier | None) -> None:
        """The page now lives in ``tier`` (None: gone), then tell the tree."""
        if tier is None:
            self.store.pop(page_hash, None)
        else:
            self.store[page_hash] = tier
        self.tree.page_moved(page_hash)


def make(num_blocks: int = 11) -> tuple[BlockPool, RadixTree, FakeTiers]:
    pool = BlockPool(num_blocks, BS)
    tree = RadixTree(pool)
    return pool, tree, FakeTiers(tree)


def cache(tree: RadixTree, pool: BlockPool, tokens: list[int], prefix_slots: tuple[int, ...] = ()) -> None:
    """Insert ``tokens``: ``prefix_slots`` for the first ones, fresh blocks for the rest."""
    m = len(prefix_slots)
    first = m // BS
    blocks = pool.allocate(-(-len(tokens) // BS) - first)
    new = [blocks[p // BS - first] * BS + p % BS for p in range(m, len(tokens))]
    tree.insert(tokens, list(prefix_slots) + new)
    pool.decref(blocks)


def only_node(tree: RadixTree):
    (node,) = tree.root.children.values()
    return node


# ---- specs ---------------------------------------------------------------------------------


def test_backed_up_node_stays_slotless_on_host_then_disk_then_goes():
    pool, tree, tiers = make()
    a = list(range(10))  # blocks 1, 2, 3; full pages 0 and 1
    cache(tree, pool, a)
    h0, h1 = tiers.back_up(a)
    assert tree.evict(10) == 3 and pool.num_used == 0
    node = only_node(tree)
    # the partial block [8, 9] was never backed up: trimmed to the last page end
    assert (node.token_ids, node.slots, node.tier) == (tuple(range(8)), (), HOST)
    assert node.pages == {0: h0, 1: h1} and tree.num_nodes == 1 and tree.num_cached_tokens == 0
    assert tree.match(a).num_tokens == 0
    assert tree.match_lower(a) == ([(h0, HOST), (h1, HOST)], node)
    tiers.move(h1, DISK)  # host eviction spilled it
    assert node.tier == DISK and tree.match_lower(a)[0] == [(h0, HOST), (h1, DISK)]
    tree.check_integrity()
    tiers.move(h0, None)  # disk eviction (or a torn file): the node has nothing left
    assert tree.num_nodes == 0 and tree.match_lower(a) == ([], None)
    tree.check_integrity()


def test_node_not_backed_up_is_removed_and_a_partly_backed_one_cut():
    pool, tree, tiers = make()
    cache(tree, pool, [7] * 8)  # nothing backed up
    a = list(range(12))
    cache(tree, pool, a)
    h0, _, _ = page_hashes(a, BS)
    tiers.back_up(a[:4])  # pages 1 and 2 are nowhere
    assert tree.evict(10) == 5
    # [7] * 8 is gone; a keeps its backed-up page 0
    node = only_node(tree)
    assert (node.token_ids, node.pages, tree.num_nodes) == ((0, 1, 2, 3), {0: h0}, 1)
    tree.check_integrity()


def test_match_across_tiers_then_load_gives_the_node_slots_again():
    pool, tree, tiers = make()
    a, b = list(range(12)), list(range(8)) + [50, 51, 52, 53]
    cache(tree, pool, a)  # blocks 1, 2, 3
    cache(tree, pool, b)  # shares [0, 8): splits a's node at 8
    tiers.back_up(a)
    tree.lock(tree.match(b).handle)  # b's KV is in use: its path keeps its device KV
    assert tree.evict(10) == 1  # only a's tail (block 3) can go
    assert tree.num_nodes == 3
    m = tree.match(a)
    assert (m.num_tokens, m.slots) == (8, tuple(range(4, 12)))
    found, handle = tree.match_lower(a)
    assert found == [(page_hashes(a, BS)[2], HOST)] and handle.token_ids == tuple(range(8, 12))
    # | device match [0, 8) | loaded page 2 [8, 12) |
    cache(tree, pool, a, m.slots)  # the load lands in a fresh block and is cached
    assert tree.num_nodes == 3 and handle.tier == DEVICE and len(handle.slots) == 4
    assert tree.match(a).num_tokens == 12
    tree.check_integrity()


def test_device_lock_keeps_device_kv_and_lower_lock_keeps_the_node():
    pool, tree, tiers = make()
    a = list(range(12))
    cache(tree, pool, a)
    keys = tiers.back_up(a)
    handle = tree.match(a).handle
    tree.lock(handle)
    assert tree.evict(10) == 0 and handle.tier == DEVICE
    tree.unlock(handle)
    assert tree.evict(10) == 3 and handle.tier == HOST
    found, lower = tree.match_lower(a)
    tree.lock_lower(lower)  # a load reads its pages
    tiers.move(keys[1], None)  # the page goes meanwhile: the node waits for the load
    assert tree.num_nodes == 1 and tree.match_lower(a)[0] == found[:1]
    assert lower.token_ids == tuple(range(12))
    tree.check_integrity()
    tree.unlock_lower(lower)  # now it is cut before the missing page
    assert only_node(tree).token_ids == (0, 1, 2, 3) and tree.match_lower(a)[0] == found[:1]
    tree.check_integrity()


def test_split_hands_each_page_to_the_half_holding_its_last_token():
    pool, tree, tiers = make()
    a = list(range(12))
    cache(tree, pool, a)
    h0, h1, h2 = tiers.back_up(a)
    tree.evict(10)
    cache(tree, pool, a[:6])  # recomputed [0, 6): splits the slot-less node inside page 1
    upper = only_node(tree)
    (lower,) = upper.children.values()
    assert (upper.token_ids, upper.tier, upper.pages) == (tuple(range(6)), DEVICE, {0: h0})
    assert (lower.token_ids, lower.tier, lower.pages) == (tuple(range(6, 12)), HOST, {1: h1, 2: h2})
    assert tree.match(a).num_tokens == 6 and tree.match_lower(a) == ([(h1, HOST), (h2, HOST)], lower)
    tree.check_integrity()


# ---- model check ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _hashes(tokens: tuple[int, ...]) -> list[bytes]:
    return page_hashes(list(tokens), BS)


seqs = st.lists(st.integers(0, 2), min_size=1, max_size=13)
long_seqs = st.lists(st.integers(0, 2), min_size=4, max_size=13)


class TierMachine(RuleBasedStateMachine):
    """Reference: ``device`` (token prefixes with device KV) and ``lower`` (prefixes kept by
    slot-less nodes), with the rule for what a slot-less prefix needs (`_kept`)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.tree, self.tiers = make(num_blocks=400)
        self.device: set[tuple[int, ...]] = set()
        self.lower: set[tuple[int, ...]] = set()
        self.seen: list[list[int]] = []

    def _kept(self, candidates: set[tuple[int, ...]], paths: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
        """The slot-less prefixes that stay: those some cached path extends to their page end
        with every page there whose last token is not on the device in a tier."""
        good = set()
        for q in paths:
            if len(q) % BS == 0 and all(q[: (k + 1) * BS] in self.device or h in self.tiers.store
                                        for k, h in enumerate(_hashes(q))):
                good.update(q[:n] for n in range(len(q) - BS + 1, len(q) + 1))
        return candidates & good

    def _recheck_lower(self) -> None:
        self.lower = self._kept(self.lower, self.device | self.lower)

    def _cached(self, tokens: list[int]) -> None:
        prefixes = {tuple(tokens[:n]) for n in range(1, len(tokens) + 1)}
        self.device |= prefixes
        self.lower -= prefixes

    @rule(tokens=seqs)
    def insert(self, tokens):
        cache(self.tree, self.pool, tokens, self.tree.match(tokens).slots)
        self._cached(tokens)
        self.seen.append(tokens)

    @rule(i=st.integers(0, 50))
    def back_up(self, i):
        if self.seen:
            self.tiers.back_up(self.seen[i % len(self.seen)])

    @rule(tokens=long_seqs)
    def insert_and_back_up(self, tokens):  # write-through: most slot-less nodes come from here
        self.insert(tokens)
        self.tiers.back_up(tokens)

    @rule()
    def evict_all(self):
        self.tree.evict(10**6)
        lower = self.lower | self.device
        self.device = set()
        self.lower = self._kept(lower, lower)

    @rule(i=st.integers(0, 50), tier=st.sampled_from([DISK, None]))
    def move_page(self, i, tier):
        if self.tiers.store:
            keys = sorted(self.tiers.store)
            self.tiers.move(keys[i % len(keys)], tier)
            self._recheck_lower()

    @rule(i=st.integers(0, 50))
    def load(self, i):
        if not self.seen:
            return
        tokens = self.seen[i % len(self.seen)]
        m = self.tree.match(tokens)
        assert m.num_tokens == max((n for n in range(len(tokens) + 1) if n == 0 or tuple(tokens[:n]) in self.device))
        keys, want = page_hashes(tokens, BS), []
        for k in range(m.num_tokens // BS, len(tokens) // BS):
            if tuple(tokens[: (k + 1) * BS]) not in self.lower:
                break
            want.append((keys[k], self.tiers.store[keys[k]]))
        found, _ = self.tree.match_lower(tokens)
        assert found == want
        if found:
            end = (m.num_tokens // BS + len(found)) * BS
            cache(self.tree, self.pool, tokens[:end], m.slots)
            self._cached(tokens[:end])

    @rule(i=st.integers(0, 50))
    def robot_returns(self, i):  # its KV was evicted meanwhile; it loads what the tiers hold
        self.evict_all()
        self.load(i)

    @invariant()
    def same_as_reference(self):
        self.tree.check_integrity()
        got: dict[tuple[int, ...], Tier | None] = {}
        stack = [(self.tree.root, ())]
        while stack:
            node, path = stack.pop()
            for i, t in enumerate(node.token_ids):
                p = path + (t,)
                path = p
                if node.slots:
                    got[p] = DEVICE
                elif len(p) % BS == 0:
                    got[p] = self.tree.pages.tier_of[node.pages[len(p) // BS - 1]]
                else:
                    got[p] = None
            stack.extend((c, path) for c in node.children.values())
        want: dict[tuple[int, ...], Tier | None] = {p: DEVICE for p in self.device}
        for p in self.lower:
            want[p] = self.tiers.store[_hashes(p)[-1]] if len(p) % BS == 0 else None
        assert got == want


TestTierModel = TierMachine.TestCase
TestTierModel.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
