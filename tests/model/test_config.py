from pathlib import Path

import pytest

from shared.config import model_cache_dir
from shared.model.model_config import ModelConfig, RopeScaling, tiny_config


def test_cache_dir_prefers_fleetserve_variable(monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", "/srv/fs")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert model_cache_dir() == Path("/srv/fs/models")


def test_cache_dir_follows_xdg(monkeypatch):
    monkeypatch.delenv("FLEETSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert model_cache_dir() == Path("/xdg/fleetserve/models")


def test_cache_dir_defaults_to_home(monkeypatch):
    monkeypatch.delenv("FLEETSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert model_cache_dir() == Path.home() / ".cache/fleetserve/models"


def test_tiny_config_shape_and_overrides():
    c = tiny_config()
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (97, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.q_size, c.kv_size) == (4, 2, 16, 64, 32)
    assert c.tie_word_embeddings and c.rope_theta == 10000.0 and c.max_position_embeddings == 2048
    assert tiny_config(num_layers=3).num_layers == 3


@pytest.mark.parametrize("overrides, field", [
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"arch": "gpt2"}, "arch"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"head_dim": 15}, "head_dim"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


HF_LLAMA = {
    "model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}


def test_from_hf_dict_llama_defaults():
    c = ModelConfig.from_hf_dict(HF_LLAMA)
    assert c.arch == "llama" and c.head_dim == 16 and c.rope_theta == 500000.0
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert ModelConfig.from_hf_dict({**HF_LLAMA, "attention_bias": True}).attention_bias
    assert not ModelConfig.from_hf_dict({k: v for k, v in HF_LLAMA.items() if k != "tie_word_embeddings"}).tie_word_embeddings


def test_from_hf_dict_qwen2_has_attention_bias():
    assert ModelConfig.from_hf_dict({**HF_LLAMA, "model_type": "qwen2"}).attention_bias


def test_from_hf_dict_llama3_rope_scaling_in_either_key():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    expected = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert ModelConfig.from_hf_dict({**HF_LLAMA, "rope_scaling": scaling}).rope_scaling == expected
    v5 = {k: v for k, v in HF_LLAMA.items() if k != "rope_theta"} | {"rope_parameters": {**scaling, "rope_theta": 7.0}}
    c = ModelConfig.from_hf_dict(v5)
    assert c.rope_scaling == expected and c.rope_theta == 7.0


def test_from_hf_dict_rejects_unsupported_things():
    with pytest.raises(ValueError, match="gemma"):
        ModelConfig.from_hf_dict({**HF_LLAMA, "model_type": "gemma"})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({**HF_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_dict({k: v for k, v in HF_LLAMA.items() if k != "hidden_size"})
