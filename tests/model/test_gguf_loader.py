"""The GGUF loader against transformers' own GGUF loader on the default model."""

import os

import pytest
import torch

from shared.model.gguf_loader import hf_tensor_name

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "", "Hello world", "hello, World!", " leading space", "trailing space ", "12345", "3.14159 and 2e10",
    "a  b   c    d", "\t tabs\tand\nnewlines\n\n\n", "   ", "\n", "café naïve résumé", "Ελληνικά και русский",
    "日本語のテキスト", "emoji 🤖🚀 and 👨‍👩‍👧", "def f(x):\n    return x ** 2  # square\n",
    '{"skills": ["pick", "place"], "n": 3}', "<|im_start|>user\nhi<|im_end|>\n", "<|im_start|><|im_end|>",
    "<|endoftext|>text", "I'm sure they've done it, y'all", "ROBOT_ARM_7: move(x=0.25, y=-1.5)",
    "https://example.com/a?b=c&d=e", "ÀÉÎÕÜ ß ø", "a\r\nb", "<b>html</b> &amp;", "1+1=2; 10*10=100",
    "Don't STOP  me now!!!", "\u200bzero width", "mixed123abc456",
]
CHAT = [
    {"role": "system", "content": "You are a robot planner."},
    {"role": "user", "content": "Pick up the red cube."},
    {"role": "assistant", "content": "move_to(red_cube); grasp()"},
    {"role": "user", "content": "Now place it on the shelf."},
]


@pytest.fixture(scope="module")
def ours(default_checkpoint):
    return default_checkpoint


@pytest.fixture(scope="module")
def gguf_dir(default_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    (folder / default_model_path.name).symlink_to(default_model_path)
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_dir, default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file=default_model_path.name)


@pytest.fixture(scope="module")
def reference_weights(default_model_path, ours):
    """What transformers' GGUF loader produces, built from its own pieces: gguf's reader and name
    table, transformers' q/k un-permutation. (AutoModelForCausalLM.from_pretrained(gguf_file=...)
    gives the same tensors but takes ~50 s on 2 cores.)"""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    c = ours.config
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads})
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_layers)
    gguf_to_hf = {}
    for hf_name in ours.weights:
        stem, _, suffix = hf_name.rpartition(".")
        gguf_to_hf[f"{name_map.get_name(stem)}.{suffix}"] = hf_name
    weights = {}
    for tensor in gguf.GGUFReader(default_model_path).tensors:
        array = processor.process(weights=gguf.quants.dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
        weights[gguf_to_hf[tensor.name]] = torch.from_numpy(array.copy())
    return weights


def test_config_from_metadata(ours):
    c = ours.config
    assert (c.arch, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_match_transformers(ours, hf_tokenizer, text):
    ids = ours.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(ours):
    tok = ours.tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.decode(tok.encode("<|im_start|>user hi<|im_end|>")) == "user hi"
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {0, 2} and tok.vocab_size == 49152
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # file says add_bos_token=False


@pytest.mark.parametrize("turns", [1, 2, 3, 4])
def test_chat_matches_transformers(ours, hf_tokenizer, turns):
    for messages in (CHAT[:turns], CHAT[1:turns + 1]):
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.tokenizer.render_chat(messages) == text
        assert ours.tokenizer.encode_chat(messages) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_weights_match_transformers(ours, reference_weights):
    assert set(ours.weights) == set(reference_weights)
    for name, tensor in reference_weights.items():
        assert ours.weights[name].dtype == torch.float32 and ours.weights[name].shape == tensor.shape, name
        assert torch.equal(ours.weights[name], tensor.float()), name


def test_unknown_tensor_name_is_an_error():
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_conv"):
        hf_tensor_name("blk.0.ssm_conv.weight")
