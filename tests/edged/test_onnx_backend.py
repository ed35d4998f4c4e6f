"""The ONNX Runtime backend against the torch backend, on the default model in fp32.

The fp32 export (~20-40 s) is built once into the cache beside the model and reused by later runs.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime_genai", reason="needs the onnx extra: pip install 'fleetserve[onnx]'")

from edged.backends.base import KVSnapshot  # noqa: E402
from edged.backends.onnx_backend import OnnxBackend  # noqa: E402
from edged.export import export_onnx  # noqa: E402
from edged.quality import PLAN_PROMPTS, greedy_ids  # noqa: E402
from kernels.block_products import bf16_products_built  # noqa: E402
from kernels.ort_ops import ort_ops_library  # noqa: E402

MAX_LEN = 128
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def onnx_fp32(default_model_path):
    return OnnxBackend(export_onnx(default_model_path, "none"), max_len=MAX_LEN, threads=1)


@pytest.fixture(scope="module")
def torch_fp32(default_checkpoint):
    from edged.backends.torch_backend import TorchBackend

    return TorchBackend(default_checkpoint, MAX_LEN, quant="none", device="cpu")


@pytest.fixture(scope="module")
def prompts(default_checkpoint):
    tok = default_checkpoint.tokenizer
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PLAN_PROMPTS[:3]]


def test_fp32_greedy_tokens_equal_torch(onnx_fp32, torch_fp32, prompts):
    for prompt in prompts:
        assert greedy_ids(onnx_fp32, prompt, GREEDY_TOKENS) == greedy_ids(torch_fp32, prompt, GREEDY_TOKENS)


def test_forward_returns_last_logits_as_float32_vector(onnx_fp32, torch_fp32, prompts):
    ours, theirs = onnx_fp32.forward(prompts[0], 0), torch_fp32.forward(prompts[0], 0)
    assert ours.shape == (onnx_fp32.vocab_size,) and ours.dtype == torch.float32
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=1e-3)


def test_save_load_kv_round_trip_gives_same_next_logits(onnx_fp32, prompts):
    prompt, other = prompts[0], prompts[1]
    onnx_fp32.forward(prompt, 0)
    snapshot = onnx_fp32.save_kv(len(prompt))
    expected = onnx_fp32.forward([42], len(prompt))
    onnx_fp32.forward(other, 0)  # clobber the buffer with another sequence
    onnx_fp32.load_kv(snapshot)
    assert torch.equal(onnx_fp32.forward([42], len(prompt)), expected)


def test_snapshot_is_a_copy_in_the_protocol_layout(onnx_fp32, torch_fp32, prompts):
    onnx_fp32.forward(prompts[0], 0)
    torch_fp32.forward(prompts[0], 0)
    ours, theirs = onnx_fp32.save_kv(5), torch_fp32.save_kv(5)
    assert isinstance(ours, KVSnapshot) and ours.length == 5
    assert ours.keys[0].shape == theirs.keys[0].shape and ours.keys[0].dtype == np.float32
    assert ours.keys[0].flags.c_contiguous
    # K is stored after RoPE in both; fp32 kernels differ only in rounding
    np.testing.assert_allclose(ours.keys[3], theirs.keys[3], atol=1e-3)
    np.testing.assert_allclose(ours.values[3], theirs.values[3], atol=1e-3)
    before = ours.keys[0].copy()
    onnx_fp32.forward(prompts[1], 0)
    assert np.array_equal(ours.keys[0], before)


def test_forward_after_common_prefix_equals_full_recompute(onnx_fp32, prompts):
    prompt = prompts[0]
    full = onnx_fp32.forward(prompt, 0)
    split = len(prompt) - 7
    onnx_fp32.forward(prompts[1], 0)  # a different sequence; only its first positions are reused below
    common = next(i for i, (a, b) in enumerate(zip(prompt, prompts[1])) if a != b)
    assert common < split
    onnx_fp32.forward(prompt[common:split], common)  # | shared prefix | recomputed | last 7 |
    resumed = onnx_fp32.forward(prompt[split:], split)
    assert torch.allclose(resumed, full, atol=1e-4, rtol=1e-4)
    assert int(resumed.argmax()) == int(full.argmax())


def test_bad_input_raises_value_error(onnx_fp32):
    with pytest.raises(ValueError, match="max_len"):
        onnx_fp32.forward([1] * (MAX_LEN + 1), 0)
    with pytest.raises(ValueError, match="max_len"):
        onnx_fp32.forward([1, 2], MAX_LEN - 1)
    with pytest.raises(ValueError, match="empty"):
        onnx_fp32.forward([], 0)
    with pytest.raises(ValueError, match="ids"):
        onnx_fp32.forward([onnx_fp32.vocab_size], 0)
    with pytest.raises(ValueError, match="max_len"):
        OnnxBackend(onnx_fp32.model_dir, max_len=10**9)


def test_identity_names_model_backend_quant_and_provider(onnx_fp32):
    identity = onnx_fp32.identity()
    assert identity.startswith("onnx:") and ":none:" in identity and "CPUExecutionProvider" in identity


@pytest.mark.skipif(not bf16_products_built() or ort_ops_library() is None,
                    reason="bf16 products need fleetserve's ONNX Runtime ops and a CPU with AVX-512 BF16")
def test_the_int4_graph_s_identity_names_its_products(default_model_path):
    """Pinned prompts' KV files are keyed by the identity: another products choice computes other KV."""
    backends = {products: OnnxBackend(export_onnx(default_model_path, "int4", products=products), max_len=64, threads=1)
                for products in ("float32", "bfloat16")}
    assert {products: b.products for products, b in backends.items()} == {"float32": "float32", "bfloat16": "bfloat16"}
    assert ":int4+bfloat16-products:" in backends["bfloat16"].identity()
    assert ":int4+float32-products:" in backends["float32"].identity()


def test_forward_rows_give_every_token_s_logits(onnx_fp32, torch_fp32, prompts):
    prompt = prompts[0]
    onnx_fp32.forward(prompt[:-4], 0)
    rows = onnx_fp32.forward_rows(prompt[-4:], len(prompt) - 4)  # [4, vocab]
    assert rows.shape == (4, onnx_fp32.vocab_size) and rows.dtype == torch.float32
    one_by_one = torch.stack([onnx_fp32.forward([t], len(prompt) - 4 + i) for i, t in enumerate(prompt[-4:])])
    assert torch.allclose(rows, one_by_one, atol=1e-4, rtol=1e-4)
    torch_fp32.forward(prompt[:-4], 0)
    assert torch.allclose(rows, torch_fp32.forward_rows(prompt[-4:], len(prompt) - 4), atol=1e-3, rtol=1e-3)
    assert onnx_fp32.row_exact


def test_int8_activation_rows_agree_bit_for_bit_whatever_their_position_in_a_forward(default_model_path, prompts):
    """What the generator relies on when it never sends one token alone to an int4-a8 graph."""
    int4 = OnnxBackend(export_onnx(default_model_path, "int4-a8"), max_len=MAX_LEN, threads=1)
    assert not int4.row_exact
    prompt = prompts[0]
    base = len(prompt) - 8
    int4.forward(prompt[:base], 0)
    together = int4.forward_rows(prompt[base:], base)  # [8, vocab]
    int4.forward(prompt[:base], 0)
    apart = torch.cat([int4.forward_rows(prompt[base:base + 3], base),  # rows in other places, other forwards
                       int4.forward_rows(prompt[base + 2:base + 4], base + 2)[1:],
                       int4.forward_rows(prompt[base + 3:], base + 3)[1:]])
    assert torch.equal(together, apart)
