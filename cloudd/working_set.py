"""How much KV memory a replay needs, and a pool sized as a fraction of it: what ``cloudd bench
--device-pool-frac`` (one engine), ``cloudd bench --cluster --device-pool-frac`` (each replica)
and ``cloudd.cluster.reuse_ceiling --pool-frac`` (the bounded-LRU prediction) all size by.
Torch-free."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shared.engine.kv.radix import common_prefix_len


def working_set_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens a prefix cache needs to hold every prompt at once: the size of their trie (in
    sorted order each prompt adds what it does not share with its predecessor)."""
    ordered = sorted(map(list, prompts))
    return sum(len(p) - (common_prefix_len(p, q) if i else 0)
               for i, (p, q) in enumerate(zip(ordered, [[]] + ordered[:-1], strict=True)))


def pool_tokens(frac: float, working_set: int, longest_request: int) -> float:
    """``frac`` of a replay's ``working_set`` (``working_set_tokens``), never below its longest
    request (prompt plus output), which must fit a pool to run at all. ValueError unless
    0 < frac <= 1."""
    if not 0 < frac <= 1:
        raise ValueError(f"--device-pool-frac must be in (0, 1], got {frac}")
    return max(frac * working_set, longest_request)


def pool_blocks(tokens: float, block_size: int) -> int:
    """Whole blocks of ``block_size`` tokens holding ``tokens``."""
    return math.ceil(tokens / block_size)
