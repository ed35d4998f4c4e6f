"""Layer-by-layer tier loads: a returning robot's request starts while its prefix is still
copying up, each layer of its forward waits only for that layer, and the tokens are exactly
those of generation with the KV never evicted."""

from __future__ import annotations

import copy
import dataclasses
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kernels.attention import PagedAttentionStep
from shared.engine.engine import Engine
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.kv.layer_fence import LayerFence
from tests.hicache.test_generation_tiers import (
    GREEDY, MODEL, never_evicted, returning_robots, tier_config, tier_engine,
)


def by_turns(engine: Engine, prompts: list[list[int]], robots: int) -> list[list[int]]:
    """Each turn's robots arrive together (batched), so requests share blocks being loaded."""
    outs = []
    for t in range(0, len(prompts), robots):
        outs += [r.output_token_ids for r in engine.generate(prompts[t:t + robots], GREEDY)]
        engine.settle_tiers()  # a layer-by-layer load may finish after its requests did
        engine.scheduler.kv.check_integrity([])
    return outs


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
@example(seed=9085)  # its last load was often still uncollected when generate returned
def test_layerwise_loads_are_token_identical(seed):
    prompts = returning_robots(random.Random(seed), robots=4, turns=3)
    engine = tier_engine(MODEL, tier_config(num_blocks=30, layerwise_load="on"))
    assert by_turns(engine, prompts, robots=4) == never_evicted(prompts)
    stats = engine.stats().tiers
    assert stats.loads_layerwise > 0 and stats.hit_tokens["host"] > 0
    engine.close()


def test_loads_through_disk_stay_whole_and_identical(tmp_path):
    # pages read from disk (or under another op) may fail or still be written: such loads
    # run whole, the request waits in WAITING_FOR_TIER_LOAD, and nothing changes in the output
    prompts = returning_robots(random.Random(11), robots=4, turns=3)
    engine = tier_engine(MODEL, tier_config(num_blocks=30, disk_dir=str(tmp_path), host_mb=0.01,
                                             layerwise_load="on", prefetch=False))
    assert by_turns(engine, prompts, robots=4) == never_evicted(prompts)
    stats = engine.stats().tiers
    assert stats.hit_tokens["disk"] > 0 and stats.loads > stats.loads_layerwise
    engine.close()


def test_forward_overlaps_the_rest_of_the_load(monkeypatch):
    """Each layer lands 30 ms after the previous one; the returning request's first step must
    start reading layer 0 before the last layer has landed, and read each layer only after it
    landed."""
    prompts = returning_robots(random.Random(2), robots=4, turns=2)
    expected = never_evicted(prompts)
    engine = tier_engine(MODEL, tier_config(num_blocks=30, layerwise_load="on"))
    outs = [r.output_token_ids for r in engine.generate(prompts[:4], GREEDY)]  # turn 1; evicts
    engine.settle_tiers()

    # NOTE: keyed by the fences themselves, which keeps them alive: a collected fence's id() is reused
    landed: dict[tuple[LayerFence, int], float] = {}  # (fence, layer) -> time
    read: dict[tuple[LayerFence, int], float] = {}
    lock = threading.Lock()
    real_landed, real_attend = LayerFence.landed, PagedAttentionStep.attend

    def slow_landed(self, layer):
        time.sleep(0.03)
        with lock:
            landed[self, layer] = time.perf_counter()
        real_landed(self, layer)

    def spying_attend(self, layer, *args):
        out = real_attend(self, layer, *args)  # waits on the fences first
        for fence in self.fences:
            read.setdefault((fence, layer), time.perf_counter())
        return out

    monkeypatch.setattr(LayerFence, "landed", slow_landed)
    monkeypatch.setattr(PagedAttentionStep, "attend", spying_attend)
    for p in prompts[4:]:  # turn 2, one robot at a time: each reloads its history
        (req,) = engine.generate([p], GREEDY)
        outs.append(req.output_token_ids)
        engine.settle_tiers()
    assert outs == expected
    fences = {f for f, _ in read}
    assert fences and engine.stats().tiers.loads_layerwise == len(fences)
    last = MODEL.config.num_layers - 1
    for f in fences:
        assert read[f, 0] < landed[f, last]  # layer 0 computed while the last layer copied
        assert all(read[f, layer] >= landed[f, layer] for layer in range(last + 1))
    engine.close()


def test_layerwise_config():
    assert HiCacheConfig(layerwise_load="auto").layerwise_for(on_gpu=True)
    assert not HiCacheConfig(layerwise_load="auto").layerwise_for(on_gpu=False)
    assert HiCacheConfig(layerwise_load="on").layerwise_for(on_gpu=False)
    assert not HiCacheConfig(layerwise_load="off").layerwise_for(on_gpu=True)
    with pytest.raises(ValueError, match="layerwise_load"):
        HiCacheConfig(layerwise_load="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layerwise_load", ["auto", "off"])
def test_cuda_tiers_reload_identically(layerwise_load):
    """On a GPU: pinned host tier, copies on side streams, loads layer by layer ("auto") or
    whole; a returning robot's tokens are those of the CPU engine with the KV never evicted."""
    prompts = returning_robots(random.Random(4), robots=4, turns=3)
    config = dataclasses.replace(tier_config(num_blocks=30, layerwise_load=layerwise_load), device="cuda")
    engine = tier_engine(model_copy(), config)
    assert engine.tiers.copier.host.is_pinned()
    assert by_turns(engine, prompts, robots=4) == never_evicted(prompts)
    stats = engine.stats().tiers
    assert stats.hit_tokens["host"] > 0
    assert (stats.loads_layerwise > 0) == (layerwise_load == "auto")
    engine.close()


def model_copy():
    """A copy of the tests' model (the engine moves its model to the device in place)."""
    return copy.deepcopy(MODEL)
