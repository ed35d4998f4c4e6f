"""The fleet's real model file, Qwen2.5-Coder-1.5B-Instruct Q4_K_M (fetched by ``make model``):
its config, chat template and end of turn read from the GGUF, and its Q4_K and Q6_K tensors read
through the lazy weights exactly as gguf dequantizes them. Cheap: a few small tensors, no model
built (the greedy plan against llama.cpp is tests/cloudd/test_llamacpp_agreement_real.py)."""

import gguf
import numpy as np
import pytest
import torch

from shared.config import model_cache_dir
from shared.model.checkpoint import load_checkpoint
from shared.model.fetch import MODELS
from shared.model.gguf_loader import read_gguf

PATH = model_cache_dir() / MODELS["qwen2.5-coder-1.5b"].filename
pytestmark = pytest.mark.skipif(not PATH.is_file(), reason=f"no {PATH}: `make model` fetches it")


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(PATH)


def test_the_config_is_qwen2_1_5b_with_bias_and_its_own_output_matrix(checkpoint):
    c = checkpoint.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("qwen2", 28, 1536, 12, 2, 128)
    assert c.attention_bias and not c.tie_word_embeddings and "lm_head.weight" in checkpoint.weights


def test_a_turn_is_chatml_and_ends_with_im_end(checkpoint):
    tok = checkpoint.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "bring tote 12 to shelf A3"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert 151645 in tok.eos_token_ids and tok.decode([151645], skip_special_tokens=False) == "<|im_end|>"


@pytest.mark.parametrize("gguf_name, hf_name", [
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),  # Q4_K
    ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),  # Q6_K in this file's first layer
    ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),  # F32
])
def test_tensors_read_lazily_equal_gguf_dequantized(checkpoint, gguf_name, hf_name):
    (tensor,) = [t for t in read_gguf(PATH)[1] if t.name == gguf_name]
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.kind), dtype=np.float32))
    assert torch.equal(checkpoint.weights[hf_name], expected)
