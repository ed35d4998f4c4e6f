"""The radix tree as the tiers' primary index, with the real HiCache and copier: a device-
evicted node stays with tier host, turns disk when the host pool spills it, and a returning
request's load is found through it."""

from __future__ import annotations

import torch

from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.disk_tier import DiskTier
from shared.engine.kv.hicache import HiCache
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.kv.manager import KVCacheManager
from shared.engine.kv.radix import RadixTree
from shared.engine.kv.tier_copier import TierCopier
from shared.engine.kv.tier_ops import Tier
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams

BS = 4


def make(tmp_path, host_pages: int) -> tuple[KVCacheManager, HiCache]:
    kv = [(torch.zeros(24, BS, 1, 2), torch.zeros(24, BS, 1, 2)) for _ in range(2)]
    pool = BlockPool(24, BS)
    disk = DiskTier(tmp_path)
    tiers = HiCache(HiCacheConfig(enabled=True, min_load_tokens=0), pool, TierCopier(kv, host_pages, disk),
                    host_pages, disk, lambda n: 0.0)
    return KVCacheManager(pool, RadixTree(pool), tiers), tiers


def run(kv: KVCacheManager, tokens: list[int], n: int) -> Request:
    """A request computes its first ``n`` tokens and finishes (write-through backs them up)."""
    req = Request(f"r{tokens[0]}", tokens, SamplingParams(), arrival_seq=0, arrival_time=0.0)
    assert kv.admit(req, kv.match(req), len(tokens)) is not None
    req.num_computed_tokens = n
    kv.free(req)
    kv.tiers.drain()
    return req


def test_device_evicted_node_goes_host_then_disk_and_serves_a_load(tmp_path):
    kv, tiers = make(tmp_path, host_pages=2)
    a = list(range(1, 10))
    run(kv, a, 9)  # pages 0 and 1 backed up to the two host pages
    kv.index.evict(10)
    (node,) = kv.index.root.children.values()
    assert (node.token_ids, node.slots, node.tier) == (tuple(range(1, 9)), (), Tier.HOST)
    kv.check_integrity([])
    run(kv, list(range(50, 59)), 9)  # its backups take both host pages: a's spill to disk
    assert node.tier == Tier.DISK and len(tiers.disk) == 2
    kv.check_integrity([])
    back = Request("back", a + [7], SamplingParams(), arrival_seq=1, arrival_time=0.0)
    hit = kv.find_in_tiers(back, kv.match(back))
    assert hit is not None and hit.handle is node and hit.tiers == (Tier.DISK, Tier.DISK)
    tiers.copier.close()
