"""How much prompt reuse a placement of a trace's requests over replicas can reach with caches
that never evict: one replica holding every earlier prompt (no router can place a request where
more of it is cached) against random placement (on average what a router that ignores prompts,
Ray's power-of-two, reaches).

    python -m cloudd.cluster.reuse_ceiling --trace ../shared/workloads/fleet-1024.jsonl --limit 64,256,512,1024
    python -m cloudd.cluster.reuse_ceiling --trace ../shared/workloads/fleet-returning.jsonl --pool-frac 0.1,0.2,0.3

Prompts are the requests' chat templates tokenized as the engine tokenizes them; a request
reuses the longest prefix of its prompt that an earlier request on its replica sent, at most
all but its last token (which the engine always computes), as a token-exact radix cache with
room for everything would. Outputs are unknown without running the model and are left out on
both sides. ``cloudd bench --cluster`` measures the real thing (finite caches, Ray's router);
this bounds what any router could show on the same requests.

With ``--pool-frac`` it also replays the prompts through bounded LRU caches
(``cloudd.cluster.lru_replay``), each replica's pool that fraction of the requests' working set
as ``cloudd bench --cluster --device-pool-frac`` sizes it, and prints each placement's hit rate:
the regime where caches evict and the router decides what stays cached.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from cloudd.cluster.lru_replay import BoundedReuse, bounded_reuse
from cloudd.trace import load_trace
from cloudd.working_set import pool_blocks, pool_tokens, working_set_tokens


class PromptTrie:
    """Every prompt inserted, as a token-exact prefix tree."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}

    def insert(self, ids: Sequence[int]) -> int:
        """Add ``ids``; returns how many of its leading tokens an earlier prompt already had."""
        node, shared = self._root, 0
        for token in ids:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
            else:
                shared += 1
            node = child
        return shared


def hit_rate(prompts: Sequence[Sequence[int]], placement: Sequence[int]) -> float:
    """Reused prompt tokens over all prompt tokens when request ``i`` runs on replica ``placement[i]``."""
    caches: dict[int, PromptTrie] = {}
    reused = 0
    for ids, replica in zip(prompts, placement, strict=True):
        reused += min(caches.setdefault(replica, PromptTrie()).insert(ids), len(ids) - 1)
    return reused / max(sum(map(len, prompts)), 1)


@dataclass(frozen=True)
class ReuseBounds:
    requests: int
    one_replica: float  # the most any placement over any number of replicas reaches
    random_placement: float  # mean over seeds of uniformly random placement over ``replicas``
    replicas: int

    @property
    def router_headroom(self) -> float:
        """How far above random placement any router can get."""
        return self.one_replica - self.random_placement


def reuse_bounds(prompts: Sequence[Sequence[int]], replicas: int, seeds: int = 5) -> ReuseBounds:
    """Both hit rates over ``prompts`` in order. Raises ValueError for replicas or seeds below 1."""
    if replicas < 1 or seeds < 1:
        raise ValueError(f"replicas and seeds must be >= 1, got {replicas} and {seeds}")
    one = hit_rate(prompts, [0] * len(prompts))
    spread = [hit_rate(prompts, [rng.randrange(replicas) for _ in prompts])
              for rng in (random.Random(seed) for seed in range(seeds))]
    return ReuseBounds(len(prompts), one, sum(spread) / seeds, replicas)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloudd.cluster.reuse_ceiling", description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--limit", default="1024", help="comma list: the first N requests of the trace, each a run")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=5, help="random placements averaged")
    parser.add_argument("--model", type=Path, default=None, help="GGUF or HF folder whose tokenizer counts tokens "
                                                                  "(default: the embedded default model)")
    parser.add_argument("--pool-frac", default="",
                        help="comma list: also replay with bounded LRU caches, each replica's pool this fraction of "
                             "the largest --limit's working set")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per cached block (bounded replay)")
    parser.add_argument("--output-len", type=int, default=8,
                        help="a pool never holds less than the longest prompt plus this (as the bench sizes it)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    from shared.model.checkpoint import load_tokenizer
    from shared.model.fetch import ensure_default_model

    try:
        limits = [int(n) for n in args.limit.split(",")]
        fracs = [float(f) for f in args.pool_frac.split(",") if f]
        tokenizer = load_tokenizer(args.model or ensure_default_model())
        requests = load_trace(args.trace, max(limits))
        prompts = [tokenizer.encode_chat(list(r.messages)) for r in requests]
        runs = {str(n): reuse_bounds(prompts[:n], args.replicas, args.seeds) for n in limits}
        working_set, longest = working_set_tokens(prompts), max(map(len, prompts)) + args.output_len
        bounded = {str(f): bounded_reuse(prompts, [r.robot for r in requests], args.replicas, f,
                                         pool_blocks(pool_tokens(f, working_set, longest), args.block_size),
                                         args.block_size, args.seeds) for f in fracs}
    except (OSError, ValueError) as e:
        print(f"reuse_ceiling: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"trace": str(args.trace), "runs": {
            n: asdict(b) | {"router_headroom": b.router_headroom} for n, b in runs.items()},
            "bounded": {f: asdict(b) | {"affinity_gain": b.affinity_gain} for f, b in bounded.items()}}))
        return 0
    print(f"{'requests':>8} {'one replica':>12} {'random over ' + str(args.replicas):>16} {'headroom':>9}")
    for b in runs.values():
        print(f"{b.requests:>8} {b.one_replica:>12.3f} {b.random_placement:>16.3f} {b.router_headroom:>9.3f}")
    if bounded:
        _print_bounded(bounded.values(), len(requests), args.replicas)
    return 0


def _print_bounded(rows: Iterable[BoundedReuse], requests: int, replicas: int) -> None:
    print(f"\nbounded LRU, {requests} requests over {replicas} replicas:")
    print(f"{'pool/replica':>12} {'blocks':>7} {'random':>7} {'pow2':>7} {'robot':>7} {'combined':>9}")
    for b in rows:
        print(f"{b.pool_frac:>12.0%} {b.capacity_blocks:>7} {b.random:>7.3f} {b.pow2:>7.3f} {b.robot:>7.3f} "
              f"{b.combined:>9.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
