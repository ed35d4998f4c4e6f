"""The LM head fused with the greedy choice against the whole logits' first maxima: every vocab
slicing, ties inside and across slices, every dtype."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.greedy_head import MAX_VOCAB_SLICE, MIN_VOCAB_SLICE, greedy_head, greedy_head_reference, vocab_slice_for

DTYPES = [torch.float32, torch.bfloat16]


# NOTE: small integer weights and hidden states make exact ties common, within and across slices
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9), vocab=st.integers(1, 70), dim=st.integers(1, 12),
       vocab_slice=st.integers(1, 80), levels=st.sampled_from([2, 5, 1000]), dtype=st.sampled_from(DTYPES))
def test_the_fused_head_picks_the_first_largest_logit_of_the_whole_row(seed, rows, vocab, dim, vocab_slice, levels,
                                                                        dtype):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randint(0, levels, (rows, dim), generator=g) - levels // 2).to(dtype)
    weight = (torch.randint(0, levels, (vocab, dim), generator=g) - levels // 2).to(dtype)
    logits = torch.nn.functional.linear(hidden, weight).float()
    picked = greedy_head(hidden, weight, vocab_slice)
    assert torch.equal(picked, greedy_head_reference(hidden, weight))
    first_max = [int((row == row.max()).nonzero()[0]) for row in logits]
    assert picked.tolist() == first_max


def test_a_tie_across_slices_keeps_the_earlier_token():
    hidden = torch.ones(1, 1)
    weight = torch.tensor([[0.0], [3.0], [1.0], [3.0]])  # the maximum in both slices of two
    assert greedy_head(hidden, weight, vocab_slice=2).tolist() == [1]


def test_the_default_slice_keeps_a_slices_logits_within_the_cache_budget():
    assert vocab_slice_for(256, torch.bfloat16) == 4096  # 2 MB of logits
    assert vocab_slice_for(256, torch.float32) == 2048
    assert vocab_slice_for(1, torch.float32) == MAX_VOCAB_SLICE
    assert vocab_slice_for(100_000, torch.float32) == MIN_VOCAB_SLICE


def test_the_default_slicing_picks_what_the_whole_logits_pick():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1100, 16, generator=g)
    weight = torch.randn(3000, 16, generator=g)
    assert vocab_slice_for(1100, torch.float32) < 3000
    assert torch.equal(greedy_head(hidden, weight), greedy_head_reference(hidden, weight))
