"""The engine's device: config validation on any machine; on a CUDA machine, greedy tokens
identical to the CPU engine's (the CUDA path runs `kernels.attention.attention_with_lse`)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import attention
from kernels.attention import attention_with_lse
from shared.config import load_engine_config
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from tests.engine.tiny import tiny_model

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CUDA", "mps", ""])
def test_an_unknown_device_is_refused(device):
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        EngineConfig(device=device)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_cuda_device_is_a_clear_error(device):
    with pytest.raises(ValueError, match="torch finds no CUDA device"):
        EngineConfig(device=device)


def test_the_daemon_toml_sets_the_device(tmp_path):
    cfg = tmp_path / "cloudd.toml"
    cfg.write_text('[engine]\ndevice = "cpu"\nblock_size = 4\n')
    assert load_engine_config(cfg).device == "cpu"


@no_cuda
def test_a_cuda_device_in_the_toml_without_cuda_names_the_key(tmp_path):
    cfg = tmp_path / "cloudd.toml"
    cfg.write_text('[engine]\ndevice = "cuda"\n')
    with pytest.raises(ValueError, match=r"\[engine\] device 'cuda' asked for"):
        load_engine_config(cfg)


def shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """A 180-token stem (long enough for the cascade decode to read it once for all rows) cut
    at different tokens, plus own tails."""
    rng = random.Random(seed)
    stem = [rng.randrange(97) for _ in range(180)]
    return [stem[: rng.randrange(150, 181)] + [rng.randrange(97) for _ in range(rng.randrange(0, 9))]
            for _ in range(n)]


def generate_twice(device: str, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Greedy outputs of two passes through one engine (the second hits the prefix cache)."""
    config = EngineConfig(device=device, block_size=4, num_blocks=600,
                          scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64))
    engine = Engine(tiny_model(tie_word_embeddings=False), None, config)  # its own: moved in place
    assert all(t.device.type == torch.device(device).type for kv in engine.runner.kv_caches for t in kv)
    passes = [[r.output_token_ids for r in engine.generate(prompts, GREEDY)] for _ in range(2)]
    assert engine.stats().cache_hit_tokens > 0
    engine.scheduler.kv.check_integrity([])
    return passes


def test_the_engine_through_the_non_cpu_attention_gives_the_cpu_tokens(monkeypatch):
    """The CUDA path's attention (`attention_with_lse` in every call), run on the CPU."""
    prompts = shared_prefix_prompts(6)
    want = generate_twice("cpu", prompts)
    monkeypatch.setattr(attention, "_flash_with_lse", attention_with_lse)
    assert generate_twice("cpu", prompts) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_gives_the_cpu_engines_greedy_tokens():
    prompts = shared_prefix_prompts(6)
    assert generate_twice("cuda", prompts) == generate_twice("cpu", prompts)
