"""Token-exact radix tree over KV slots (SGLang's RadixCache, mini-sglang's size).

Each edge carries token ids and the KV slot of each token. A match may end in the middle of
an edge: token-exact reuse, where the caller shares the full aligned blocks and copies the
partial last one.

Pool refs: the tree holds ONE ref per (node, block) pair, for every block in which the node
has at least one slot. Splitting a node inside a block gives both halves a slot in it, hence
one extra ref; deleting a node drops each of its refs.

Tiers (HiCache): a node's KV lives on the device (``slots``) and/or in host/disk pages
(``pages``, `radix_tiers.PageRecords`; ``tier`` is the fastest place it can be used from).
Device eviction drops a node's slots; with ``on_evict`` set, a node whose owned pages are
backed up stays in the tree without slots (cut before its first page that is not, the rest
going with its slot-less subtree); without it, the node goes with its subtree as before.
A node with slots has a parent with slots, so the device part of a match is a prefix.

Lock refs, per tier: `lock(node)` (device KV in use by a request) and `lock_lower(node)`
(pages in use by a load) each add one to the node and every ancestor, root included, so a
parent's count >= the sum of its children's. A device-locked node keeps its slots; a
host-locked node is not removed from the tree (its pages are locked in the host pool too).
`evictable_leaves` (slots, no child with slots, unlocked, unpinned, not root) is kept
incrementally, so `evict` never walks the whole tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.engine.kv.block_pool import NULL_BLOCK, BlockPool
from shared.engine.kv.prefix_cache import PrefixMatch
from shared.engine.kv.radix_tiers import PageHash, PageRecords, TieredTree
from shared.engine.kv.tier_ops import Tier

_node_ids = itertools.count()


@dataclass(slots=True, eq=False)
class TreeNode:
    token_ids: tuple[int, ...]  # edge label into this node
    slots: tuple[int, ...]  # KV slot of each token on the edge; same length, or () off the device
    parent: TreeNode | None
    children: dict[int, TreeNode] = field(default_factory=dict)  # keyed by first token
    depth: int = 0  # position of the edge's first token in the sequence
    pages: dict[int, PageHash] = field(default_factory=dict)  # owned page index -> host/disk hash
    tier: Tier = Tier.DEVICE  # where its KV is used from: DEVICE iff slots
    lock_ref: int = 0  # device locks: handles locked at or below this node
    host_lock: int = 0  # lower-tier locks: loads reading pages at or below this node
    pin_count: int = 0  # pin() calls ending exactly at this node
    last_access: int = 0  # RadixTree clock tick, not wall time
    node_id: int = field(default_factory=lambda: next(_node_ids))  # heap tie-break


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (compares 64-token slices in C first)."""
    n = min(len(a), len(b))
    i = 0
    while i + 64 <= n and list(a[i : i + 64]) == list(b[i : i + 64]):
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_len(edge: tuple[int, ...], token_ids: Sequence[int], start: int) -> int:
    """Length of the common prefix of `edge` and `token_ids[start:]`."""
    return common_prefix_len(edge, token_ids[start : start + len(edge)])


class RadixTree(TieredTree):
    """Token-exact prefix cache implementing `PrefixCache`.

    Handles are `TreeNode`s. `match` does NOT split (so it never changes ref counts): its
    handle is the node containing the last matched device token, and locking it protects that
    whole node. `insert` and `pin` split, so their node ends exactly at the sequence's end.
    Splits keep the original node object as the lower half, so a handle stays valid across
    splits; a handle becomes invalid only when its node is removed, which needs it unlocked.
    """

    _common_len = staticmethod(_common_len)

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root = TreeNode(token_ids=(), slots=(), parent=None)
        self.evictable_leaves: set[TreeNode] = set()
        self.pages = PageRecords(pool.block_size)
        self._num_cached_tokens = 0  # tokens with device slots
        self._num_nodes = 0
        self._clock = 0
        # Called with each node about to lose its device KV, while its blocks are still held
        # (HiCache write-back copies them down here). Returns {page index: hash} of the pages
        # it owns (`PageRecords.owned_range`) that a lower tier holds: the node stays slot-less
        # up to its first page missing there (`_tidy`). No hook: the node is removed.
        self.on_evict: Callable[[TreeNode], dict[int, PageHash] | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV is on the device."""
        return self._num_cached_tokens

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root (those without device KV included)."""
        return self._num_nodes

    # ---- PrefixCache -------------------------------------------------------------------

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest device-resident prefix of `token_ids`; may end inside an edge.

        Refreshes access times along the path; no split, no ref or lock change. Lock the
        handle before using the slots (and before any evict). `match_lower` gives what the
        lower tiers hold past it.
        """
        tick = self._tick()
        node, i, slots = self.root, 0, []
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None or not child.slots:
                break
            k = _common_len(child.token_ids, token_ids, i)
            child.last_access = tick
            slots.extend(child.slots[:k])
            node, i = child, i + k
            if k < len(child.token_ids):
                break
        return PrefixMatch(num_tokens=i, slots=tuple(slots), handle=node)

    def lock(self, handle: object) -> None:
        node = self._attached(handle)
        while node is not None:
            node.lock_ref += 1
            node = node.parent
        self._update_leaf_status(handle)

    def unlock(self, handle: object) -> None:
        node = self._attached(handle)
        while node is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            node = node.parent
        self._update_leaf_status(handle)

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> TreeNode:
        """Cache `token_ids` with KV at `slots`; returns the (unlocked) node ending there.

        Tokens cached on the device keep their slots (the caller's duplicates stay the
        caller's to free); slot-less nodes on the path take the caller's slots (a load or a
        recompute brought them back). New device KV takes one pool ref per block; a split
        inside a block takes one more. Raises ValueError if lengths differ or a slot is not
        block-aligned or is in NULL_BLOCK.
        """
        self._check_slots(token_ids, slots)
        tick = self._tick()
        node, i = self.root, 0
        node.last_access = tick
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                return self._add_leaf(node, tuple(token_ids[i:]), tuple(slots[i:]), tick)
            k = _common_len(child.token_ids, token_ids, i)
            if k < len(child.token_ids):
                child = self._split(child, k)
            if not child.slots:
                self._adopt(child, tuple(slots[i : i + k]))
            child.last_access = tick
            node, i = child, i + k
        return node

    def evict(self, num_blocks: int) -> int:
        """Drop the device KV of LRU evictable nodes until `num_blocks` blocks reached ref 0.

        A node whose blocks a request still holds frees nothing, so more nodes than
        `num_blocks` may go. A parent left without device children joins the candidates.
        Returns the number of blocks freed.
        """
        if num_blocks <= 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            if leaf not in self.evictable_leaves:  # a page move removed or changed it
                continue
            parent = leaf.parent
            freed += self._evict_device(leaf)
            if parent in self.evictable_leaves:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    # ---- pinning -------------------------------------------------------------------------

    def pin(self, token_ids: Sequence[int]) -> None:
        """Never evict `token_ids` (e.g. a daemon's system prompt) until `unpin`.

        The sequence must already be cached (ValueError otherwise). Splits so a node ends
        exactly at len(token_ids); pinning that node protects its ancestors too.
        """
        node = self._find_exact(token_ids, split=True)
        node.pin_count += 1
        self._update_leaf_status(node)

    def unpin(self, token_ids: Sequence[int]) -> None:
        node = self._find_exact(token_ids, split=False)
        if node.pin_count == 0:
            raise ValueError("sequence is not pinned")
        node.pin_count -= 1
        self._update_leaf_status(node)

    def path_tokens(self, node: TreeNode) -> list[int]:
        """The whole sequence from the root to the end of ``node``'s edge."""
        edges = []
        while node is not None:
            edges.append(node.token_ids)
            node = node.parent
        return [t for edge in reversed(edges) for t in edge]

    # ---- integrity -----------------------------------------------------------------------

    def block_refs(self) -> dict[int, int]:
        """Pool refs the tree holds, per block: one per (node, block) pair."""
        refs: dict[int, int] = {}
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            for block_id in self._blocks_of(node.slots):
                refs[block_id] = refs.get(block_id, 0) + 1
            stack.extend(node.children.values())
        return refs

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree, its leaf set, its page records or its pool refs
        are inconsistent."""
        seen_slots: set[int] = set()
        evictable: set[TreeNode] = set()
        num_tokens = num_nodes = num_records = 0
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            self._check_node(node, depth, seen_slots)
            num_records += len(node.pages)
            if node is not self.root:
                num_nodes += 1
                num_tokens += len(node.slots)
                if self._is_evictable(node):
                    evictable.add(node)
            for child in node.children.values():
                stack.append((child, depth + len(node.token_ids)))
        if evictable != self.evictable_leaves:
            raise AssertionError("evictable_leaves differs from a fresh recomputation")
        if (num_tokens, num_nodes) != (self._num_cached_tokens, self._num_nodes):
            raise AssertionError(f"counters {self._num_cached_tokens}, {self._num_nodes} stale")
        self.pages.check_index(num_records)
        for block_id, count in self.block_refs().items():
            if self.pool.ref_count(block_id) < count:
                raise AssertionError(f"block {block_id}: pool ref < {count} tree refs")
        self.pool.check_integrity()

    def _check_node(self, node: TreeNode, depth: int, seen_slots: set[int]) -> None:
        bs, is_root = self.block_size, node is self.root
        if node.slots and len(node.token_ids) != len(node.slots):
            raise AssertionError("token_ids and slots differ in length")
        if not is_root and not node.token_ids:
            raise AssertionError("empty non-root node")
        if node.depth != depth:
            raise AssertionError(f"depth {node.depth} recorded at position {depth}")
        if node.slots and node.parent is not self.root and not node.parent.slots:
            raise AssertionError("a node with slots under a node without")
        for name in ("lock_ref", "host_lock"):
            if getattr(node, name) < sum(getattr(c, name) for c in node.children.values()):
                raise AssertionError(f"{name} below the sum of the children's")
        if node.lock_ref < 0 or node.pin_count < 0 or (node.lock_ref and not node.slots and not is_root):
            raise AssertionError("negative lock_ref or pin_count, or a device lock without slots")
        for key, child in node.children.items():
            if child.parent is not node or child.token_ids[0] != key:
                raise AssertionError(f"child keyed {key} is misplaced")
            if child.slots and child.last_access > node.last_access and not is_root:
                raise AssertionError("child accessed after its parent")
        for offset, slot in enumerate(node.slots):
            if slot % bs != (depth + offset) % bs or slot // bs == NULL_BLOCK:
                raise AssertionError(f"slot {slot} misaligned at position {depth + offset}")
            if slot in seen_slots:
                raise AssertionError(f"slot {slot} cached twice")
            seen_slots.add(slot)
        self.pages.check_node(node, is_root)

    # ---- internals -----------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _blocks_of(self, slots: Sequence[int]) -> list[int]:
        """Distinct blocks of `slots`, in order."""
        return list(dict.fromkeys(s // self.block_size for s in slots))

    def _is_evictable(self, node: TreeNode) -> bool:
        return (
            node is not self.root
            and bool(node.slots)
            and node.lock_ref == 0
            and node.pin_count == 0
            and not any(c.slots for c in node.children.values())
        )

    def _update_leaf_status(self, node: TreeNode) -> None:
        if self._is_evictable(node):
            self.evictable_leaves.add(node)
        else:
            self.evictable_leaves.discard(node)

    def _attached(self, handle: object) -> TreeNode:
        assert isinstance(handle, TreeNode), f"not a RadixTree handle: {handle!r}"
        assert handle is self.root or (
            handle.parent is not None and handle.parent.children.get(handle.token_ids[0]) is handle
        ), "handle was evicted: lock it before calling evict()"
        return handle

    def _check_slots(self, token_ids: Sequence[int], slots: Sequence[int]) -> None:
        if len(token_ids) != len(slots):
            raise ValueError(f"{len(token_ids)} token_ids but {len(slots)} slots")
        bs = self.block_size
        for pos, slot in enumerate(slots):
            if slot % bs != pos % bs or slot // bs == NULL_BLOCK or slot < 0:
                raise ValueError(f"slot {slot} at position {pos} is not a block-aligned slot")

    def _add_leaf(
        self, parent: TreeNode, token_ids: tuple[int, ...], slots: tuple[int, ...], tick: int
    ) -> TreeNode:
        depth = parent.depth + len(parent.token_ids)
        leaf = TreeNode(token_ids=token_ids, slots=slots, parent=parent, depth=depth, last_access=tick)
        self.pool.incref(self._blocks_of(slots))
        parent.children[token_ids[0]] = leaf
        self._num_nodes += 1
        self._num_cached_tokens += len(token_ids)
        self._update_leaf_status(parent)
        self._update_leaf_status(leaf)
        return leaf

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node`'s edge after k tokens; returns the new upper node.

        # | upper: token_ids[:k] | node: token_ids[k:] |
        # 0                      k                     len
        `node` keeps its identity (handles, pins, children) as the lower half. A block with
        slots on both sides of the cut gains one ref; page records go to the half holding
        the page's last token.
        """
        assert 0 < k < len(node.token_ids)
        parent = node.parent
        assert parent is not None
        upper = TreeNode(
            token_ids=node.token_ids[:k],
            slots=node.slots[:k],
            parent=parent,
            depth=node.depth,
            lock_ref=node.lock_ref,
            host_lock=node.host_lock,
            last_access=node.last_access,
        )
        node.token_ids, node.slots, node.depth = node.token_ids[k:], node.slots[k:], node.depth + k
        shared = set(self._blocks_of(upper.slots)) & set(self._blocks_of(node.slots))
        self.pool.incref(sorted(shared))
        upper.children[node.token_ids[0]] = node
        node.parent = upper
        parent.children[upper.token_ids[0]] = upper
        self.pages.split(upper, node)
        self._num_nodes += 1
        return upper

    def _find_exact(self, token_ids: Sequence[int], split: bool) -> TreeNode:
        """The node ending exactly at len(token_ids); ValueError if not fully cached on the device."""
        if not token_ids:
            raise ValueError("empty sequence")
        node, i = self.root, 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            k = 0 if child is None else _common_len(child.token_ids, token_ids, i)
            if child is None or not child.slots or (k < len(child.token_ids) and i + k < len(token_ids)):
                raise ValueError("sequence is not fully cached")
            if k < len(child.token_ids):
                if not split:
                    raise ValueError("no node ends at this sequence (it was never pinned)")
                child = self._split(child, k)
            node, i = child, i + k
        return node
