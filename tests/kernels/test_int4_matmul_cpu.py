"""The CPU int4 kernels against the naive reference: ``Int4Weight.dequantize``, multiplied plainly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu_extension import cpu_kernels
from kernels.int4_matmul_cpu import int4_dequantize_cpu, int4_matmul_cpu
from kernels.triton_int4_matmul import Int4Weight

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU extension cannot be built here")


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 19), outputs=st.integers(1, 70), groups=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_int4_matmul_is_the_dequantized_weights_product(rows, outputs, groups, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = Int4Weight.quantize(torch.randn(outputs, 32 * groups, generator=generator))
    x = torch.randn(rows, 32 * groups, generator=generator)
    y = int4_matmul_cpu(x, weight)
    torch.testing.assert_close(y, x @ weight.dequantize(torch.float32).T, atol=1e-4, rtol=1e-4)
    # a row's result does not depend on the rows beside it (speculation's drafts)
    for r in range(rows):
        assert torch.equal(int4_matmul_cpu(x[r:r + 1], weight)[0], y[r])


def test_int4_matmul_rejects_what_it_cannot_multiply():
    weight = Int4Weight.quantize(torch.randn(16, 64))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        int4_matmul_cpu(torch.randn(2, 32), weight)
    wide_groups = Int4Weight.quantize(torch.randn(16, 128), group=64)
    with pytest.raises(ValueError, match="groups of 32 columns"):
        int4_matmul_cpu(torch.randn(2, 128), wide_groups)
    with pytest.raises(ValueError, match="groups of 32 columns"):
        int4_dequantize_cpu(wide_groups)


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(outputs=st.integers(1, 40), groups=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_int4_dequantize_gives_each_weights_value(outputs, groups, seed):
    weight = Int4Weight.quantize(torch.randn(outputs, 32 * groups, generator=torch.Generator().manual_seed(seed)))
    torch.testing.assert_close(int4_dequantize_cpu(weight), weight.dequantize(torch.float32), atol=1e-6, rtol=1e-6)
