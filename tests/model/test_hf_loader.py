"""The HF folder loader on tiny random models saved by transformers."""

import json
import os

import pytest
import torch

from shared.model.checkpoint import load_checkpoint
from shared.model.gguf_loader import build_tokenizer, read_gguf
from shared.model.model_config import RopeScaling
from tests.model.tiny_hf import SIZES, TEMPLATE, save_tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")

@pytest.fixture(scope="module")
def gguf_tokenizer(default_model_path):
    metadata, _ = read_gguf(default_model_path)
    return build_tokenizer(metadata)


def test_llama_folder(tmp_path, gguf_tokenizer):
    from transformers import LlamaConfig

    state = save_tiny(tmp_path, LlamaConfig(**SIZES, tie_word_embeddings=False), gguf_tokenizer,
                      {"chat_template": TEMPLATE, "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"},
                      {"eos_token_id": [2, 7]})
    ckpt = load_checkpoint(tmp_path)
    c = ckpt.config
    assert (c.arch, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("llama", 49152, 32, 2, 4, 2, 8)
    assert not c.tie_word_embeddings and not c.attention_bias and ckpt.source == tmp_path
    assert set(ckpt.weights) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    tok = ckpt.tokenizer
    text = "Robot 7: pick(red) 🤖"
    assert tok.encode(text) == gguf_tokenizer.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {0, 2, 7}
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tied_folder_without_lm_head_and_template_file(tmp_path, gguf_tokenizer):
    from transformers import LlamaConfig

    state = save_tiny(tmp_path, LlamaConfig(**SIZES, tie_word_embeddings=True), gguf_tokenizer)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config.tie_word_embeddings and "lm_head.weight" not in ckpt.weights
    assert set(ckpt.weights) == set(state) - {"lm_head.weight"}
    assert ckpt.tokenizer.chat_template == TEMPLATE and ckpt.tokenizer.eos_token_ids == {0, 2}


def test_qwen2_folder_has_biases(tmp_path, gguf_tokenizer):
    from transformers import Qwen2Config

    state = save_tiny(tmp_path, Qwen2Config(**SIZES, tie_word_embeddings=True), gguf_tokenizer)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.arch == "qwen2" and ckpt.config.attention_bias
    for proj in "qkv":
        name = f"model.layers.1.self_attn.{proj}_proj.bias"
        assert torch.equal(ckpt.weights[name], state[name])


def test_llama3_rope_scaling_folder(tmp_path, gguf_tokenizer):
    from transformers import LlamaConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    save_tiny(tmp_path, LlamaConfig(**SIZES, rope_theta=500000.0, rope_scaling=scaling), gguf_tokenizer)
    c = load_checkpoint(tmp_path).config
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=128)


def test_clear_errors(tmp_path, gguf_tokenizer):
    from transformers import LlamaConfig

    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"expected a \.gguf file or a HF model folder"):
        load_checkpoint(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + b"\0" * 60)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(tmp_path / "bad.gguf")

    folder = tmp_path / "model"
    save_tiny(folder, LlamaConfig(**SIZES), gguf_tokenizer)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_checkpoint(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ValueError, match="model_type 'gemma'"):
        load_checkpoint(folder)
