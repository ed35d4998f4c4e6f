"""The CPU softmax of GEMM attention against plain torch: probabilities in place over each row's
visible keys (zeros after) and each row's log-sum-exp; and GEMM attention against dense."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import attention_with_lse, gemm_attention
from kernels.softmax_lse_cpu import softmax_lse_kernel

pytestmark = pytest.mark.skipif(softmax_lse_kernel() is None, reason="no C++ compiler: the torch path runs instead")


def visible_counts(seed: int, rows: int, keys: int) -> torch.Tensor:
    return torch.randint(1, keys + 1, (rows,), generator=torch.Generator().manual_seed(seed))


# NOTE: bf16 runs the 16-lane path where the CPU has AVX-512 BF16: key counts around multiples of
# 16 take its masked tails.
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), rows=st.integers(1, 40), keys=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_softmax_in_place_equals_plain_torch(seed, batch, rows, keys, dtype):
    torch.manual_seed(seed)
    scores = (torch.randn(batch, rows, keys) * 4).to(dtype)
    visible = visible_counts(seed, rows, keys)
    hidden = torch.arange(keys)[None, :] >= visible[:, None]  # [rows, keys]
    want = (scores.float() * 0.3).masked_fill(hidden, float("-inf"))
    lse = softmax_lse_kernel()(scores, visible, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 4e-3  # bf16: the probabilities' own rounding
    torch.testing.assert_close(scores.float(), want.softmax(-1), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want.logsumexp(-1), atol=1e-5, rtol=1e-5)
    assert scores.dtype == dtype and bool((scores.float()[:, hidden] == 0).all())


def test_gemm_attention_equals_the_float32_twin():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 12, 32), torch.randn(2, 20, 32), torch.randn(2, 20, 32)
    visible = visible_counts(0, 12, 20)
    mask = torch.zeros(12, 20).masked_fill(torch.arange(20)[None, :] >= visible[:, None], float("-inf"))
    out, lse = gemm_attention(q, k, v, visible, 0.2, softmax_lse_kernel())
    want_out, want_lse = attention_with_lse(q, k, v, mask, 0.2)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused():
    kernel = softmax_lse_kernel()
    scores = torch.randn(1, 2, 5)
    with pytest.raises(RuntimeError, match="between 1 and keys"):
        kernel(scores, torch.tensor([0, 3]), 1.0)
    with pytest.raises(RuntimeError, match="between 1 and keys"):
        kernel(scores, torch.tensor([6, 3]), 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(scores, torch.tensor([1, 3], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.randn(1, 5, 2).transpose(1, 2), torch.tensor([1, 3]), 1.0)
