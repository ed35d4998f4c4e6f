"""Lazy weights and build_model: a model built weight by weight, straight into its dtype, equals
the one the eager path built (every weight in float32 at once, q/k/v and gate/up concatenated, a
float32 model, then converted)."""

import pytest
import torch

from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.lazy_weights import LazyWeights
from shared.model.llama import LlamaModel, build_model
from tests.model.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module", params=[("qwen2", False), ("llama", True)], ids=["qwen2", "llama-tied"])
def tiny(request, tmp_path_factory):
    arch, tied = request.param
    return load_checkpoint(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{arch}.gguf", arch, tied))


def eager_model(ckpt: Checkpoint, dtype: torch.dtype) -> LlamaModel:
    """The eager path, spelled out: all weights dequantized, fused with torch.cat, then `.to(dtype)`."""
    w, c = dict(ckpt.weights), ckpt.config
    own = {"embed_tokens.weight": w["model.embed_tokens.weight"], "norm.weight": w["model.norm.weight"],
           "lm_head.weight": w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]}
    for i in range(c.num_layers):
        hf = f"model.layers.{i}."
        own |= {
            f"layers.{i}.self_attn.qkv_proj.weight": torch.cat([w[f"{hf}self_attn.{p}_proj.weight"] for p in "qkv"]),
            f"layers.{i}.self_attn.o_proj.weight": w[f"{hf}self_attn.o_proj.weight"],
            f"layers.{i}.mlp.gate_up_proj.weight": torch.cat([w[f"{hf}mlp.{p}_proj.weight"] for p in ("gate", "up")]),
            f"layers.{i}.mlp.down_proj.weight": w[f"{hf}mlp.down_proj.weight"],
            f"layers.{i}.input_layernorm.weight": w[f"{hf}input_layernorm.weight"],
            f"layers.{i}.post_attention_layernorm.weight": w[f"{hf}post_attention_layernorm.weight"],
        }
        if c.attention_bias:
            own[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat([w[f"{hf}self_attn.{p}_proj.bias"] for p in "qkv"])
    model = LlamaModel(c)
    model.load_state_dict(own)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype).eval()


def assert_same_model(ours: LlamaModel, reference: LlamaModel) -> None:
    ours_state, ref_state = ours.state_dict(), reference.state_dict()
    assert ours_state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert ours_state[name].dtype == tensor.dtype and torch.equal(ours_state[name], tensor), name
    assert torch.equal(ours.rotary.cos, reference.rotary.cos) and torch.equal(ours.rotary.sin, reference.rotary.sin)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == ours.config.tie_word_embeddings
    assert not ours.training


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_build_model_equals_the_eager_path(tiny, dtype):
    assert_same_model(build_model(tiny.config, tiny.weights, dtype), eager_model(tiny, dtype))


def test_build_model_takes_plain_dicts_too(tiny):
    eager = dict(tiny.weights)
    assert_same_model(build_model(tiny.config, eager, torch.bfloat16), eager_model(tiny, torch.bfloat16))


def test_a_weight_is_read_on_each_access_and_kept_by_no_one(tiny):
    weights = tiny.weights
    assert isinstance(weights, LazyWeights) and len(weights) == len(list(weights)) == len(set(weights.keys()))
    first = weights["model.norm.weight"]
    first.zero_()
    again = weights["model.norm.weight"]
    assert again.dtype == torch.float32 and again.abs().sum() > 0 and again.data_ptr() != first.data_ptr()


def test_a_missing_or_misshapen_weight_is_named(tiny):
    weights = dict(tiny.weights)
    with pytest.raises(KeyError, match="model.norm.weight"):
        build_model(tiny.config, {k: w for k, w in weights.items() if k != "model.norm.weight"})
    weights["model.layers.1.self_attn.k_proj.weight"] = weights["model.layers.1.self_attn.k_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        build_model(tiny.config, weights)
