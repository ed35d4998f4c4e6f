"""A tier copy that raises (a disk or device error) is logged and never hangs the engine:
writes and whole loads become misses (the tokens are unchanged); a layer-by-layer load whose
request already read it is reported as `TierCopyError`."""

from __future__ import annotations

import random

import pytest

from shared.engine.kv.hicache import TierCopyError
from shared.engine.kv.tier_copier import TierCopier
from tests.hicache.test_generation_tiers import (
    MODEL, never_evicted, one_by_one, returning_robots, tier_config, tier_engine,
)

PROMPTS = returning_robots(random.Random(9), robots=4, turns=3)


def failing(*args, **kwargs):
    raise RuntimeError("injected copy failure")


@pytest.mark.parametrize("method", ["_backup", "_copy_up"])
def test_failed_writes_and_whole_loads_are_misses(monkeypatch, caplog, method):
    monkeypatch.setattr(TierCopier, method, failing)
    engine = tier_engine(MODEL, tier_config(num_blocks=30, layerwise_load="off"))
    assert one_by_one(engine, PROMPTS) == never_evicted(PROMPTS)
    stats = engine.stats().tiers
    assert stats.copy_errors > 0 and "injected copy failure" in caplog.text
    if method == "_backup":  # nothing was ever backed up: no host page is claimed
        assert stats.host_pages_used == 0 and stats.hit_tokens["host"] == 0
    engine.close()


def test_a_failed_layerwise_load_is_reported_not_hung(monkeypatch):
    monkeypatch.setattr(TierCopier, "_copy_up", failing)
    engine = tier_engine(MODEL, tier_config(num_blocks=30, layerwise_load="on"))
    with pytest.raises(TierCopyError, match="injected copy failure"):
        one_by_one(engine, PROMPTS)
    engine.close()  # every copy was collected: nothing waits on the failed one
