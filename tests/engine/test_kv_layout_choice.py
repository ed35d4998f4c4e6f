"""The engine's KV pool layout (``EngineConfig.kv_layout``, ``kernels.kv_layout``): "auto" picks
the paired layout exactly where the CPU decode kernel reads it, and an engine on paired pools
generates the tokens layout's tokens: prompts that share a system prompt (decode rows grouped
in the kernel), prefix-cache hits on partial blocks (slot copies), chunked prefill over
cached blocks (gathers)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode_cpu import supports_paired
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from shared.model.fetch import ensure_default_model
from tests.engine.tiny import tiny_model

SYSTEM = ("You are the task planner of a warehouse robot in a fleet. Plan with the skills goto (a named waypoint), "
          "pick (an object, with a grasp), place, dock (a charger or a conveyor) and report (a message to the "
          "fleet manager). Answer with a short numbered plan, one skill per line.")
TASKS = ("Bring tote 12 from waypoint 17 to the packing station.", "Dock at charger 3, then report.",
         "Pick the red bin at shelf A3 and place it on conveyor 2.")


def test_auto_is_paired_exactly_where_the_kernel_reads_it_and_paired_elsewhere_is_refused():
    model = tiny_model(seed=1)
    engine = Engine(model, None, EngineConfig(block_size=16, num_blocks=32, dtype="float32"))
    assert engine.stats().kv_layout == "tokens"  # float32: the paired layout is bf16's
    engine.close()
    with pytest.raises(ValueError, match="kv_layout 'paired' needs"):
        Engine(tiny_model(seed=1), None, EngineConfig(block_size=16, num_blocks=32, dtype="float32",
                                                      kv_layout="paired"))
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        EngineConfig(kv_layout="columns")
    engine = Engine(tiny_model(seed=1).to(torch.bfloat16), None, EngineConfig(block_size=16, num_blocks=32,
                                                                              dtype="bfloat16"))
    cfg = engine.runner.model.config
    assert engine.stats().kv_layout == ("paired" if engine.runner.decode_in_place and supports_paired(
        cfg.head_dim, torch.bfloat16, 16) else "tokens")
    engine.close()


@pytest.mark.skipif(not supports_paired(64, torch.bfloat16, 16), reason="the paired layout needs AVX-512 BF16")
def test_paired_pools_generate_the_tokens_layouts_tokens_on_the_default_model():
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}] for task in TASKS]
    runs = {}
    for layout in ("tokens", "paired"):
        # prompts in 64-token chunks: later chunks attend over blocks already in the pool
        config = EngineConfig(dtype="bfloat16", kv_layout=layout, num_blocks=256,
                              scheduler=SchedulerConfig(max_num_batched_tokens=64))
        engine = Engine.from_checkpoint(ensure_default_model(), config)
        first = engine.generate(prompts, SamplingParams(max_tokens=16))
        again = engine.generate(prompts[::-1], SamplingParams(max_tokens=16))  # cached prompts, partial blocks
        stats = engine.stats()
        assert stats.kv_layout == layout and stats.cache_hit_tokens > 0
        runs[layout] = [r.output_token_ids for r in first + again]
        engine.close()
    assert runs["paired"] == runs["tokens"]
