"""Merging partial attention results by log-sum-exp (kernels.triton_merge_partials)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.triton_merge_partials import merge_partials, reference_merge_partials


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 4), slots=st.integers(2, 6))
def test_merge_equals_reference_and_ignores_unused_slots(device, seed, rows, slots):
    g = torch.Generator().manual_seed(seed)
    heads, dim = 3, 16
    out = torch.randn(rows, slots, heads, dim, generator=g)
    lse = torch.randn(rows, slots, heads, generator=g) * 3
    unused = torch.rand(rows, slots, heads, generator=g) < 0.4
    unused[:, 0] = False  # every (row, head) keeps one slot
    lse[unused] = float("-inf")
    out[unused[..., None].expand_as(out)] = float("nan")  # an unused slot's output is undefined
    merged = merge_partials(out.to(device), lse.to(device), torch.float32).cpu()
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged, reference_merge_partials(out, lse, torch.float32), atol=1e-5, rtol=1e-5)


def test_merging_two_halves_gives_the_whole_softmax(device):
    """Attention over 8 keys = the merge of attention over keys 0-3 and keys 4-7."""
    g = torch.Generator().manual_seed(3)
    scores, values = torch.randn(8, generator=g), torch.randn(8, 16, generator=g)
    whole = torch.softmax(scores, 0) @ values
    halves = [(torch.softmax(s, 0) @ v, torch.logsumexp(s, 0)) for s, v in ((scores[:4], values[:4]), (scores[4:], values[4:]))]
    out = torch.stack([h[0] for h in halves])[None, :, None, :]  # [1 row, 2 slots, 1 head, 16]
    lse = torch.stack([h[1] for h in halves])[None, :, None]
    torch.testing.assert_close(merge_partials(out.to(device), lse.to(device), torch.float32)[0, 0].cpu(), whole,
                               atol=1e-5, rtol=1e-5)
