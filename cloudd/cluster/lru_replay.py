"""Prompt reuse over replicas whose prefix caches are bounded: a replay of a trace's prompts
through one least-recently-used block cache per replica, under the placements a router can make.

The regime that decides whether routing matters: once robots' histories outgrow a replica's KV
pool, what stays cached depends on where requests go. Each replica holds ``capacity`` blocks of
``block_size`` tokens, keyed by the chain of blocks before them (a block is reused only after
every block before it, as a paged prefix cache reuses it); a request reuses its leading cached
full blocks, at most all but its last token, then holds all its full blocks as the most recently
used (its first block most recent of all, so a prefix outlives its continuations). Placements:

- ``random``: uniform, what a router that ignores prompts and load reaches on average;
- ``pow2``: the less loaded of two random replicas, load being the requests placed among the
  last ``POW2_WINDOW`` (Ray Serve's default router, its in-flight counts taken as recent work);
- ``robot``: each robot always on the replica its name hashes to (the fleet router's affinity);
- ``combined``: one replica with every replica's pool (what perfect routing could match).

Outputs are unknown without the model and are left out, as in ``reuse_ceiling``.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

POW2_WINDOW = 32  # requests whose placement counts as a replica's current load


class BlockLRU:
    """One replica's prefix cache: at most ``capacity`` blocks, least recently used evicted first."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError(f"capacity and block_size must be >= 1, got {capacity} and {block_size}")
        self.capacity, self.block_size = capacity, block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()  # block key, least recently used first

    def serve(self, ids: Sequence[int]) -> int:
        """Run one prompt: the tokens it reuses; afterwards its full blocks are cached."""
        keys, parent = [], 0
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(ids[start:start + self.block_size])))
            keys.append(parent)
        cached = next((i for i, key in enumerate(keys) if key not in self._blocks), len(keys))
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return min(cached * self.block_size, len(ids) - 1)


def replay_hit_rate(prompts: Sequence[Sequence[int]], placement: Sequence[int], capacity: int,
                    block_size: int) -> float:
    """Reused prompt tokens over all prompt tokens when request ``i`` runs on replica
    ``placement[i]``, each replica's cache holding ``capacity`` blocks."""
    caches: dict[int, BlockLRU] = {}
    reused = sum(caches.setdefault(replica, BlockLRU(capacity, block_size)).serve(ids)
                 for ids, replica in zip(prompts, placement, strict=True))
    return reused / max(sum(map(len, prompts)), 1)


def random_placement(n: int, replicas: int, rng: random.Random) -> list[int]:
    return [rng.randrange(replicas) for _ in range(n)]


def pow2_placement(n: int, replicas: int, rng: random.Random) -> list[int]:
    """The less loaded of two distinct random replicas (ties: the first drawn)."""
    if replicas == 1:
        return [0] * n
    recent: deque[int] = deque(maxlen=POW2_WINDOW)
    placement = []
    for _ in range(n):
        a, b = rng.sample(range(replicas), 2)
        choice = b if recent.count(b) < recent.count(a) else a
        recent.append(choice)
        placement.append(choice)
    return placement


def robot_placement(robots: Sequence[str], replicas: int) -> list[int]:
    """Each robot on the replica its name hashes to (stable across runs and processes)."""
    return [int.from_bytes(hashlib.sha1(robot.encode()).digest()[:8], "big") % replicas for robot in robots]


@dataclass(frozen=True)
class BoundedReuse:
    """Hit rates of one pool size; ``random`` and ``pow2`` are means over seeds."""

    pool_frac: float
    capacity_blocks: int  # per replica
    random: float
    pow2: float
    robot: float
    combined: float  # one replica holding ``replicas * capacity_blocks``

    @property
    def affinity_gain(self) -> float:
        """How far robot affinity gets above pow2."""
        return self.robot - self.pow2


def bounded_reuse(prompts: Sequence[Sequence[int]], robots: Sequence[str], replicas: int, pool_frac: float,
                  capacity_blocks: int, block_size: int, seeds: int = 5) -> BoundedReuse:
    """Every placement's hit rate with ``capacity_blocks`` per replica. ValueError for replicas
    or seeds below 1."""
    if replicas < 1 or seeds < 1:
        raise ValueError(f"replicas and seeds must be >= 1, got {replicas} and {seeds}")
    n = len(prompts)

    def mean_over_seeds(place) -> float:
        return sum(replay_hit_rate(prompts, place(n, replicas, random.Random(seed)), capacity_blocks, block_size)
                   for seed in range(seeds)) / seeds

    return BoundedReuse(
        pool_frac, capacity_blocks,
        random=mean_over_seeds(random_placement),
        pow2=mean_over_seeds(pow2_placement),
        robot=replay_hit_rate(prompts, robot_placement(robots, replicas), capacity_blocks, block_size),
        combined=replay_hit_rate(prompts, [0] * n, replicas * capacity_blocks, block_size))
