"""Our model against transformers on tiny random Llama-3 (llama3 RoPE scaling), Qwen2 (q/k/v
bias) and Mistral configs: the same weights give the same logits."""

from __future__ import annotations

import os

import pytest
import torch

from shared.model.llama import build_model
from shared.model.model_config import ModelConfig
from tests.engine.tiny import dense_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def hf_config(kind: str):
    import transformers

    if kind == "llama3":
        return transformers.LlamaConfig(**SIZES, rope_theta=500000.0, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return transformers.Qwen2Config(**SIZES, tie_word_embeddings=True)
    return transformers.MistralConfig(**SIZES, sliding_window=None)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral"])
@torch.inference_mode()
def test_logits_match_transformers(kind):
    import transformers

    torch.manual_seed(0)
    config = hf_config(kind)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    for name, p in hf.named_parameters():
        if name.endswith("bias"):  # transformers zero-initializes biases: make them matter
            p.normal_(0, 0.5)
    ours_config = ModelConfig.from_hf_dict(config.to_dict())
    assert ours_config.attention_bias == (kind == "qwen2")
    assert (ours_config.rope_scaling is not None) == (kind == "llama3")
    ours = build_model(ours_config, hf.state_dict())
    ids = torch.randint(0, SIZES["vocab_size"], (200,)).tolist()  # past 64: llama3 scaling matters
    torch.testing.assert_close(dense_logits(ours, ids), hf(torch.tensor([ids])).logits[0], atol=1e-4, rtol=1e-4)


def test_a_sliding_window_caps_the_context_so_full_attention_stays_exact():
    import transformers

    config = transformers.MistralConfig(**SIZES, sliding_window=128)
    assert ModelConfig.from_hf_dict(config.to_dict()).max_position_embeddings == 128
