"""Concurrent backups, spills, loads and block reuse (real copier thread): a finished load's
blocks hold exactly the pages' data, or the load stops short; never wrong data."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.disk_tier import DiskTier
from shared.engine.kv.hicache import HiCache, LoadTicket
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.kv.prefix_cache import PrefixMatch
from shared.engine.kv.tier_copier import TierCopier
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams

BS, LAYERS = 4, 2
SEQS = [[s * 10 + t for t in range(4 * BS + 1)] for s in range(3)] + [[0] * 8 + [9] * 9]  # last shares a page


def page_value(req: Request, k: int) -> float:
    return float(int.from_bytes(req.page_hashes[k][:2], "little"))


def make(tmp_path, host_pages: int):
    kv = [(torch.zeros(24, BS, 1, 2), torch.zeros(24, BS, 1, 2)) for _ in range(LAYERS)]
    pool = BlockPool(24, BS)
    disk = DiskTier(tmp_path)
    copier = TierCopier(kv, host_pages, disk)
    config = HiCacheConfig(enabled=True, min_load_tokens=0)
    return kv, pool, HiCache(config, pool, copier, host_pages, disk, lambda: 0.0)


def fill(kv, block: int, value: float) -> None:
    for k, v in kv:
        k[block].fill_(value)
        v[block].fill_(-value)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(actions=st.lists(st.tuples(st.sampled_from(["write", "load", "poll", "reuse"]), st.integers(0, 3)),
                        min_size=1, max_size=30),
       host_pages=st.integers(1, 6))
def test_loads_are_exact_under_concurrent_writes_and_reuse(tmp_path_factory, actions, host_pages):
    kv, pool, tiers = make(tmp_path_factory.mktemp("disk"), host_pages)
    tickets: list[LoadTicket] = []

    def check(done: list[LoadTicket]) -> None:
        for t in done:
            for i in range(t.op.num_ok):
                want = page_value(t.request, t.hit.start_page + i)
                block = t.blocks[i]
                assert all(bool((k[block] == want).all()) and bool((v[block] == -want).all()) for k, v in kv)
            pool.decref(t.blocks)

    for n, (action, s) in enumerate(actions):
        req = Request(f"r{n}", SEQS[s], SamplingParams(), arrival_seq=n, arrival_time=0.0)
        if action == "write" and pool.num_free >= 4:
            req.block_table = pool.allocate(4)
            tiers.hashes(req, 4)
            for k, block in enumerate(req.block_table):
                fill(kv, block, page_value(req, k))
            req.num_computed_tokens = 4 * BS
            tiers.on_cached(req)
            pool.decref(req.block_table)  # the request is done: its blocks may be reused at once
        elif action == "load":
            hit = tiers.find(req, 0)
            if hit is not None and pool.num_free >= len(hit.tiers):
                ticket = LoadTicket(req, PrefixMatch(0, (), None), hit, pool.allocate(len(hit.tiers)))
                tiers.start_load(ticket)
                tickets.append(ticket)
        elif action == "poll":
            check(tiers.poll())
        elif action == "reuse" and pool.num_free:
            blocks = pool.allocate(pool.num_free)
            for b in blocks:
                fill(kv, b, -1.0)  # the next forward overwrites whatever it was given
            pool.decref(blocks)
    check(tiers.drain())
    tiers.check_integrity()
    assert pool.num_free == pool.num_blocks - 1
    tiers.copier.close()
