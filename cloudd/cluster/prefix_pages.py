"""An approximate radix tree of what each replica served, as prompt pages.

A prompt's text (chat messages with their roles, or its token ids written out) is cut into
pages of ``PAGE_CHARS`` characters; each page's key is a digest of everything up to its end, so
equal keys mean equal prefixes (the chain of vLLM's block hashes, over text). A replica's pages
are an LRU set; a request's match on a replica is how many of its leading pages that set holds.
It is approximate as SGLang's router's tree is: it does not know what the replica's own cache
evicted, and it counts characters, not tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

PAGE_CHARS = 64


def routing_text(messages: Sequence[tuple[str, str]], prompt_ids: Sequence[int]) -> str:
    """The text a request's prefix is judged by: its messages' roles and contents, or its ids."""
    if messages:
        return "".join(f"\x1e{role}\x1f{content}" for role, content in messages)
    return ",".join(map(str, prompt_ids))


def page_keys(text: str, page_chars: int = PAGE_CHARS) -> list[bytes]:
    """One key per full page of ``text``: a digest of the whole prefix up to the page's end."""
    keys, digest = [], hashlib.blake2b(digest_size=12)
    for end in range(page_chars, len(text) + 1, page_chars):
        digest.update(text[end - page_chars:end].encode("utf-8", "surrogatepass"))
        keys.append(digest.copy().digest())
    return keys


class ReplicaPages:
    """The pages one replica has served, least recently used first out beyond ``capacity``."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._pages: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading pages of ``keys`` this replica has served."""
        n = 0
        for key in keys:
            if key not in self._pages:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._pages[key] = None
            self._pages.move_to_end(key)
        while len(self._pages) > self.capacity:
            self._pages.popitem(last=False)

    def __len__(self) -> int:
        return len(self._pages)
