"""A request that fits the pool alone is always served: never ended unserved (``length`` with
no output) because loaded-but-not-admitted prefixes, backups in flight or a locked cached
edge hold the blocks it needs."""

from __future__ import annotations

import random

import pytest

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from tests.engine.tiny import tiny_model
from tests.hicache.test_generation_tiers import SCHED, one_by_one, returning_robots, tier_config, tier_engine

MODEL = tiny_model(tie_word_embeddings=False)
SIX = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("tiers", ["off", "on"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_returning_fleet_at_once_in_a_small_pool_is_served(tiers, seed):
    prompts = returning_robots(random.Random(seed), robots=6, turns=3)
    first, again = prompts[:6], prompts[6:]
    # the pool holds the longest request alone (plus a block), not the fleet
    num_blocks = -(-(max(map(len, prompts)) + SIX.max_tokens) // 4) + 2
    config = tier_config(num_blocks) if tiers == "on" else EngineConfig(block_size=4, num_blocks=num_blocks,
                                                                         scheduler=SCHED)
    engine = tier_engine(MODEL, config)
    one_by_one(engine, first)  # warm the host tier with every robot's history
    reqs = engine.generate(again, SIX)  # then the fleet returns all at once
    assert [r.num_output_tokens for r in reqs] == [6] * len(again)
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    engine.settle_tiers()
    engine.scheduler.kv.check_integrity([])
    engine.close()


def test_match_inside_a_long_locked_edge_does_not_starve_its_request():
    # 10 usable blocks of 4. A caches 31 tokens as one edge (8 blocks); B shares A's first 10
    # tokens and needs 8 blocks: only if the match does not lock A's whole edge.
    engine = Engine(MODEL, None, EngineConfig(block_size=4, num_blocks=11, scheduler=SCHED))
    a = list(range(1, 31))
    (ra,) = engine.generate([a], SamplingParams(max_tokens=2, ignore_eos=True))
    b = a[:10] + list(range(40, 60))
    (rb,) = engine.generate([b], SamplingParams(max_tokens=2, ignore_eos=True))
    assert (ra.num_output_tokens, rb.num_output_tokens) == (2, 2)
    assert rb.num_cached_tokens == 10
    engine.scheduler.kv.check_integrity([])


def test_tier_load_extending_a_match_inside_a_long_locked_edge_is_served(tmp_path):
    # B's pages are on a warm disk tier; after a restart A caches 31 tokens as one edge (8 of
    # 10 usable blocks) and B matches A's first 10 tokens: its 5-page load needs A's tail evicted.
    a = list(range(1, 31))
    b = a[:10] + list(range(40, 60))
    two = SamplingParams(max_tokens=2, ignore_eos=True)
    first = tier_engine(MODEL, tier_config(num_blocks=11, disk_dir=str(tmp_path), host_mb=0.01))
    (expected,) = first.generate([b], two)
    first.generate([list(range(60, 90))], two)  # pushes B's pages from the 5 host pages to disk
    first.close()
    engine = tier_engine(MODEL, tier_config(num_blocks=11, disk_dir=str(tmp_path), host_mb=0.01))
    engine.tiers.cost.recompute_seconds = lambda n: float(n)  # loading always beats recomputing
    engine.generate([a], two)
    (rb,) = engine.generate([b], two)
    assert rb.output_token_ids == expected.output_token_ids
    assert engine.stats().tiers.hit_tokens["disk"] > 0
    engine.settle_tiers()
    engine.scheduler.kv.check_integrity([])
    engine.close()
