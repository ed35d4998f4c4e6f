"""The contract every prefix index satisfies (`RadixTree`, `HashedBlockIndex`).

An index maps token prefixes to the KV slots that hold them. It holds pool refs for the
blocks it references and lock counts for entries a request is using; it never allocates.

The caller's flow (the KV manager):

    m = idx.match(prompt)          # touches LRU only
    idx.lock(m.handle)             # before any evict(); m.slots are safe while locked
    # incref the full, aligned blocks of m.slots it shares; copy the rest into new blocks
    h = idx.insert(tokens, slots)  # after computing more tokens
    idx.lock(h); idx.unlock(m.handle)
    # on finish: insert(prompt + output), unlock, decref the request's own block refs

Requests hold their own pool refs, so eviction never frees a block a request still uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

# An index's entry, opaque to its callers (a `RadixTree`'s node, a `HashedBlockIndex`'s block
# tuple): pass it back to lock()/unlock().
PrefixHandle: TypeAlias = object


@dataclass(frozen=True)
class PrefixMatch:
    num_tokens: int  # tokens matched from the start of the query
    slots: tuple[int, ...]  # KV slot of each matched token; len == num_tokens
    handle: PrefixHandle


class PrefixCache(Protocol):
    block_size: int

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of `token_ids` (num_tokens 0 on a miss).

        Touches LRU; never changes ref counts or locks. The slots are safe to use only after
        `lock(result.handle)`, which must come before any `evict()`.
        """
        ...

    def lock(self, handle: PrefixHandle) -> None:
        """Protect the entries behind `handle` from eviction until `unlock(handle)`."""
        ...

    def unlock(self, handle: PrefixHandle) -> None: ...

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> PrefixHandle:
        """Cache `token_ids`, whose KV sits at `slots` (one per token, block-aligned).

        Entries already cached keep their slots; the caller's duplicates are not referenced.
        Takes one pool ref per block it newly references. Returns the (unlocked) handle of
        the whole inserted sequence.
        """
        ...

    def evict(self, num_blocks: int) -> int:
        """Drop LRU unlocked, unpinned entries until `num_blocks` blocks went back to the
        pool's free queue or nothing is evictable. Returns the number freed (may exceed the
        request; evict(0) is a no-op)."""
        ...

    @property
    def num_cached_tokens(self) -> int: ...

    def block_refs(self) -> dict[int, int]:
        """Pool refs this index holds, per block (for exact leak checks)."""
        ...

    def check_integrity(self) -> None: ...
