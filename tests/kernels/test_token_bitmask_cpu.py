"""The CPU token-bitmask kernel against xgrammar's own (plain-torch) apply and the plain-torch reference: the
forbidden tokens of the listed rows become -inf, nothing else changes, in every dtype."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu_extension import cpu_kernels
from kernels.token_bitmask_cpu import apply_token_bitmask_cpu, apply_token_bitmask_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 5), vocab=st.integers(1, 200), dtype=st.sampled_from(DTYPES),
       data=st.data())
def test_forbidden_tokens_of_the_listed_rows_become_minus_inf(seed, batch, vocab, dtype, data):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    bitmask.random_(-2**31, 2**31 - 1, generator=g)
    words = bitmask.shape[1]
    bitmask[:, torch.rand(words, generator=g) < 0.3] = 0  # whole words forbidden, and allowed
    bitmask[:, torch.rand(words, generator=g) < 0.3] = -1
    rows = data.draw(st.lists(st.integers(0, batch - 1), unique=True, max_size=batch))
    want = logits.clone()
    if rows:
        # NOTE: xgrammar's plain-torch form: its CPU kernel (0.2.9) wrote outside rows narrower
        # than a few tokens here (a one-token vocabulary's row 2 masked for row 0, heap corruption)
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows, backend="torch_native")
    for apply in (apply_token_bitmask_cpu, apply_token_bitmask_reference):
        got = logits.clone()
        apply(got, bitmask, rows)
        assert torch.equal(got, want)


@pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the torch reference runs instead")
def test_bad_arguments_are_named_not_written():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="row 2"):
        apply_token_bitmask_cpu(logits, xgr.allocate_token_bitmask(2, 64), [2])
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask_cpu(logits, xgr.allocate_token_bitmask(2, 32), [0])
    with pytest.raises(ValueError, match="logits"):
        apply_token_bitmask_cpu(logits.T, xgr.allocate_token_bitmask(64, 2), [0])
    assert torch.equal(logits, torch.zeros(2, 64))
