"""The CPU row argmax against torch: the first index of each row's largest value, any dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.argmax_cpu import argmax_rows
from kernels.cpu_extension import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: torch.max runs instead")


# NOTE: few distinct values make ties common; lengths around multiples of 16 take the masked tail
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9), n=st.integers(1, 70), levels=st.sampled_from([3, 1000]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_first_largest_index_of_every_row(seed, rows, n, levels, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, levels, (rows, n), generator=g) - levels // 2).to(dtype)
    x[torch.rand(rows, n, generator=g) < 0.1] = float("-inf")  # grammar-masked logits
    want = torch.tensor([int((row == row.max()).nonzero()[0]) for row in x.float()])
    assert torch.equal(argmax_rows(x), want)


def test_bad_input_is_refused():
    with pytest.raises(RuntimeError, match=r"\[rows, n\]"):
        cpu_kernels().argmax_rows(torch.zeros(3))
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels().argmax_rows(torch.zeros(2, 3, dtype=torch.int32))
