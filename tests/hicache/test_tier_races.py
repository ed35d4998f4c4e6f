"""Concurrent backups, spills, loads and block reuse (real copier thread): a finished load's
blocks hold exactly the pages' data, or the load stops short; never wrong data."""

from __future__ import annotations

import pytest
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
    return float(int.from_bytes(req.cache.page_hashes[k][:2], "little"))


def make(tmp_path, host_pages: int, layerwise: bool = False):
    kv = [(torch.zeros(24, BS, 1, 2), torch.zeros(24, BS, 1, 2)) for _ in range(LAYERS)]
    pool = BlockPool(24, BS)
    disk = DiskTier(tmp_path)
    copier = TierCopier(kv, host_pages, disk)
    config = HiCacheConfig(enabled=True, min_load_tokens=0)
    return kv, pool, HiCache(config, pool, copier, host_pages, disk, lambda n: 0.0, layerwise=layerwise)


def fill(kv, block: int, value: float) -> None:
    for k, v in kv:
        k[block].fill_(value)
        v[block].fill_(-value)


@pytest.mark.parametrize("layerwise", [False, True])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(actions=st.lists(st.tuples(st.sampled_from(["write", "load", "poll", "reuse"]), st.integers(0, 3)),
                        min_size=1, max_size=30),
       host_pages=st.integers(1, 6))
def test_loads_are_exact_under_concurrent_writes_and_reuse(tmp_path_factory, layerwise, actions, host_pages):
    """Layer by layer, each layer is exact as soon as its fence says it landed."""
    kv, pool, tiers = make(tmp_path_factory.mktemp("disk"), host_pages, layerwise)
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
                if ticket.layerwise:
                    for layer, (k, v) in enumerate(kv):
                        ticket.op.fence.wait(layer)
                        for i, block in enumerate(ticket.blocks):
                            want = page_value(req, hit.start_page + i)
                            assert bool((k[block] == want).all()) and bool((v[block] == -want).all())
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


def test_only_loads_of_quiet_host_pages_run_layer_by_layer(tmp_path):
    kv, pool, tiers = make(tmp_path, host_pages=2, layerwise=True)

    def write(s: int) -> Request:
        req = Request(f"w{s}", SEQS[s], SamplingParams(), arrival_seq=s, arrival_time=0.0)
        req.block_table = pool.allocate(4)
        tiers.hashes(req, 4)
        for k, block in enumerate(req.block_table):
            fill(kv, block, page_value(req, k))
        req.num_computed_tokens = 2 * BS  # two pages: the host holds exactly one request's
        tiers.on_cached(req)
        pool.decref(req.block_table)
        return req

    def load(req: Request) -> LoadTicket:
        again = Request(req.request_id + "'", SEQS[int(req.request_id[1:])][: 2 * BS + 1], SamplingParams(),
                        arrival_seq=9, arrival_time=0.0)
        hit = tiers.find(again, 0)
        ticket = LoadTicket(again, PrefixMatch(0, (), None), hit, pool.allocate(len(hit.tiers)))
        tiers.start_load(ticket)
        return ticket

    first = write(0)
    busy = load(first)  # its backup may still be running: the pages are under another op
    assert not busy.layerwise
    done = tiers.drain()
    quiet = load(first)  # now idle host pages: layer by layer, readable per layer at once
    assert quiet.layerwise and tiers.num_layerwise_loading == 1
    for layer, (k, v) in enumerate(kv):
        quiet.op.fence.wait(layer)
        for i, block in enumerate(quiet.blocks):
            assert bool((k[block] == page_value(quiet.request, i)).all())
    done += tiers.drain()
    write(1)  # the host holds two pages: the first request's pages spill to disk
    done += tiers.drain()
    spilled = load(first)  # read back through the disk: may fail, so it runs whole
    assert not spilled.layerwise
    done += tiers.drain()
    assert [t.op.num_ok for t in done] == [2, 2, 2]
    for t in done:
        pool.decref(t.blocks)
    tiers.check_integrity()
    tiers.copier.close()
