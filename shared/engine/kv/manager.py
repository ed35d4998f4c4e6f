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
from typing import TYPE_CHECKING

from shared.engine.kv.block_pool import BlockPool, slot_ids
from shared.engine.kv.prefix_cache import PrefixCache, PrefixMatch
from shared.engine.request import Request

if TYPE_CHECKING:
    from shared.engine.kv.hicache import HiCache, LoadTicket, TierHit


@dataclass(frozen=True)
class SlotCopy:
    """Copy the KV at ``src`` slots to ``dst`` slots (all layers) before the next forward."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


class KVCacheManager:
    """Owns every request's pool refs and its lock on the prefix index.

    Contract: a request holds one pool ref per block in ``block_table`` and one lock on
    ``cache.prefix_handle`` from ``admit`` until ``free``; nothing else changes those fields. Each
    ``admit`` gives the request a new ``block_table`` list, which is then only appended to (``free``
    replaces it with an empty one): the scheduler hands the list itself to the runner, which
    copies only a table's new blocks each step (``shared.engine.block_table_rows``).
    """

    def __init__(self, pool: BlockPool, index: PrefixCache, tiers: HiCache | None = None):
        self.pool = pool
        self.index = index
        self.block_size = pool.block_size
        self.tiers = tiers
        if tiers is not None:  # the tree is the primary index of the tiers' pages
            assert hasattr(index, "on_evict"), "HiCache needs the radix tree"
            index.on_evict = self._on_evict
            index.pages.where = tiers.where
            tiers.on_page_moved = index.page_moved

    def match(self, req: Request) -> PrefixMatch:
        """Longest cached prefix, leaving at least the newest token to compute (its logits)."""
        return self.index.match(req.token_ids_between(0, req.num_tokens - 1))

    def admit(self, req: Request, match: PrefixMatch, num_new_tokens: int) -> list[SlotCopy] | None:
        """Give ``req`` the matched prefix plus room for ``num_new_tokens`` more.

        On success sets ``block_table``, ``num_computed_tokens`` (= the match) and
        ``cache.prefix_handle`` (locked) and returns the copies the runner must do first. Returns None
        and changes nothing when the pool cannot supply the blocks even after eviction.
        """
        assert not req.block_table and req.cache.prefix_handle is None
        bs = self.block_size
        m = match.num_tokens
        shared = {k: match.slots[(k + 1) * bs - 1] // bs for k in range(m // bs)}
        num_blocks = -(-(m + num_new_tokens) // bs)
        match = self._lock_with_room(req, match, num_blocks - len(shared))
        if match is None:
            return None
        self.release_waiting(req)  # the match now covers (and locks) what a tier load brought
        self.pool.incref(shared.values())
        fresh = iter(self.pool.allocate(num_blocks - len(shared)))
        table = [shared[k] if k in shared else next(fresh) for k in range(num_blocks)]
        copies = [self._copy_into(table[m // bs], m // bs, match)] if m % bs else []
        req.block_table = table
        req.num_computed_tokens = req.num_cached_tokens = m
        req.cache.prefix_handle = match.handle
        req.cache.num_backed_pages = 0
        if self.tiers is not None:
            self.tiers.on_admit(req, m)
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
        if req.cache.prefix_handle is not None:
            self.index.unlock(req.cache.prefix_handle)
        req.cache.prefix_handle = handle
        if self.tiers is not None:
            self.tiers.on_cached(req)

    def free(self, req: Request) -> None:
        """Cache what ``req`` computed, then drop its lock and block refs (finish, abort, preempt)."""
        self.cache(req)
        if req.cache.prefix_handle is not None:
            self.index.unlock(req.cache.prefix_handle)
        self.pool.decref(req.block_table)
        req.block_table = []
        req.cache.prefix_handle = None

    # --- HiCache loads ----------------------------------------------------------------------

    def find_in_tiers(self, req: Request, match: PrefixMatch) -> TierHit | None:
        """The lower tiers' continuation of ``match``: the pages the tree's slot-less nodes
        record first, then (pages no node knows, e.g. a warm disk after a restart) by hash."""
        assert self.tiers is not None
        known, handle = self.index.match_lower(req.token_ids_between(0, req.num_tokens - 1))
        return self.tiers.find(req, match.num_tokens, known, handle)

    def start_load(self, req: Request, match: PrefixMatch, hit: TierHit) -> bool:
        """Lock ``match`` (and ``hit``'s tree nodes) and queue the copy of ``hit``'s pages into
        fresh blocks; the request holds them in ``req.cache.tier_load`` until `end_load`. False
        (nothing changed) when the pool cannot supply the blocks even after eviction."""
        from shared.engine.kv.hicache import LoadTicket

        assert self.tiers is not None and req.cache.tier_load is None and req.cache.tier_handle is None
        if hit.handle is not None:
            self.index.lock_lower(hit.handle)  # first: the eviction below may move pages
        match = self._lock_with_room(req, match, len(hit.tiers))
        if match is None:
            if hit.handle is not None:
                self.index.unlock_lower(hit.handle)
            return False
        ticket = LoadTicket(req, match, hit, self.pool.allocate(len(hit.tiers)))
        req.cache.tier_load = ticket
        self.tiers.start_load(ticket)
        if ticket.layerwise:  # readable now (readers wait per layer): cache it, the request may start
            req.cache.tier_load = None
            self._cache_loaded(ticket)
        return True

    def end_load(self, ticket: LoadTicket) -> None:
        """A load finished: cache what landed in the index (unless a layer-by-layer load did
        at its start) and drop the ticket's own refs and locks."""
        if not ticket.layerwise:
            ticket.request.cache.tier_load = None
            if not ticket.cancelled:
                self._cache_loaded(ticket)
        if ticket.hit.handle is not None:
            self.index.unlock_lower(ticket.hit.handle)
        self.index.unlock(ticket.match.handle)
        self.pool.decref(ticket.blocks)

    def _cache_loaded(self, ticket: LoadTicket) -> None:
        """Insert the loaded tokens in the index (the tree's slot-less nodes take the loaded
        blocks as their slots) and keep them locked for the request (``req.cache.tier_handle``)
        until `admit`.

        # | device match (tree's slots) | loaded pages (the ticket's blocks) |
        # 0                             m                                    num_ok_tokens
        """
        req, match, bs = ticket.request, ticket.match, self.block_size
        end = ticket.num_ok_tokens
        if end > match.num_tokens:
            first = ticket.hit.start_page
            new = [ticket.blocks[p // bs - first] * bs + p % bs for p in range(match.num_tokens, end)]
            handle = self.index.insert(req.token_ids_between(0, end), list(match.slots) + new)
            self.index.lock(handle)
            req.cache.tier_handle = handle

    def release_waiting(self, req: Request) -> None:
        """Drop the lock a waiting request holds on its loaded prefix (admitted or ended)."""
        if req.cache.tier_handle is not None:
            self.index.unlock(req.cache.tier_handle)
            req.cache.tier_handle = None

    def prefetch(self, req: Request) -> None:
        if self.tiers is not None:
            self.tiers.prefetch(req, self.match(req).num_tokens)

    def _on_evict(self, node) -> dict[int, bytes] | None:
        """Radix eviction hook: hand the tiers the full pages whose last token ``node`` holds
        (write-back copies them now); returns {page index: hash} of those a tier holds (the
        node stays, slot-less, up to its first page that is missing); None once the tiers
        are closed (the node goes)."""
        if self.tiers is None:
            return None
        bs = self.block_size
        path = self.index.path_tokens(node)
        depth = len(path) - len(node.token_ids)
        owned = [(k, node.slots[(k + 1) * bs - 1 - depth] // bs) for k in range(depth // bs, len(path) // bs)]
        keys = self.tiers.on_device_evict(path, owned)
        return {k: keys[k] for k, _ in owned if self.tiers.where(keys[k]) is not None}

    def _copy_into(self, block: int, k: int, match: PrefixMatch) -> SlotCopy:
        """Copy the matched tokens of logical block ``k`` into physical ``block``."""
        bs = self.block_size
        src = match.slots[k * bs : min(match.num_tokens, (k + 1) * bs)]
        return SlotCopy(src=tuple(src), dst=tuple(block * bs + off for off in range(len(src))))

    def _lock_with_room(self, req: Request, match: PrefixMatch, num_blocks: int) -> PrefixMatch | None:
        """Lock ``match`` (before evicting, so it survives) and make ``num_blocks`` blocks free.
        Returns the locked match (its handle possibly narrowed), or None with nothing locked."""
        self.index.lock(match.handle)
        if self._ensure_free(num_blocks):
            return match
        self.index.unlock(match.handle)
        match = self._narrow(req, match)
        self.index.lock(match.handle)
        if self._ensure_free(num_blocks):
            return match
        self.index.unlock(match.handle)
        return None

    def _narrow(self, req: Request, match: PrefixMatch) -> PrefixMatch:
        """``match`` with a handle that ends exactly at its last token. A radix match may end
        inside a long cached edge, and locking it pins the whole edge: blocks past the match
        that a request alone in a small pool needs. Inserting the matched tokens splits the
        edge there (the tail becomes evictable); their slots are already cached, so no copy."""
        if match.num_tokens == 0:
            return match
        handle = self.index.insert(req.token_ids_between(0, match.num_tokens), match.slots)
        return PrefixMatch(match.num_tokens, match.slots, handle)

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
        if self.tiers is not None:
            self.tiers.check_integrity()
            for b, n in self.tiers.block_refs().items():
                expected[b] = expected.get(b, 0) + n
        for req in requests:
            for b in req.block_table:
                expected[b] = expected.get(b, 0) + 1
        for b in range(1, self.pool.num_blocks):
            actual, want = self.pool.ref_count(b), expected.get(b, 0)
            assert actual == want, f"block {b}: {actual} pool refs, {want} held"
