"""HiCache: the host and disk tiers below the device KV pool, and the policies that fill them.

Keys: every full KV block of a sequence is a *page* keyed by its chained hash
(`page_hash`), so the tiers below the device are content-addressed: identical pages are kept
once. The radix tree is the primary index: its slot-less nodes record their pages' hashes and
tiers (`radix_tiers`), kept current by ``on_page_moved``, which is called after every change
of a page's tier. A match continues from the tree's device match into the pages its nodes
record, then by hash for pages no node knows (a warm disk tier after a restart)::

    | device (radix tree, token-exact) | host pages | disk pages | not cached |
    0                                  m            (page-aligned)          num_tokens

Write policies: ``write_through`` backs up each page when a request's KV is cached,
``write_through_selective`` when a page has been hit ``write_through_threshold`` times,
``write_back`` only when the radix tree evicts it from the device. A full host pool evicts its
least recently used unlocked page, spilling it to disk first when there is a disk tier.

Loads: the scheduler asks `find` for the tiers' extension of a request's device match; the
cost model may decline it (recompute instead). `start_load` queues the copy into fresh device
blocks; `poll` returns finished loads. A load of host pages only (none of them under another
op) may run *layer by layer* (``layerwise``): the request is admitted at once and its forward
pass waits for each layer's KV (`fences_reading`), so compute overlaps the rest of the copy.
All bookkeeping is on the engine thread; the copies run on the `TierCopier` threads, which
hold no bookkeeping. Pure Python: no torch here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.cost_model import LoadCostModel
from shared.engine.kv.disk_tier import DiskTier
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.kv.host_pool import HostPagePool
from shared.engine.kv.prefix_cache import PrefixMatch
from shared.engine.kv.page_hash import extend_page_hashes, page_hashes
from shared.engine.kv.tier_ops import Backup, DeleteFiles, Load, OpDone, Prefetch, Spill, Tier, TierOp
from shared.engine.kv.tier_stats import TierStats
from shared.engine.request import Request

if TYPE_CHECKING:
    from shared.engine.kv.layer_fence import LayerFence

PageHash = bytes


class TierCopyError(RuntimeError):
    """A layer-by-layer load raised (a device error) after its request started reading it: the
    KV it cached for that prefix never landed, so the engine's output can no longer be trusted
    (restart the daemon). Whole loads and writes that raise only turn into misses."""


@dataclass(frozen=True)
class TierHit:
    """Pages [start_page, start_page + len(tiers)) of a request, found below the device."""

    device_tokens: int  # the device match it extends
    start_page: int  # = device_tokens // page_size: the page holding the first missing token
    tiers: tuple[Tier, ...]  # HOST or DISK, per page
    page_size: int
    handle: object = field(default=None, compare=False)  # tree node owning its last known page

    @property
    def num_tokens(self) -> int:
        """The match length once loaded (page-aligned)."""
        return (self.start_page + len(self.tiers)) * self.page_size


@dataclass(eq=False)
class LoadTicket:
    """A request's load in flight: it holds ``blocks`` (one pool ref each) and a lock on the
    device match ``handle`` until `KVCacheManager.end_load`."""

    request: Request
    match: PrefixMatch  # the device match it extends (its handle is locked)
    hit: TierHit
    blocks: list[int]
    op: Load | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # the request ended meanwhile
    error: str | None = None  # the copy raised: nothing landed

    @property
    def layerwise(self) -> bool:
        """Its blocks are readable at once, layer by layer (``op.fence``); it cannot fail."""
        return self.op is not None and self.op.fence is not None

    @property
    def num_ok_tokens(self) -> int:
        """The match length the load achieved (the device match if nothing landed)."""
        if self.op is None or self.op.num_ok == 0:
            return self.hit.device_tokens
        return (self.hit.start_page + self.op.num_ok) * self.hit.page_size


class HiCache:
    """The tiers' bookkeeping and policies; ``copier`` executes the ops it queues."""

    def __init__(self, config: HiCacheConfig, pool: BlockPool, copier, num_host_pages: int,
                 disk: DiskTier | None, recompute_seconds: Callable[[int], float], layerwise: bool = False) -> None:
        """``recompute_seconds``: tokens -> the engine's measured time to compute them (the cost
        model's alternative to a load). ``layerwise``: run loads of host pages layer by layer
        (`HiCacheConfig.layerwise_for`)."""
        self.config = config
        self.layerwise = layerwise
        self.pool = pool
        self.page_size = pool.block_size
        self.copier = copier
        self.host = HostPagePool(num_host_pages)
        self.disk = disk
        self.cost = LoadCostModel(config.min_load_tokens, copier.page_bytes, self.page_size, recompute_seconds)
        self.stats = TierStats(host_pages_total=num_host_pages)
        self._loads: dict[int, LoadTicket] = {}  # by id(op)
        self._held_blocks: dict[int, list[int]] = {}  # by id(op): blocks ref'd by backups in flight
        self._hits: OrderedDict[PageHash, int] = OrderedDict()  # write_through_selective counts
        # Told each hash whose tier may have changed, after the change (the radix tree's
        # `page_moved`, which keeps its node records equal to `where`).
        self.on_page_moved: Callable[[PageHash], None] = lambda page_hash: None

    # --- keys ------------------------------------------------------------------------------

    def hashes(self, req: Request, num_pages: int) -> list[PageHash]:
        """The keys of ``req``'s first ``num_pages`` pages (cached on the request)."""
        if len(req.cache.page_hashes) < num_pages:
            extend_page_hashes(req.cache.page_hashes, req.token_ids_between, num_pages, self.page_size)
        return req.cache.page_hashes[:num_pages]

    def where(self, page_hash: PageHash) -> Tier | None:
        if page_hash in self.host:
            return Tier.HOST
        if self.disk is not None and page_hash in self.disk:
            return Tier.DISK
        return None

    # --- loads -----------------------------------------------------------------------------

    def find(self, req: Request, device_tokens: int, known: Sequence[tuple[PageHash, Tier]] = (),
             handle: object = None) -> TierHit | None:
        """The tiers' continuation of a device match of ``device_tokens`` tokens, leaving the
        newest token to compute; None on a miss or when the cost model prefers recomputing.
        ``known``: (hash, tier) of the pages from ``device_tokens // page_size`` on that the
        radix tree records (owned by ``handle`` and its ancestors); later pages by hash."""
        ps = self.page_size
        start, end = device_tokens // ps, (req.num_tokens - 1) // ps
        if end <= start:
            return None
        tiers = [tier for _, tier in known[: end - start]]
        for page_hash in self.hashes(req, end)[start + len(tiers):]:
            tier = self.where(page_hash)
            if tier is None:
                break
            tiers.append(tier)
        if not tiers:
            return None
        hit = TierHit(device_tokens, start, tuple(tiers), ps, handle if known else None)
        num_disk = tiers.count(Tier.DISK)
        if not self.cost.worth_loading(hit.num_tokens - device_tokens, len(tiers) - num_disk, num_disk):
            self.stats.loads_skipped += 1
            return None
        return hit

    def start_load(self, ticket: LoadTicket) -> None:
        """Queue the copy of ``ticket.hit``'s pages into ``ticket.blocks`` (one per page). A
        disk page that finds no host page cuts the load short there. With ``layerwise`` on, a
        load whose pages are all on the host and under no other op (so they hold their data)
        runs layer by layer (``ticket.layerwise``): it lands whole, and its hits count now."""
        hit, req = ticket.hit, ticket.request
        hashes = self.hashes(req, hit.start_page + len(hit.tiers))[hit.start_page:]
        if self.disk is not None:  # a read is a use, before a host page spilled below can push one out
            self._touch_on_disk([h for h in hashes if h not in self.host])
        pages, from_disk = [], []
        quiet = True  # no page is read from disk or under another op
        for page_hash in hashes:
            page = self.host.lookup(page_hash)
            on_disk_only = page is None
            if on_disk_only:  # read it through a host page (which keeps it: a promotion)
                page = self._allocate_host(page_hash)
                if page is None:
                    break
            quiet = quiet and not on_disk_only and not self.host.is_locked(page)
            self.host.lock(page)
            pages.append(page)
            from_disk.append(on_disk_only)
        fence = self.copier.new_fence() if self.layerwise and quiet and pages else None
        ticket.op = Load(req.request_id, ticket.blocks[: len(pages)], pages, hashes[: len(pages)], from_disk,
                         num_ok=len(pages) if fence else 0, fence=fence)
        self._loads[id(ticket.op)] = ticket
        if fence is not None:
            self.stats.loads_layerwise += 1
            self._count_hits(ticket)
        self.copier.submit(ticket.op)

    def fences_reading(self, blocks: set[int]) -> tuple[LayerFence, ...]:
        """The fences of the layer-by-layer loads in flight into any of ``blocks``: a forward
        pass that reads those blocks waits on them, layer by layer."""
        return tuple(t.op.fence for t in self._loads.values()
                     if t.layerwise and not blocks.isdisjoint(t.op.blocks))

    def poll(self, timeout: float | None = None) -> list[LoadTicket]:
        """Collect finished ops; returns the finished loads (cancelled ones too: the caller
        releases every ticket with `KVCacheManager.end_load`)."""
        finished = []
        for done in self.copier.completed(timeout):
            ticket = self._complete(done)
            if ticket is not None:
                finished.append(ticket)
        return finished

    @property
    def num_layerwise_loading(self) -> int:
        return sum(t.layerwise for t in self._loads.values())

    def _complete(self, done: OpDone) -> LoadTicket | None:
        op, s = done.op, self.stats
        s.copy_errors += done.error is not None
        if isinstance(op, Backup | Spill):
            self.pool.decref(self._held_blocks.pop(id(op), ()))  # none for a write-back run now
            self._unlock(op.pages)
            if done.error is not None:  # its host pages or files may hold nothing: no tier claims them
                for page_hash in op.hashes:
                    self._forget(page_hash)
                return None
            s.write_ops += 1
            s.write_s += done.seconds
            s.bytes_moved["device_to_host" if isinstance(op, Backup) else "host_to_disk"] += \
                len(op.pages) * self.copier.page_bytes
        elif isinstance(op, Prefetch):
            self._unlock(op.pages)
            for page_hash, ok in zip(op.hashes, op.ok, strict=True):
                if ok:
                    s.bytes_moved["disk_to_host"] += self.copier.page_bytes
                else:
                    self._forget(page_hash)
        elif isinstance(op, Load):
            return self._complete_load(self._loads.pop(id(op)), done)
        return None

    def _complete_load(self, ticket: LoadTicket, done: OpDone) -> LoadTicket:
        op, s, pb = ticket.op, self.stats, self.copier.page_bytes
        ticket.error = done.error
        self._unlock(op.pages)
        num_disk = sum(op.from_disk[: op.num_ok])
        s.bytes_moved["disk_to_host"] += num_disk * pb
        s.bytes_moved["host_to_device"] += op.num_ok * pb
        self.cost.observe(Tier.HOST, op.num_ok * pb, done.seconds)
        if op.num_ok < len(op.hashes):  # the first unsound page: a miss from there on
            s.load_failures += 1
            self._forget(op.hashes[op.num_ok])
            for page_hash, unread in zip(op.hashes[op.num_ok + 1:], op.from_disk[op.num_ok + 1:], strict=True):
                if unread:  # its host page never got its bytes; the disk still has them
                    self.host.discard(page_hash)
                    self.on_page_moved(page_hash)
        s.loads += 1
        s.load_s += time.perf_counter() - ticket.submitted_at
        if not ticket.cancelled and not ticket.layerwise:
            self._count_hits(ticket)
        return ticket

    def _count_hits(self, ticket: LoadTicket) -> None:
        """Credit the tiers with the tokens the load gains and tell its request how many of
        its next admission's match came from them."""
        op, hit = ticket.op, ticket.hit
        for i in range(op.num_ok):
            gained = self.page_size - (hit.device_tokens % self.page_size if i == 0 else 0)
            self.stats.hit_tokens["disk" if op.from_disk[i] else "host"] += gained
        ticket.request.cache.num_tier_loaded_tokens += ticket.num_ok_tokens - hit.device_tokens

    # --- writes ----------------------------------------------------------------------------

    def on_admit(self, req: Request, match_tokens: int) -> None:
        """Count the admission's device hits; under write_through_selective, back up the
        matched pages that reached the hit threshold. Call after `admit` set the block table."""
        if req.num_preemptions == 0:
            self.stats.hit_tokens["device"] += max(match_tokens - req.cache.num_tier_loaded_tokens, 0)
        req.cache.num_tier_loaded_tokens = 0
        if self.config.write_policy != "write_through_selective":
            return
        due = []
        for k, page_hash in enumerate(self.hashes(req, match_tokens // self.page_size)):
            count = self._hits.pop(page_hash, 0) + 1
            self._hits[page_hash] = count  # most recent last
            if count >= self.config.write_through_threshold:
                due.append(k)
        while len(self._hits) > 4 * self.pool.num_blocks:
            self._hits.popitem(last=False)
        self._back_up(req, due)

    def on_cached(self, req: Request) -> None:
        """Under write_through, back up the pages ``req`` computed since the last call."""
        if self.config.write_policy != "write_through":
            return
        num_pages = req.num_computed_tokens // self.page_size
        first = req.cache.num_backed_pages
        req.cache.num_backed_pages = max(first, num_pages)
        self._back_up(req, range(first, num_pages))

    def _back_up(self, req: Request, page_ids) -> None:
        """Queue one Backup of ``req``'s pages ``page_ids`` that no tier holds yet."""
        blocks, pages, hashes = [], [], []
        keys = self.hashes(req, max(page_ids, default=-1) + 1)
        for k in page_ids:
            page_hash = keys[k]
            if self.where(page_hash) is not None:
                self.host.lookup(page_hash)
                continue
            page = self._allocate_host(page_hash)
            if page is None:
                break
            self.host.lock(page)
            blocks.append(req.block_table[k])
            pages.append(page)
            hashes.append(page_hash)
        if pages:
            op = Backup(blocks, pages, hashes)
            self.pool.incref(blocks)  # the blocks must not be reused before the copy ran
            self._held_blocks[id(op)] = blocks
            self.copier.submit(op)

    def on_device_evict(self, path_tokens: list[int], owned: list[tuple[int, int]]) -> list[PageHash]:
        """Under write_back, copy the pages the radix tree is evicting to the host, now.

        ``owned``: (page index, device block) of each full page whose last token the evicted
        node held. The copy runs before the blocks can be reused (after queued ops). Returns
        the hashes of the path's pages up to the last owned one."""
        if not owned:
            return []
        keys = page_hashes(path_tokens[: (owned[-1][0] + 1) * self.page_size], self.page_size)
        if self.config.write_policy != "write_back":
            return keys
        blocks, pages, hashes = [], [], []
        for k, block in owned:
            if self.where(keys[k]) is not None:
                continue
            page = self._allocate_host(keys[k])
            if page is None:
                break
            self.host.lock(page)
            blocks.append(block)
            pages.append(page)
            hashes.append(keys[k])
        if pages:
            self._complete(self.copier.run_now(Backup(blocks, pages, hashes)))
        return keys

    def prefetch(self, req: Request, device_tokens: int) -> None:
        """Disk -> host for the pages of ``req`` past its device match that only the disk
        holds, while the host has free pages (a queued request must not evict hot pages)."""
        if self.disk is None or not self.config.prefetch:
            return
        ps = self.page_size
        start, end = device_tokens // ps, (req.num_tokens - 1) // ps
        pages, hashes = [], []
        for page_hash in self.hashes(req, max(end, 0))[start:]:
            tier = self.where(page_hash)
            if tier is None:
                break
            if tier == Tier.HOST:
                continue
            alloc = self.host.allocate(page_hash, evict=False)
            if alloc is None:
                break
            self.host.lock(alloc.page)
            self.on_page_moved(page_hash)
            pages.append(alloc.page)
            hashes.append(page_hash)
        self._touch_on_disk(hashes)
        if pages:
            self._submit(Prefetch(pages, hashes))

    def _touch_on_disk(self, hashes: list[PageHash]) -> None:
        """``hashes`` (a request's pages, in order) about to be read from disk, marked used (a load
        that runs out of host pages reads only the first of them; the rest were still asked for):
        the disk drops its least recently used pages, and of these the last first, since a later
        page is of no use without the ones before it."""
        for page_hash in reversed(hashes):
            self.disk.touch(page_hash)

    # --- host pool -------------------------------------------------------------------------

    def _allocate_host(self, page_hash: PageHash) -> int | None:
        """A host page keyed by ``page_hash``; a displaced page is spilled to disk first."""
        alloc = self.host.allocate(page_hash)
        if alloc is None:
            return None
        moved = [page_hash]
        if alloc.evicted is not None:
            moved.append(alloc.evicted)
        if alloc.evicted is not None and self.disk is not None and alloc.evicted not in self.disk:
            self.host.lock(alloc.page)
            dropped = self.disk.add(alloc.evicted)
            self._submit(Spill([alloc.page], [alloc.evicted]))
            if dropped:
                self._submit(DeleteFiles(dropped))
                moved += dropped
        for h in moved:
            self.on_page_moved(h)
        return alloc.page

    def _forget(self, page_hash: PageHash) -> None:
        """A page read as missing or torn: no tier claims it any more."""
        self.host.discard(page_hash)
        if self.disk is not None:
            self.disk.discard(page_hash)
        self.on_page_moved(page_hash)

    def _unlock(self, pages: list[int]) -> None:
        for page in pages:
            self.host.unlock(page)

    def _submit(self, op: TierOp) -> None:
        self.copier.submit(op)

    # --- checks ----------------------------------------------------------------------------

    def snapshot(self) -> TierStats:
        s = self.stats
        s.host_pages_used = self.host.num_used
        s.disk_pages = len(self.disk) if self.disk is not None else 0
        return s

    def block_refs(self) -> dict[int, int]:
        """Pool refs held by backups and loads in flight, per block."""
        refs: dict[int, int] = {}
        for blocks in [*self._held_blocks.values(), *(t.blocks for t in self._loads.values())]:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def drain(self) -> list[LoadTicket]:
        """Wait for every queued op; returns the loads that finished, which the caller releases
        (tests driving the tiers directly; an engine settles through `Engine.settle_tiers`)."""
        finished = []
        while self.copier.pending:
            finished += self.poll(timeout=1.0)
        return finished

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.copier.pending == 0 and (self._loads or self._held_blocks):
            raise AssertionError("ops recorded in flight but the copier is idle")
        if self.copier.pending == 0 and any(self.host.is_locked(p) for p in range(self.host.num_pages)):
            raise AssertionError("a host page is locked with no op in flight")
