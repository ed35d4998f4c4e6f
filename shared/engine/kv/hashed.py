"""Hashed full-block prefix index (vLLM v1 / nano-vllm style).

Block k of a sequence is keyed by a chained hash `hash_fn(parent_hash, block_tokens)`, so a
key names the whole prefix up to and including block k. Only full blocks are cached; a hit is
always a whole number of blocks, shared by reference with no copy.

Collision safety: each entry keeps its tokens and its parent ENTRY; a lookup hits only if
both match, so by induction a hit is exactly the query's prefix, whatever hash_fn does. On a
collision the newcomer is simply not cached.

Every entry's parent is cached too (reachable-only): evicting an entry drops its whole
subtree, and insert stops at the first block it cannot cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.engine.kv.block_pool import NULL_BLOCK, BlockPool
from shared.engine.kv.prefix_cache import PrefixMatch

BlockHash = bytes
HashFn = Callable[[BlockHash, tuple[int, ...]], BlockHash]
NONE_HASH: BlockHash = b"\0" * 16  # parent hash of a sequence's first block


def chain_hash(parent: BlockHash, block_tokens: tuple[int, ...]) -> BlockHash:
    """blake2b over the parent hash and the tokens (little-endian int64); stable across runs."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(block_tokens)}q", *block_tokens), digest_size=16).digest()


@dataclass(slots=True, eq=False)
class _Entry:
    block_hash: BlockHash
    tokens: tuple[int, ...]
    block_id: int
    parent: _Entry | None  # None for a sequence's first block
    depth: int  # block index within the sequence
    children: dict[int, _Entry] = field(default_factory=dict)  # by block_id
    lock_count: int = 0


class HashedBlockIndex:
    """Full-block prefix cache implementing `PrefixCache`; handles are tuples of block ids.

    Holds one pool ref per cached block. Evicts in LRU order: a touch refreshes a chain tail
    first, so every entry sits before its ancestors in LRU order and leaves go first.
    """

    def __init__(self, pool: BlockPool, hash_fn: HashFn = chain_hash) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._hash_fn = hash_fn
        self._by_hash: dict[BlockHash, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # block_id -> entry, oldest first

    @property
    def num_cached_tokens(self) -> int:
        return len(self._by_block) * self.block_size

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    # ---- PrefixCache -------------------------------------------------------------------

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of whole blocks; stops at the first miss.

        Touches LRU; no ref or lock change. Handle = the matched block ids.
        """
        chain = self._walk(token_ids)
        self._touch(chain)
        bs = self.block_size
        slots = tuple(s for e in chain for s in range(e.block_id * bs, (e.block_id + 1) * bs))
        return PrefixMatch(len(chain) * bs, slots, tuple(e.block_id for e in chain))

    def lock(self, handle: object) -> None:
        for entry in self._entries(handle):
            entry.lock_count += 1

    def unlock(self, handle: object) -> None:
        for entry in self._entries(handle):
            assert entry.lock_count > 0, "unlock without lock"
            entry.lock_count -= 1

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> tuple[int, ...]:
        """Cache each full block of `token_ids` whose slots are one whole physical block.

        A block already cached keeps its block (the caller's copy is not referenced); a new
        one takes one pool ref. Stops at the first block that cannot be cached (slots not one
        aligned block, or a hash collision): later blocks would be unreachable. Touches LRU of
        the cached chain. Returns its block ids (unlocked).
        """
        if len(token_ids) != len(slots):
            raise ValueError(f"{len(token_ids)} token_ids but {len(slots)} slots")
        bs = self.block_size
        chain: list[_Entry] = []
        parent: _Entry | None = None
        for k in range(len(token_ids) // bs):
            tokens = tuple(token_ids[k * bs : (k + 1) * bs])
            entry = self._lookup(parent, tokens)
            if entry is None:
                entry = self._add(parent, tokens, slots[k * bs : (k + 1) * bs], k)
            if entry is None:
                break
            chain.append(entry)
            parent = entry
        self._touch(chain)
        return tuple(e.block_id for e in chain)

    def evict(self, num_blocks: int) -> int:
        """Drop LRU entries nobody else holds (pool ref 1, unlocked), with their subtrees,
        until `num_blocks` blocks were freed. Returns the number freed.

        NOTE: O(cached blocks) per call (a snapshot of the LRU list); evict runs when memory
        is short, not per token.
        """
        if num_blocks <= 0:
            return 0
        victims = []
        for entry in self._lru.values():
            if len(victims) >= num_blocks:
                break
            if entry.lock_count == 0 and self.pool.ref_count(entry.block_id) == 1:
                victims.append(entry)
        freed = 0
        for entry in victims:
            if entry.block_id in self._by_block:  # not already dropped with an ancestor
                freed += self._drop_subtree(entry)
        return freed

    # ---- integrity -----------------------------------------------------------------------

    def block_refs(self) -> dict[int, int]:
        """Pool refs the index holds, per block: one per cached block."""
        return {block_id: 1 for block_id in self._by_block}

    def check_integrity(self) -> None:
        """Raise AssertionError if the maps, the chain, locks, LRU order or refs disagree."""
        if not (len(self._by_hash) == len(self._by_block) == len(self._lru)):
            raise AssertionError("hash map, block map and LRU list differ in size")
        position = {block_id: i for i, block_id in enumerate(self._lru)}
        for block_id, entry in self._by_block.items():
            if self._by_hash.get(entry.block_hash) is not entry or entry.block_id != block_id:
                raise AssertionError(f"block {block_id} is mapped inconsistently")
            if block_id == NULL_BLOCK or self.pool.ref_count(block_id) < 1:
                raise AssertionError(f"cached block {block_id} has no pool ref")
            if len(entry.tokens) != self.block_size or entry.lock_count < 0:
                raise AssertionError(f"block {block_id}: bad tokens or lock")
            if sum(c.lock_count for c in entry.children.values()) > entry.lock_count:
                raise AssertionError(f"block {block_id}: children locked more than parent")
            self._check_parent(entry, position)
        self.pool.check_integrity()

    def _check_parent(self, entry: _Entry, position: dict[int, int]) -> None:
        parent = entry.parent
        parent_hash = NONE_HASH if parent is None else parent.block_hash
        if entry.block_hash != self._hash_fn(parent_hash, entry.tokens):
            raise AssertionError(f"block {entry.block_id}: stale hash")
        if parent is None:
            if entry.depth != 0:
                raise AssertionError(f"block {entry.block_id}: orphan")
            return
        cached = self._by_block.get(parent.block_id) is parent
        if not cached or parent.children.get(entry.block_id) is not entry:
            raise AssertionError(f"block {entry.block_id}: parent not cached")
        if entry.depth != parent.depth + 1 or position[entry.block_id] > position[parent.block_id]:
            raise AssertionError(f"block {entry.block_id}: depth or LRU order wrong")

    # ---- internals -----------------------------------------------------------------------

    def _walk(self, token_ids: Sequence[int]) -> list[_Entry]:
        bs = self.block_size
        chain: list[_Entry] = []
        parent: _Entry | None = None
        for k in range(len(token_ids) // bs):
            entry = self._lookup(parent, tuple(token_ids[k * bs : (k + 1) * bs]))
            if entry is None:
                break
            chain.append(entry)
            parent = entry
        return chain

    def _lookup(self, parent: _Entry | None, tokens: tuple[int, ...]) -> _Entry | None:
        parent_hash = NONE_HASH if parent is None else parent.block_hash
        entry = self._by_hash.get(self._hash_fn(parent_hash, tokens))
        if entry is None or entry.parent is not parent or entry.tokens != tokens:
            return None  # a miss, or a collision with another prefix
        return entry

    def _add(
        self, parent: _Entry | None, tokens: tuple[int, ...], slots: Sequence[int], depth: int
    ) -> _Entry | None:
        """Cache one block; None if its slots are not one aligned block or its hash is taken."""
        bs = self.block_size
        block_id = slots[0] // bs
        if block_id == NULL_BLOCK or list(slots) != list(range(block_id * bs, (block_id + 1) * bs)):
            return None
        block_hash = self._hash_fn(NONE_HASH if parent is None else parent.block_hash, tokens)
        if block_hash in self._by_hash:
            return None  # collision: keep the incumbent
        assert block_id not in self._by_block, f"block {block_id} already caches other tokens"
        entry = _Entry(block_hash, tokens, block_id, parent, depth)
        self.pool.incref([block_id])
        self._by_hash[block_hash] = entry
        self._by_block[block_id] = entry
        self._lru[block_id] = entry
        if parent is not None:
            parent.children[block_id] = entry
        return entry

    def _touch(self, chain: list[_Entry]) -> None:
        # NOTE: tail first, so descendants always sit before their ancestors in LRU order.
        for entry in reversed(chain):
            self._lru.move_to_end(entry.block_id)

    def _entries(self, handle: object) -> list[_Entry]:
        assert isinstance(handle, tuple), f"not a HashedBlockIndex handle: {handle!r}"
        entries = [self._by_block.get(block_id) for block_id in handle]
        assert all(e is not None for e in entries), "handle was evicted: lock before evict()"
        return entries  # type: ignore[return-value]

    def _drop_subtree(self, entry: _Entry) -> int:
        """Uncache `entry` and its descendants (unreachable without it); returns blocks freed."""
        stack, dropped = [entry], []
        while stack:
            e = stack.pop()
            assert e.lock_count == 0, "a locked block below an unlocked one"
            dropped.append(e)
            stack.extend(e.children.values())
        if entry.parent is not None:
            del entry.parent.children[entry.block_id]
        for e in dropped:
            del self._by_hash[e.block_hash], self._by_block[e.block_id], self._lru[e.block_id]
        return len(self.pool.decref(e.block_id for e in dropped))
