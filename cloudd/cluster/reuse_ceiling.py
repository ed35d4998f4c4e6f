"""How much prompt reuse a placement of a trace's requests over replicas can reach with caches
that never evict: one replica holding every earlier prompt (no router can place a request where
more of it is cached) against random placement (on average what a router that ignores prompts,
Ray's power-of-two, reaches).

    python -m cloudd.cluster.reuse_ceiling --trace ../shared/workloads/fleet-1024.jsonl --limit 64,256,512,1024

Prompts are the requests' chat templates tokenized as the engine tokenizes them; a request
reuses the longest prefix of its prompt that an earlier request on its replica sent, at most
all but its last token (which the engine always computes), as a token-exact radix cache with
room for everything would. Outputs are unknown without running the model and are left out on
both sides. ``cloudd bench --cluster`` measures the real thing (finite caches, Ray's router);
this bounds what any router could show on the same requests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from cloudd.trace import load_trace


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
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    from shared.model.checkpoint import load_tokenizer
    from shared.model.fetch import ensure_default_model

    try:
        limits = [int(n) for n in args.limit.split(",")]
        tokenizer = load_tokenizer(args.model or ensure_default_model())
        requests = load_trace(args.trace, max(limits))
        prompts = [tokenizer.encode_chat(list(r.messages)) for r in requests]
        runs = {str(n): reuse_bounds(prompts[:n], args.replicas, args.seeds) for n in limits}
    except (OSError, ValueError) as e:
        print(f"reuse_ceiling: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"trace": str(args.trace), "runs": {
            n: asdict(b) | {"router_headroom": b.router_headroom} for n, b in runs.items()}}))
        return 0
    print(f"{'requests':>8} {'one replica':>12} {'random over ' + str(args.replicas):>16} {'headroom':>9}")
    for b in runs.values():
        print(f"{b.requests:>8} {b.one_replica:>12.3f} {b.random_placement:>16.3f} {b.router_headroom:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
