"""Batched, chunked, preempted and prefix-cached generation equals batch-1 generation alone."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from tests.engine.tiny import greedy_reference, tiny_model

MODEL = tiny_model(tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def shared_prefix_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts built from a few common stems plus own tails, so prefixes are shared and end
    at arbitrary tokens (inside blocks)."""
    stems = [[rng.randrange(97) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    prompts = []
    for _ in range(n):
        stem = rng.choice(stems)
        prompts.append(stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(97) for _ in range(rng.randrange(0, 12))])
    return prompts


def run_engine(prompts, config: EngineConfig, sampling=GREEDY) -> list[list[int]]:
    engine = Engine(MODEL, None, config)
    reqs = engine.generate(prompts, sampling)
    engine.scheduler.kv.check_integrity([])
    assert engine.pool.num_used == engine.stats().blocks_used
    return [r.output_token_ids for r in reqs]


def test_engine_matches_dense_reference_single_request():
    prompt = [5, 9, 2, 77, 31, 8, 8, 1]
    assert run_engine([prompt], EngineConfig(block_size=4, num_blocks=64)) == [
        greedy_reference(MODEL, prompt, 8)
    ]


@pytest.mark.parametrize("index", ["radix", "hashed"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), budget=st.sampled_from([3, 7, 64]), blocks=st.sampled_from([24, 400]))
def test_batched_chunked_preempted_cached_equals_alone(index, seed, budget, blocks):
    rng = random.Random(seed)
    prompts = shared_prefix_prompts(rng, 6)
    config = EngineConfig(
        block_size=4,
        num_blocks=blocks,  # 24 blocks forces preemption and eviction
        prefix_index=index,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget),
    )
    expected = [greedy_reference(MODEL, p, GREEDY.max_tokens) for p in prompts]
    # run twice through one engine: the second pass hits the cache (prompt and output)
    engine = Engine(MODEL, None, config)
    for _ in range(2):
        reqs = engine.generate(prompts, GREEDY)
        assert [r.output_token_ids for r in reqs] == expected
        engine.scheduler.kv.check_integrity([])
