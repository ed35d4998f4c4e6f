"""Tier records of radix-tree nodes: which host/disk pages back a node's KV.

Page k of a path holds positions [k * ps, (k + 1) * ps). It is *owned* by the node that holds
its last token, position (k + 1) * ps - 1 (the KV manager's rule for which block holds a full
block), so a node boundary may fall inside a page::

    #            k * ps      depth                       (j + 1) * ps     depth + len
    # parent:    | ...        |
    # node:                   | end of page k | pages ... j | tail: page j + 1 |
    #                         (k = depth // ps: owns pages k .. j, the tail is a child's)

A node records the hash of every page it owns once its device KV is dropped (a node is cut
before the first page that no lower tier holds): a slot-less node is *whole*. Its head is covered by its first owned page (which starts in the parent); its tail
past its last page end is covered by a child's first page, so a leaf without device KV is
trimmed to its last page end. A split hands each record to the half holding the page's last
token, which keeps both halves whole. Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from shared.engine.kv.tier_ops import Tier

if TYPE_CHECKING:
    from shared.engine.kv.block_pool import BlockPool
    from shared.engine.kv.radix import TreeNode

PageHash = bytes


class PageRecords:
    """The tree's index of lower-tier pages: hash -> owning node, and each page's tier.

    ``where`` (set by the KV manager to `HiCache.where`) says where a hash lives now; every
    record is kept equal to it by `moved`, which HiCache calls after each change of a page.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.owner: dict[PageHash, TreeNode] = {}
        self.tier_of: dict[PageHash, Tier] = {}
        self.where: Callable[[PageHash], Tier | None] = lambda page_hash: None

    def owned_range(self, node: TreeNode) -> range:
        """Indices of the pages whose last token lies on ``node``'s edge."""
        ps = self.page_size
        return range(node.depth // ps, (node.depth + len(node.token_ids)) // ps)

    def is_whole(self, node: TreeNode) -> bool:
        return len(node.pages) == len(self.owned_range(node))

    def trimmed_len(self, node: TreeNode) -> int:
        """Length of ``node``'s edge cut at its last page end (0 if it owns no page)."""
        owned = self.owned_range(node)
        return owned.stop * self.page_size - node.depth if owned else 0

    def record(self, node: TreeNode, pages: dict[int, PageHash]) -> None:
        """``node`` (losing its device KV) is backed by ``pages`` (page index -> hash)."""
        for k, page_hash in pages.items():
            old = node.pages.get(k)
            if old is not None and old != page_hash:
                self._forget_hash(old)
            node.pages[k] = page_hash
            self.owner[page_hash] = node
            self.tier_of[page_hash] = self.where(page_hash)
        self.refresh(node)

    def moved(self, page_hash: PageHash) -> TreeNode | None:
        """A page changed tier or vanished. Returns its owner when the owner lost a page and
        has no device KV (the tree removes it), else None."""
        node = self.owner.get(page_hash)
        if node is None:
            return None
        tier = self.where(page_hash)
        if tier is not None:
            self.tier_of[page_hash] = tier
            self.refresh(node)
            return None
        k = next(k for k, h in node.pages.items() if h == page_hash)
        del node.pages[k]
        self._forget_hash(page_hash)
        self.refresh(node)
        return None if node.slots else node

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``lower`` was just cut below ``upper``: move the records whose page ends in upper."""
        for k in [k for k in lower.pages if k in self.owned_range(upper)]:
            page_hash = lower.pages.pop(k)
            upper.pages[k] = page_hash
            self.owner[page_hash] = upper
        upper.tier = lower.tier
        self.refresh(upper)
        self.refresh(lower)

    def release(self, node: TreeNode) -> None:
        """``node`` leaves the tree: forget its records (the pages stay in their tiers)."""
        for page_hash in node.pages.values():
            self._forget_hash(page_hash)
        node.pages.clear()

    def refresh(self, node: TreeNode) -> None:
        """Device if it has slots, else the slowest tier among its pages (host if none)."""
        if node.slots:
            node.tier = Tier.DEVICE
        else:
            node.tier = max((self.tier_of[h] for h in node.pages.values()), default=Tier.HOST)

    def _forget_hash(self, page_hash: PageHash) -> None:
        self.owner.pop(page_hash, None)
        self.tier_of.pop(page_hash, None)

    def check_node(self, node: TreeNode, is_root: bool) -> None:
        """Raise AssertionError if ``node``'s records or tier disagree with the index."""
        for k, page_hash in node.pages.items():
            if k not in self.owned_range(node) or self.owner.get(page_hash) is not node:
                raise AssertionError(f"page {k} recorded on a node that does not own it")
            if self.tier_of[page_hash] != self.where(page_hash):
                raise AssertionError(f"page {k}: recorded {self.tier_of[page_hash]!r}, now {self.where(page_hash)!r}")
        if is_root or node.slots:
            if node.tier != Tier.DEVICE:
                raise AssertionError("a node with device KV is not tier DEVICE")
            return
        if node.tier == Tier.DEVICE:
            raise AssertionError("a node without device KV is tier DEVICE")
        if node.host_lock == 0 and not self.is_whole(node):
            raise AssertionError("an unlocked node without device KV misses a page")
        if node.host_lock == 0 and not node.children and self.trimmed_len(node) != len(node.token_ids):
            raise AssertionError("a leaf without device KV has an untrimmed tail")

    def check_index(self, num_records: int) -> None:
        if len(self.owner) != num_records or set(self.owner) != set(self.tier_of):
            raise AssertionError("page owner index differs from the nodes' records")


class TieredTree:
    """`RadixTree`'s operations across tiers (a mixin: the tree's state, these methods).

    Device eviction (`_evict_device`), loads (`match_lower`, `lock_lower`), page moves from
    HiCache (`page_moved`) and the clean-up they share (`_tidy`, `_trim`).
    """

    root: TreeNode
    pool: BlockPool
    block_size: int
    pages: PageRecords
    evictable_leaves: set[TreeNode]
    on_evict: Callable[[TreeNode], dict[int, PageHash] | None] | None
    _num_cached_tokens: int

    def match_lower(self, token_ids: Sequence[int]) -> tuple[list[tuple[PageHash, Tier]], TreeNode | None]:
        """The pages that slot-less nodes hold right after the device match of `token_ids`,
        in order from the page holding the first non-device token, with their tiers; and the
        node owning the last of them (lock it with `lock_lower` while loading). Only pages
        wholly inside `token_ids` count; stops at the first page no node records. No change.

        # | device match (slots) | page | page | ... (recorded by slot-less nodes) | miss
        """
        ps = self.block_size
        node, i, nxt = self.root, 0, None
        found: list[tuple[PageHash, Tier]] = []
        handle = None
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            k = self._common_len(child.token_ids, token_ids, i)
            if not child.slots:
                nxt = child.depth // ps if nxt is None else nxt
                while nxt in child.pages and (nxt + 1) * ps <= i + k:
                    found.append((child.pages[nxt], self.pages.tier_of[child.pages[nxt]]))
                    nxt, handle = nxt + 1, child
                if nxt < self.pages.owned_range(child).stop:
                    break
            node, i = child, i + k
            if k < len(child.token_ids):
                break
        return found, handle

    def lock_lower(self, handle: TreeNode) -> None:
        """Keep `handle` and its ancestors in the tree (with their page records) while a load
        reads their pages, until `unlock_lower`."""
        node = self._attached(handle)
        while node is not None:
            node.host_lock += 1
            node = node.parent

    def unlock_lower(self, handle: TreeNode) -> None:
        """Drop a `lock_lower`; a slot-less node that lost a page meanwhile goes now."""
        node, chain = self._attached(handle), []
        while node is not None:
            assert node.host_lock > 0, "unlock_lower without lock_lower"
            node.host_lock -= 1
            chain.append(node)
            node = node.parent
        for node in chain:  # deepest first; a removal may take ancestors along (trim)
            if node is not self.root and node.parent is not None and not node.slots and node.host_lock == 0:
                self._tidy(node)

    def page_moved(self, page_hash: PageHash) -> None:
        """HiCache moved or dropped a page: update its owner's tier, and remove a slot-less
        owner that lost it (with its subtree), unless a load holds it (`unlock_lower` does)."""
        node = self.pages.moved(page_hash)
        if node is not None and node.host_lock == 0:
            self._tidy(node)

    def _adopt(self, node: TreeNode, slots: tuple[int, ...]) -> None:
        """Give a slot-less node device KV again (its page records stay: still backed up)."""
        node.slots = slots
        self.pool.incref(self._blocks_of(slots))
        self._num_cached_tokens += len(slots)
        self.pages.refresh(node)
        self._update_leaf_status(node)
        self._update_leaf_status(node.parent)

    def _evict_device(self, node: TreeNode) -> int:
        """Drop an evictable node's device KV. With the hook, it stays slot-less up to the end
        of its last page before the first one no tier holds (`_tidy`); without, it goes with
        its subtree. Returns the blocks freed."""
        assert self._is_evictable(node)
        parent = node.parent
        pages = self.on_evict(node) if self.on_evict is not None else None
        if pages is None:
            freed = self._remove_subtree(node)
            self._trim(parent)
            return freed
        blocks = self._blocks_of(node.slots)
        node.slots = ()
        self._num_cached_tokens -= len(node.token_ids)
        self.evictable_leaves.discard(node)
        freed = len(self.pool.decref(blocks))
        self.pages.record(node, pages)
        self._update_leaf_status(parent)
        self._tidy(node)
        return freed

    def _tidy(self, node: TreeNode) -> None:
        """A slot-less, unlocked node: cut it at the first page it misses (the rest and its
        subtree go; all of it when that is its first page), then trim it if a leaf."""
        owned = self.pages.owned_range(node)
        run = next((i for i, k in enumerate(owned) if k not in node.pages), len(owned))
        if run < len(owned):
            cut = (owned.start + run) * self.block_size - node.depth
            parent = node.parent
            if cut <= 0:
                self._remove_subtree(node)
                self._trim(parent)
                return
            upper = self._split(node, cut)  # node is now the part from the missing page on
            self._remove_subtree(node)
            node = upper
        self._trim(node)

    def _trim(self, node: TreeNode) -> None:
        """Cut a slot-less leaf back to its last page end, removing it if it owns no page;
        repeat on the parent it leaves a leaf."""
        while node is not self.root and not node.slots and not node.children and node.host_lock == 0:
            n = self.pages.trimmed_len(node)
            if n > 0:
                node.token_ids = node.token_ids[:n]
                return
            parent = node.parent
            self._remove_subtree(node)
            node = parent

    def _remove_subtree(self, top: TreeNode) -> int:
        """Remove `top` (slots allowed) and its slot-less subtree; returns the blocks freed."""
        parent = top.parent
        assert parent is not None and top.host_lock == 0
        del parent.children[top.token_ids[0]]
        freed, stack = 0, [top]
        while stack:
            node = stack.pop()
            node.parent = None  # a stale handle fails `_attached`
            assert node is top or not node.slots, "removing a subtree with device KV"
            self.evictable_leaves.discard(node)
            self.pages.release(node)
            self._num_nodes -= 1
            self._num_cached_tokens -= len(node.slots)
            freed += len(self.pool.decref(self._blocks_of(node.slots)))
            stack.extend(node.children.values())
        self._update_leaf_status(parent)
        return freed
