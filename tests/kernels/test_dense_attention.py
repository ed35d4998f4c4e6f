"""edged's dense-buffer attention: short steps on the CPU decode kernel against the plain
scaled-dot-product path, the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.dense_attention import DECODE_BLOCK, DECODE_MAX_TOKENS, DenseAttentionStep
from kernels.paged_decode_cpu import paged_decode_kernel

needs_kernel = pytest.mark.skipif(paged_decode_kernel() is None, reason="the CPU extension cannot be built here")


def _attend(step: DenseAttentionStep, q, k, v, cache):
    k_cache, v_cache = (c.clone() for c in cache)
    out = step.attend(0, q, k, v, (k_cache, v_cache), q.shape[-1] ** -0.5)
    return out, k_cache, v_cache


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, DECODE_MAX_TOKENS), start=st.integers(0, 200), kv_heads=st.sampled_from([1, 2, 3]),
       group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([32, 64]), seed=st.integers(0, 2**16))
def test_short_steps_on_the_decode_kernel_match_the_reference(tokens, start, kv_heads, group, head_dim, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = 4 * DECODE_BLOCK
    cache = tuple(torch.randn(rows, kv_heads, head_dim, generator=generator) for _ in range(2))
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=generator)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=generator) for _ in range(2))
    positions = torch.arange(start, start + tokens)
    step = DenseAttentionStep.over(positions, start + tokens, cache[0])
    assert step.decode_rows is not None
    out, k_cache, v_cache = _attend(step, q, k, v, cache)
    expected, k_expected, v_expected = _attend(DenseAttentionStep(positions, start + tokens), q, k, v, cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_long_steps_and_partial_buffers_keep_the_reference_path():
    positions = torch.arange(0, DECODE_MAX_TOKENS + 1)
    whole_blocks, partial = torch.zeros(4 * DECODE_BLOCK, 2, 64), torch.zeros(4 * DECODE_BLOCK + 1, 2, 64)
    assert DenseAttentionStep.over(positions, len(positions), whole_blocks).decode_rows is None
    assert DenseAttentionStep.over(positions[:1], 1, partial).decode_rows is None
