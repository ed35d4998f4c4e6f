"""The layers' compiled dense halves (``LlamaModel.compile_layers``): the eager model's logits,
one compile at start-up for every token count from the threshold up, eager below it, and the
engine's greedy tokens unchanged on the default model."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from kernels.dense_attention import DenseAttentionStep
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.model.fetch import ensure_default_model
from shared.model.llama import COMPILED_MIN_TOKENS
from tests.engine.tiny import tiny_model

MIN_TOKENS = 8  # the tiny model's threshold: small shapes keep the test fast


def logits(model, ids: torch.Tensor) -> torch.Tensor:  # [T, vocab]: one forward over a fresh dense KV buffer
    cfg = model.config
    caches = [(torch.zeros(len(ids), cfg.num_kv_heads, cfg.head_dim), torch.zeros(len(ids), cfg.num_kv_heads,
                                                                                cfg.head_dim))
              for _ in range(cfg.num_layers)]
    positions = torch.arange(len(ids))
    return model.logits(model(ids, positions, caches, DenseAttentionStep(positions, len(ids))))


def test_compiled_layers_give_eager_logits_and_never_recompile_past_start_up():
    eager, compiled = tiny_model(seed=3, attention_bias=True), tiny_model(seed=3, attention_bias=True)
    seconds = compiled.compile_layers(min_tokens=MIN_TOKENS)
    assert seconds > 0 and compiled.compiled_min_tokens == MIN_TOKENS
    graphs = counters["stats"]["unique_graphs"]
    for count in (MIN_TOKENS, MIN_TOKENS + 1, 33, 100, 257, 5, 1):  # compiled from 8 tokens up, eager below
        ids = torch.randint(0, compiled.config.vocab_size, (count,), generator=torch.Generator().manual_seed(count))
        torch.testing.assert_close(logits(compiled, ids), logits(eager, ids), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs  # every shape above ran the start-up code


def test_a_threshold_of_one_token_is_refused():
    model = tiny_model()
    try:
        model.compile_layers(min_tokens=1)
    except ValueError as e:
        assert "min_tokens must be >= 2" in str(e)
    else:
        raise AssertionError("min_tokens=1 was accepted")


def test_the_compiled_engine_generates_the_eager_tokens_on_the_default_model():
    prompts = [
        [{"role": "system", "content": "You are the task planner of a warehouse robot in a fleet. Plan with the "
                                       "skills goto (a named waypoint), pick (an object, with a grasp), place, "
                                       "dock (a charger or a conveyor) and report (a message to the fleet "
                                       "manager). Answer with a short numbered plan, one skill per line."},
         {"role": "user", "content": task}]
        for task in ("Bring tote 12 from waypoint 17 to the packing station.", "Dock at charger 3, then report.")
    ]
    runs = []
    for compile_layers in (False, True):
        engine = Engine.from_checkpoint(ensure_default_model(), EngineConfig(dtype="float32", compile=compile_layers))
        assert all(len(engine.tokenizer.encode_chat(p)) >= COMPILED_MIN_TOKENS for p in prompts)  # compiled prefill
        runs.append([r.output_token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=12))])
        assert engine.stats().compiled == compile_layers
        engine.close()
    assert runs[0] == runs[1]


def test_a_compile_that_fails_leaves_the_engine_eager_and_serving(monkeypatch):
    """Where inductor cannot compile (no C++ compiler, say), the engine logs it and runs eager."""

    def broken_compile(fn, **_):
        def call(*args, **kwargs):
            raise RuntimeError("no C++ compiler")
        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    model = tiny_model(seed=4)
    engine = Engine(model, None, EngineConfig(block_size=4, num_blocks=64, compile=True))
    assert engine.compile_seconds is None and not engine.stats().compiled
    assert model.compiled_min_tokens == 0  # every forward eager
    (request,) = engine.generate([list(range(1, 80))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(request.output_token_ids) == 3
