"""Every quant type of the Qwen2.5-Coder GGUFs (Q4_K, Q6_K, Q5_0, Q8_0, F32) loads as gguf's
dequantizer reads it, and gguf's Q4_K/Q6_K dequantizers agree with a naive one written from
llama.cpp's block layout (ggml-quants.c, dequantize_row_q4_K / _q6_K)."""

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model import gguf_loader
from shared.model.checkpoint import load_checkpoint
from shared.model.gguf_loader import hf_tensor_name, read_gguf, unpermute_rope
from tests.model.tiny_gguf import SCALES, write_tiny_gguf

Q = gguf.GGMLQuantizationType
KINDS = [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0, Q.F32]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf", request.param)


def test_the_tiny_files_are_the_qwen2_shapes_in_small_with_every_quant_type(tiny):
    c = load_checkpoint(tiny).config
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (256, 512, 2, 4, 2, 64)
    assert not c.tie_word_embeddings and c.attention_bias == (c.arch == "qwen2")
    assert {t.kind for t in read_gguf(tiny)[1]} == set(KINDS)


# 1: one head of rows per chunk (the smallest chunk), so every q/k weight spans several chunks
@pytest.mark.parametrize("chunk_values", [gguf_loader._CHUNK_VALUES, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_each_type_loads_as_gguf_dequantizes_it(tiny, kind, chunk_values, monkeypatch):
    monkeypatch.setattr(gguf_loader, "_CHUNK_VALUES", chunk_values)
    ckpt = load_checkpoint(tiny)
    tensors = [t for t in read_gguf(tiny)[1] if t.kind == kind]
    assert tensors
    for tensor in tensors:
        name = hf_tensor_name(tensor.name)
        whole = torch.from_numpy(gguf.quants.dequantize(tensor.data, kind).copy())
        expected = unpermute_rope(whole, name, ckpt.config)
        got = ckpt.weights[name]
        assert got.dtype == torch.float32 and torch.equal(got, expected), tensor.name


def test_llama_q_and_k_rows_are_unpermuted(tmp_path):
    ckpt = load_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", "llama"))
    tensor = next(t for t in read_gguf(ckpt.source)[1] if t.name == "blk.0.attn_q.weight")
    stored = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.kind).copy())
    q = ckpt.weights["model.layers.0.self_attn.q_proj.weight"]
    # head 1's rows: llama.cpp interleaves the halves, [x0, x32, x1, x33, ...]
    assert torch.equal(q[64:96], stored[64:128:2]) and torch.equal(q[96:128], stored[65:128:2])


# --- gguf's dequantizers against llama.cpp's layout -----------------------------------------------


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    """llama.cpp's get_scale_min_k4: the j-th 6-bit scale and min of a Q4_K block."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def naive_q4_k(block: bytes) -> list[np.float32]:
    """block_q4_K {fp16 d, fp16 dmin, u8 scales[12], u8 qs[128]} -> 256 values."""
    d, dmin = np.frombuffer(block[:4], np.float16).astype(np.float32)
    scales, q = block[4:16], block[16:144]
    out = []
    for j in range(4):  # 64 values: the low nibbles of 32 bytes, then their high nibbles
        (sc1, m1), (sc2, m2) = _scale_min_k4(2 * j, scales), _scale_min_k4(2 * j + 1, scales)
        d1, dm1, d2, dm2 = d * np.float32(sc1), dmin * np.float32(m1), d * np.float32(sc2), dmin * np.float32(m2)
        out += [d1 * np.float32(q[32 * j + i] & 0xF) - dm1 for i in range(32)]
        out += [d2 * np.float32(q[32 * j + i] >> 4) - dm2 for i in range(32)]
    return out


def naive_q6_k(block: bytes) -> list[np.float32]:
    """block_q6_K {u8 ql[128], u8 qh[64], i8 scales[16], fp16 d} -> 256 values."""
    ql, qh, sc = block[:128], block[128:192], np.frombuffer(block[192:208], np.int8).astype(np.float32)
    d = np.frombuffer(block[208:210], np.float16).astype(np.float32)[0]
    y = [np.float32(0)] * 256
    for n in range(2):  # 128 values from 64 ql bytes, 32 qh bytes and 8 scales
        ql_n, qh_n, sc_n = ql[64 * n:], qh[32 * n:], sc[8 * n:]
        for i in range(32):
            s = i // 16
            q1 = ((ql_n[i] & 0xF) | (((qh_n[i] >> 0) & 3) << 4)) - 32
            q2 = ((ql_n[i + 32] & 0xF) | (((qh_n[i] >> 2) & 3) << 4)) - 32
            q3 = ((ql_n[i] >> 4) | (((qh_n[i] >> 4) & 3) << 4)) - 32
            q4 = ((ql_n[i + 32] >> 4) | (((qh_n[i] >> 6) & 3) << 4)) - 32
            for k, (scale, q) in enumerate(((sc_n[s], q1), (sc_n[s + 2], q2), (sc_n[s + 4], q3), (sc_n[s + 6], q4))):
                y[128 * n + 32 * k + i] = d * scale * np.float32(q)
    return y


def blocks(kind: gguf.GGMLQuantizationType) -> st.SearchStrategy[bytes]:
    """Any bytes of one block, its fp16 scales finite."""
    _, type_size = gguf.GGML_QUANT_SIZES[kind]
    offsets, _ = SCALES[kind]
    scale = st.floats(-2.0, 2.0, width=16).map(lambda x: np.float16(x).tobytes())

    def place(data: bytes, scales: list[bytes]) -> bytes:
        out = bytearray(data)
        for offset, value in zip(offsets, scales):
            out[offset:offset + 2] = value
        return bytes(out)

    return st.builds(place, st.binary(min_size=type_size, max_size=type_size), st.lists(scale, min_size=2, max_size=2))


@pytest.mark.parametrize("kind, naive", [(Q.Q4_K, naive_q4_k), (Q.Q6_K, naive_q6_k)])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_gguf_dequantizes_a_block_as_llama_cpp_lays_it_out(kind, naive, data):
    block = data.draw(blocks(kind))
    ours = gguf.quants.dequantize(np.frombuffer(block, np.uint8), kind)  # [256] float32
    assert np.array_equal(ours, np.array(naive(block), np.float32))
