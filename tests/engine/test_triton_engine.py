"""The engine on the Triton kernels (kernels = "triton"): on the CPU under the interpreter, each
step's hidden states against the plain-torch engine's, over chunked prefills, prefix-cache
hits and cascade decodes; on a CUDA device, the default model's greedy tokens against the CPU
engine's, with and without CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.kernel_choice import resolve_kernels
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from tests.engine.test_device import shared_prefix_prompts
from tests.engine.tiny import tiny_model

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_engine(kernels: str, device: str = "cpu") -> Engine:
    config = EngineConfig(device=device, kernels=kernels, block_size=16, num_blocks=200,
                          scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64))
    return Engine(tiny_model(tie_word_embeddings=False), None, config)


def test_each_triton_step_computes_the_torch_steps_hidden_states():
    """Both engines run the same steps: the Triton one samples from the torch one's hidden
    states (so a near-tie of the random model cannot fork them), and each of its own hidden
    states must match."""
    prompts = shared_prefix_prompts(6)
    reference = tiny_engine("torch")
    want: list[torch.Tensor] = []
    forward = reference.runner._forward
    reference.runner._forward = lambda out: want.append(forward(out)) or want[-1]
    expected = [[r.output_token_ids for r in reference.generate(prompts, GREEDY)] for _ in range(2)]

    engine = tiny_engine("triton")
    assert engine.stats().kernels == "triton"
    got: list[torch.Tensor] = []
    own = engine.runner._forward
    engine.runner._forward = lambda out: got.append(own(out)) or want[len(got) - 1]
    outputs = [[r.output_token_ids for r in engine.generate(prompts, GREEDY)] for _ in range(2)]

    assert outputs == expected and len(got) == len(want)
    assert engine.stats().cache_hit_tokens > 0  # the second pass read cached prefixes
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_the_triton_kernels_refuse_blocks_they_cannot_tile():
    with pytest.raises(ValueError, match="block_size a power of two >= 16"):
        Engine(tiny_model(), None, EngineConfig(kernels="triton", block_size=4, num_blocks=64))


def test_auto_is_triton_on_cuda_and_torch_on_a_cpu(monkeypatch):
    assert resolve_kernels("auto", "cuda:0") == "triton" and resolve_kernels("auto", "cpu") == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kernels("triton", "cpu")
    with pytest.raises(ValueError, match="kernels must start with one of"):
        EngineConfig(kernels="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_the_cuda_engine_on_triton_gives_the_cpu_engines_greedy_tokens(default_checkpoint, cuda_graphs):
    """The default model in float32 on both devices: the Triton kernels (and the graphs' replay)
    must give the CPU engine's greedy tokens."""
    from shared.model.llama import build_model

    prompts = ["Plan: bring tote 12 from waypoint 17 to the packing station.", "List three safe speeds for a forklift."]
    tokens = {}
    for device in ("cpu", "cuda"):
        config = EngineConfig(device=device, dtype="float32", cuda_graphs=cuda_graphs, num_blocks=512,
                              scheduler=SchedulerConfig(max_num_seqs=8))
        model = build_model(default_checkpoint.config, default_checkpoint.weights, dtype=torch.float32)
        engine = Engine(model, default_checkpoint.tokenizer, config)
        assert engine.stats().kernels == ("triton" if device == "cuda" else "torch")
        assert engine.stats().cuda_graphs == (device == "cuda" and cuda_graphs)
        tokens[device] = [r.output_token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=24))]
    assert tokens["cuda"] == tokens["cpu"]


def test_decode_graph_buckets_double_up_to_max_num_seqs():
    from shared.engine.decode_graphs import buckets_up_to

    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert buckets_up_to(200) == (1, 2, 4, 8, 16, 32, 64, 128, 200)
