"""Gives requests KV slots: prefix reuse from an index, fresh blocks from the pool, eviction on demand.

Sharing rule: every *full* block of a matched prefix is shared by reference; a match that ends
inside a block gets a fresh block into which the runner copies the matched slots
(copy-on-write) before the step's forward pass::

    block:   |  0 (full, shared) |  1 (full, shared) | 2 (partial: copied) | 3 (new) |
    tokens:  0                   4                   8         10          12        16
                                                               ^ match ends (token-exact)

Which physical block holds a full logical block: the one holding its *last* token. A block is
only ever written by the one request that owns it, at positions of its own sequence, and the
tokens before its first own token were copied in when it was admitted; so the block that a
cached path reaches at offset ``block_size - 1`` holds that path's KV at every offset, even
when the radix tree records the earlier offsets under another request's block.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv.block_pool import BlockPool, slot_ids
from shared.engine.kv.prefix_cache import PrefixCache, PrefixMatch
from shared.engine.request import Request


@dataclass(frozen=True)
class SlotCopy:
    """Copy the KV at ``src`` slots to ``dst`` slots (all layers) before the next forward."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


class KVCacheManager:
    """Owns every request's pool refs and its lock on the prefix index.

    Contract: a request holds one pool ref per block in ``block_table`` and one lock on
    ``cache_handle`` from ``admit`` until ``free``; nothing else changes those fields.
    """

    def __init__(self, pool: BlockPool, index: PrefixCache):
        self.pool = pool
        self.index = index
        self.block_size = pool.block_size

    def match(self, req: Request) -> PrefixMatch:
        """Longest cached prefix, leaving at least the newest token to compute (its logits)."""
        return self.index.match(req.token_ids_between(0, req.num_tokens - 1))

    def admit(self, req: Request, match: PrefixMatch, num_new_tokens: int) -> list[SlotCopy] | None:
        """Give ``req`` the matched prefix plus room for ``num_new_tokens`` more.

        On success sets ``block_table``, ``num_computed_tokens`` (= the match) and
        ``cache_handle`` (locked) and returns the copies the runner must do first. Returns None
        and changes nothing when the pool cannot supply the blocks even after eviction.
        """
        assert not req.block_table and req.cache_handle is None
        bs = self.block_size
        m = match.num_tokens
        shared = {k: match.slots[(k + 1) * bs - 1] // bs for k in range(m // bs)}
        num_blocks = -(-(m + num_new_tokens) // bs)
        self.index.lock(match.handle)  # before evicting, so the match survives
        if not self._ensure_free(num_blocks - len(shared)):
            self.index.unlock(match.handle)
            return None
        self.pool.incref(shared.values())
        fresh = iter(self.pool.allocate(num_blocks - len(shared)))
        table = [shared[k] if k in shared else next(fresh) for k in range(num_blocks)]
        copies = [self._copy_into(table[m // bs], m // bs, match)] if m % bs else []
        req.block_table = table
        req.num_computed_tokens = req.num_cached_tokens = m
        req.cache_handle = match.handle
        return copies

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_new_tokens`` more; False (no change) if no room."""
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        if not self._ensure_free(need):
            return False
        req.block_table.extend(self.pool.allocate(need))
        return True

    def cache(self, req: Request) -> None:
        """Insert ``req``'s computed tokens into the index and move its lock to the new entry."""
        n = req.num_computed_tokens
        if n == 0:
            return
        handle = self.index.insert(req.token_ids_between(0, n), slot_ids(req.block_table, 0, n, self.block_size))
        self.index.lock(handle)
        if req.cache_handle is not None:
            self.index.unlock(req.cache_handle)
        req.cache_handle = handle

    def free(self, req: Request) -> None:
        """Cache what ``req`` computed, then drop its lock and block refs (finish, abort, preempt)."""
        self.cache(req)
        if req.cache_handle is not None:
            self.index.unlock(req.cache_handle)
        self.pool.decref(req.block_table)
        req.block_table = []
        req.cache_handle = None

    def _copy_into(self, block: int, k: int, match: PrefixMatch) -> SlotCopy:
        """Copy the matched tokens of logical block ``k`` into physical ``block``."""
        bs = self.block_size
        src = match.slots[k * bs : min(match.num_tokens, (k + 1) * bs)]
        return SlotCopy(src=tuple(src), dst=tuple(block * bs + off for off in range(len(src))))

    def _ensure_free(self, num_blocks: int) -> bool:
        shortfall = num_blocks - self.pool.num_free
        if shortfall > 0:
            self.index.evict(shortfall)
        return self.pool.num_free >= num_blocks

    def check_integrity(self, requests: list[Request]) -> None:
        """Every block's pool refs == the index's refs + one per table entry of ``requests``
        (pass every live request): a leaked or missing ref fails here (tests call this)."""
        self.index.check_integrity()
        expected = self.index.block_refs()
        for req in requests:
            for b in req.block_table:
                expected[b] = expected.get(b, 0) + 1
        for b in range(1, self.pool.num_blocks):
            actual, want = self.pool.ref_count(b), expected.get(b, 0)
            assert actual == want, f"block {b}: {actual} pool refs, {want} held"
