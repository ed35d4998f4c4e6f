"""Page keys for the host and disk tiers: the chained hash of each full KV block.

Page k of a sequence holds positions [k * page_size, (k + 1) * page_size); its key is
``chain_hash(key of page k - 1, tokens of page k)`` (`hashed.chain_hash`), so a key names the
whole prefix up to the page's end and identical prefixes share keys across requests and runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shared.engine.kv.hashed import NONE_HASH, chain_hash


def extend_page_hashes(hashes: list[bytes], tokens: Callable[[int, int], Sequence[int]], num_pages: int,
                       page_size: int) -> list[bytes]:
    """Grow ``hashes`` (the keys of a sequence's first pages) to ``num_pages`` keys, in place.

    ``tokens(start, end)`` returns the sequence's tokens in [start, end). Returns ``hashes``.
    """
    parent = hashes[-1] if hashes else NONE_HASH
    for k in range(len(hashes), num_pages):
        parent = chain_hash(parent, tuple(tokens(k * page_size, (k + 1) * page_size)))
        hashes.append(parent)
    return hashes


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The keys of every full page of ``token_ids``."""
    return extend_page_hashes([], lambda a, b: token_ids[a:b], len(token_ids) // page_size, page_size)
