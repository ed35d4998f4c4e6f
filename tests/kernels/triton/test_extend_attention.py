"""Prefill / extend attention over paged KV (kernels.triton_extend_attention) against its
plain-torch reference: cached prefixes through block tables, new tokens causal, GQA."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.triton_extend_attention import ExtendPlan, extend_attention, reference_extend_attention
from tests.kernels.triton.conftest import tolerance

BS, DIM, NUM_BLOCKS = 16, 16, 40


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), num_segments=st.integers(1, 3), decode_rows=st.integers(0, 3),
       group=st.sampled_from([1, 2, 3]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_extend_equals_reference(device, seed, num_segments, decode_rows, group, dtype):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kv_heads = 2
    k = torch.randn(NUM_BLOCKS, BS, kv_heads, DIM, generator=g).to(dtype).to(device)
    v = torch.randn(NUM_BLOCKS, BS, kv_heads, DIM, generator=g).to(dtype).to(device)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    segments, start = [], decode_rows  # segment rows follow the step's decode rows
    for _ in range(num_segments):
        num_cached, num_new = rng.choice([0, rng.randrange(0, 50)]), rng.randrange(1, 45)
        table = [free.pop() for _ in range(-(-(num_cached + num_new) // BS))]
        segments.append((start, num_new, num_cached, table))
        start += num_new
    q = torch.randn(start, kv_heads * group, DIM, generator=g).to(dtype).to(device)
    plan = ExtendPlan.build([(t, c, n) for _, n, c, t in segments], decode_rows, device)
    out = torch.zeros_like(q)
    extend_attention(q, k, v, plan, out, DIM**-0.5)
    torch.testing.assert_close(out.float().cpu(), reference_extend_attention(q, k, v, segments, DIM**-0.5).float().cpu(),
                               **tolerance(dtype))


def test_a_new_token_sees_the_prefix_and_earlier_new_tokens_only(device):
    """Keys after a token's position must not count: values there are huge, so any leak shows."""
    kv_heads, heads = 1, 1
    k = torch.zeros(4, BS, kv_heads, DIM, device=device)
    v = torch.zeros(4, BS, kv_heads, DIM, device=device)
    v[1, :, 0, 0] = torch.arange(BS, dtype=torch.float32)  # value of position p: p in dim 0
    v[2, :, 0, 0] = 1e6  # positions 16.. never visible to the new tokens below
    q = torch.zeros(3, heads, DIM, device=device)  # equal scores: the mean of visible values
    plan = ExtendPlan.build([([1, 2], 5, 3)], 0, device)
    out = torch.zeros_like(q)
    extend_attention(q, k, v, plan, out, 1.0)
    # new token i at position 5 + i sees positions 0 .. 5 + i: mean (5 + i) / 2
    torch.testing.assert_close(out[:, 0, 0].cpu(), torch.tensor([2.5, 3.0, 3.5]))
