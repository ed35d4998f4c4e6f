"""Rotary plus the KV-cache write (kernels.triton_rotary_kv) against the model's rotary and
``write_kv``: rotated queries, rotated keys and values at their slots, nothing else touched."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.triton_rotary_kv import reference_rotary_kv, rotary_kv
from shared.model.llama import RotaryEmbedding
from shared.model.model_config import ModelConfig

BS, NUM_BLOCKS = 16, 8


def rope_for(head_dim: int) -> RotaryEmbedding:
    config = ModelConfig(arch="llama", vocab_size=32, hidden_size=head_dim * 2, intermediate_size=8, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False)
    return RotaryEmbedding(config)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 6), heads=st.sampled_from([(2, 1), (6, 2), (3, 3)]),
       head_dim=st.sampled_from([16, 32]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rotary_kv_equals_the_models(device, seed, tokens, heads, head_dim, dtype):
    num_heads, kv_heads = heads
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    # q, k, v as views of one fused projection output, as the model makes them
    qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q, k, v = qkv.view(tokens, -1, head_dim).split((num_heads, kv_heads, kv_heads), dim=1)
    positions = torch.tensor([rng.randrange(0, 256) for _ in range(tokens)], device=device)
    rope = rope_for(head_dim).to(device).tables(positions, dtype)
    slots = torch.tensor(rng.sample(range(NUM_BLOCKS * BS), tokens), device=device)
    caches = [torch.randn(NUM_BLOCKS, BS, kv_heads, head_dim, generator=g).to(dtype).to(device) for _ in range(2)]
    expected = [c.clone() for c in caches]
    q_out = rotary_kv(q, k, v, rope, *caches, slots)
    q_ref = reference_rotary_kv(q, k, v, rope, *expected, slots)
    assert torch.equal(q_out.cpu(), q_ref.cpu())  # the same roundings as the model's arithmetic
    assert torch.equal(caches[0].cpu(), expected[0].cpu()) and torch.equal(caches[1].cpu(), expected[1].cpu())
