"""The host tier's bookkeeping: pages of host memory keyed by their content hash, LRU.

A page holds one full KV block (block_size tokens, every layer) of some token sequence; its
key is the sequence's chained page hash (`page_hash.page_hashes`), so identical pages are
stored once. Pure Python over page ids: the bytes live in `TierCopier.host`.

Lock refs: an op in flight that reads or writes a page holds a lock on it; a locked page is
never chosen as an eviction victim, so its id is not reused under the op.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PageHash = bytes


@dataclass(frozen=True)
class HostAlloc:
    page: int  # the host page now keyed by the new hash
    evicted: PageHash | None  # the hash whose data sat in `page` (spill it first), or None


class HostPagePool:
    """LRU page store: ``lookup`` touches, ``allocate`` takes a free page or the least
    recently used unlocked one."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the host pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._by_hash: OrderedDict[PageHash, int] = OrderedDict()  # oldest first
        self._hash_of: dict[int, PageHash] = {}
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self._locks: dict[int, int] = {}
        self._orphans: set[int] = set()  # discarded while locked: freed on the last unlock

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, page_hash: PageHash) -> bool:
        return page_hash in self._by_hash

    def lookup(self, page_hash: PageHash) -> int | None:
        """The page keyed by ``page_hash`` (now most recently used), or None."""
        page = self._by_hash.get(page_hash)
        if page is not None:
            self._by_hash.move_to_end(page_hash)
        return page

    def allocate(self, page_hash: PageHash, evict: bool = True) -> HostAlloc | None:
        """Key a page by ``page_hash`` (which must be absent): a free page, else (``evict``) the
        LRU unlocked one. None when every page is locked (or none is free and not ``evict``)."""
        assert page_hash not in self._by_hash, "page already stored"
        evicted = None
        if self._free:
            page = self._free.pop()
        elif evict and (victim := self._lru_unlocked()) is not None:
            evicted, page = victim, self._by_hash.pop(victim)
        else:
            return None
        self._by_hash[page_hash] = page
        self._hash_of[page] = page_hash
        return HostAlloc(page, evicted)

    def discard(self, page_hash: PageHash) -> None:
        """Forget ``page_hash`` (its data is bad or gone); its page is freed once unlocked."""
        page = self._by_hash.pop(page_hash, None)
        if page is None:
            return
        del self._hash_of[page]
        if self._locks.get(page):
            self._orphans.add(page)
        else:
            self._free.append(page)

    def lock(self, page: int) -> None:
        self._locks[page] = self._locks.get(page, 0) + 1

    def unlock(self, page: int) -> None:
        count = self._locks[page]
        assert count > 0, "unlock without lock"
        if count == 1:
            del self._locks[page]
            if page in self._orphans:
                self._orphans.remove(page)
                self._free.append(page)
        else:
            self._locks[page] = count - 1

    def is_locked(self, page: int) -> bool:
        return page in self._locks

    def _lru_unlocked(self) -> PageHash | None:
        for page_hash, page in self._by_hash.items():
            if page not in self._locks:
                return page_hash
        return None

    def check_integrity(self) -> None:
        """Raise AssertionError if keyed, orphaned and free pages do not partition the pool."""
        keyed = set(self._by_hash.values())
        free = set(self._free)
        if len(keyed) != len(self._by_hash) or len(free) != len(self._free):
            raise AssertionError("a page is keyed or freed twice")
        if keyed & free or keyed & self._orphans or free & self._orphans:
            raise AssertionError("a page is in two states")
        if len(keyed) + len(free) + len(self._orphans) != self.num_pages:
            raise AssertionError("pages leaked")
        if any(self._hash_of[p] != h for h, p in self._by_hash.items()) or len(self._hash_of) != len(keyed):
            raise AssertionError("hash_of disagrees with by_hash")
        if any(c <= 0 for c in self._locks.values()) or not self._orphans <= set(self._locks):
            raise AssertionError("bad lock counts or an unlocked orphan")
