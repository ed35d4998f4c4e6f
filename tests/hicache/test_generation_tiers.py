"""Generation through the KV tiers is token-identical to generation with the KV never evicted,
and a warm disk tier survives a restart."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from tests.engine.tiny import tiny_model

MODEL = tiny_model(tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)


def returning_robots(rng: random.Random, robots: int, turns: int) -> list[list[int]]:
    """Each robot comes back with its history plus a new turn; robots share a system stem."""
    stem = [rng.randrange(97) for _ in range(10)]
    histories = [stem + [rng.randrange(97) for _ in range(rng.randrange(5, 20))] for _ in range(robots)]
    prompts = []
    for _ in range(turns):
        for r in range(robots):
            histories[r] = histories[r] + [rng.randrange(97) for _ in range(rng.randrange(3, 15))]
            prompts.append(list(histories[r]))
    return prompts


def tier_config(num_blocks: int, policy: str = "write_through", disk_dir: str = "", host_mb: float = 4.0,
                **kw) -> EngineConfig:
    hc = HiCacheConfig(enabled=True, write_policy=policy, host_pool_mb=host_mb, disk_dir=disk_dir,
                       min_load_tokens=0, write_through_threshold=1, **kw)
    return EngineConfig(block_size=4, num_blocks=num_blocks, scheduler=SCHED, hicache=hc)


def one_by_one(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt runs alone (a robot returns after the previous turn finished); its outputs."""
    return [req.output_token_ids for req in one_by_one_requests(engine, prompts)]


def one_by_one_requests(engine: Engine, prompts: list[list[int]]) -> list[Request]:
    reqs = []
    for p in prompts:
        (req,) = engine.generate([p], GREEDY)
        reqs.append(req)
        assert engine.settle_tiers() == []  # whole loads finish before their requests run
        engine.scheduler.kv.check_integrity([])
    return reqs


def tier_engine(model, config: EngineConfig) -> Engine:
    """An engine that loads every lower-tier hit: the load-or-recompute cost model (timing-dependent:
    a fast CPU recomputes a tiny model's tokens sooner than it reads a page) is not under test here."""
    engine = Engine(model, None, config)
    if engine.tiers is not None:
        engine.tiers.cost.recompute_seconds = lambda num_tokens: float("inf")
    return engine


def never_evicted(prompts: list[list[int]]) -> list[list[int]]:
    return one_by_one(Engine(MODEL, None, EngineConfig(block_size=4, num_blocks=2000, scheduler=SCHED)), prompts)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
def test_reload_from_host_is_token_identical(policy, seed):
    prompts = returning_robots(random.Random(seed), robots=4, turns=3)
    engine = tier_engine(MODEL, tier_config(num_blocks=30, policy=policy))
    assert one_by_one(engine, prompts) == never_evicted(prompts)
    stats = engine.stats().tiers
    if policy != "write_through_selective":  # selective backs up only pages hit on the device
        assert stats.hit_tokens["host"] > 0  # the device alone could not hold the robots
        assert stats.bytes_moved["host_to_device"] > 0
    engine.close()


def test_host_spills_to_disk_and_reloads_identically(tmp_path):
    prompts = returning_robots(random.Random(7), robots=4, turns=3)
    # a host pool of a few pages: most pages spill to disk and come back from there
    engine = tier_engine(MODEL, tier_config(num_blocks=30, disk_dir=str(tmp_path), host_mb=0.01))
    assert engine.tiers.host.num_pages < 8
    assert one_by_one(engine, prompts) == never_evicted(prompts)
    stats = engine.stats().tiers
    assert stats.hit_tokens["disk"] > 0 and stats.bytes_moved["host_to_disk"] > 0
    engine.close()


def test_the_disk_drops_its_least_recently_read_pages_not_its_oldest(tmp_path):
    # nine disk pages; a host of a few. Four robots' prompts spill to disk, robot A's oldest;
    # A comes back (its pages read from disk), then a fifth robot pushes the disk past its bound
    engine = tier_engine(MODEL, tier_config(num_blocks=12, disk_dir=str(tmp_path), host_mb=0.01))
    disk = engine.tiers.disk
    disk.max_pages = 9
    prompts = [[10 * robot + 1 + i for i in range(9)] for robot in range(5)]  # no shared prefix
    a, b, *_ = one_by_one_requests(engine, prompts[:4])
    assert a.cache.page_hashes[0] in disk
    (again,) = one_by_one_requests(engine, prompts[:1])
    read = again.num_cached_tokens // engine.config.block_size
    assert read >= 1 and engine.stats().tiers.hit_tokens["disk"] > 0
    one_by_one_requests(engine, prompts[4:])
    assert all(h in disk for h in again.cache.page_hashes[:read])  # read since: kept
    assert b.cache.page_hashes[0] not in disk  # written after A's, never read: dropped first
    engine.close()


def test_restart_with_warm_disk_tier_hits(tmp_path):
    prompts = returning_robots(random.Random(3), robots=3, turns=2)
    first = tier_engine(MODEL, tier_config(num_blocks=400, disk_dir=str(tmp_path), host_mb=0.01))
    first_reqs = one_by_one_requests(first, prompts)
    first.close()
    assert any(tmp_path.glob("*/*.kv"))
    restarted = tier_engine(MODEL, tier_config(num_blocks=400, disk_dir=str(tmp_path), host_mb=0.01))
    restart_reqs = one_by_one_requests(restarted, prompts)
    assert [r.output_token_ids for r in restart_reqs] == [r.output_token_ids for r in first_reqs]
    first_hits = [r.num_cached_tokens for r in first_reqs]
    restart_hits = [r.num_cached_tokens for r in restart_reqs]
    # The first engine's pages are on disk: the robot that came in cold now starts from them (a
    # prefetch may have brought the pages up to the empty host tier first, so they count as host
    # or disk hits). No request reuses less than in the first engine (same pool, same order).
    tier_hits = restarted.stats().tiers.hit_tokens
    assert tier_hits["host"] + tier_hits["disk"] > 0
    assert first_hits[0] == 0 and restart_hits[0] >= restarted.config.block_size
    assert all(again >= before for again, before in zip(restart_hits, first_hits, strict=True))
    restarted.close()


def test_returning_robots_load_through_slotless_tree_nodes():
    # device eviction keeps backed-up nodes in the tree (slot-less, tier host); a returning
    # robot's load is found there, not by hash, and gives those nodes their slots back
    prompts = returning_robots(random.Random(5), robots=4, turns=3)
    engine = tier_engine(MODEL, tier_config(num_blocks=30))
    kv, from_tree, slotless = engine.scheduler.kv, [], []
    find = kv.find_in_tiers

    def spy(req, match):
        hit = find(req, match)
        if hit is not None:
            from_tree.append(hit.handle is not None)
            slotless.append(sum(1 for n in _nodes(engine.index) if not n.slots))
        return hit

    kv.find_in_tiers = spy
    assert one_by_one(engine, prompts) == never_evicted(prompts)
    assert from_tree and all(from_tree) and min(slotless) > 0
    engine.close()


def _nodes(tree):
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
