"""The CPU block-quantized matmul and dequantize against the naive reference: the weight's own
``dequantize``, multiplied plainly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.block_matmul_cpu import Int8BlockWeight, block_dequantize_cpu, block_matmul_cpu
from kernels.cpu_extension import cpu_kernels
from kernels.triton_int4_matmul import Int4Weight

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU extension cannot be built here")


def random_weight(bits: int, outputs: int, columns: int, generator: torch.Generator):
    if bits == 4:
        return Int4Weight.quantize(torch.randn(outputs, columns, generator=generator))
    scales = torch.rand(outputs, columns // 32, generator=generator) * 0.1
    codes = torch.randint(0, 256, (outputs, columns), generator=generator, dtype=torch.uint8)
    return Int8BlockWeight(codes, scales, -128 * scales)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 27), outputs=st.integers(1, 70), groups=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_block_matmul_is_the_dequantized_weights_product(bits, rows, outputs, groups, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = random_weight(bits, outputs, 32 * groups, generator)
    x = torch.randn(rows, 32 * groups, generator=generator)
    y = block_matmul_cpu(x, weight)
    torch.testing.assert_close(y, x @ weight.dequantize(torch.float32).T, atol=1e-4, rtol=1e-4)
    # a row's result does not depend on the rows beside it (speculation's drafts)
    for r in range(rows):
        assert torch.equal(block_matmul_cpu(x[r:r + 1], weight)[0], y[r])


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from([4, 8]), outputs=st.integers(1, 40), groups=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_block_dequantize_gives_each_weights_value(bits, outputs, groups, seed):
    weight = random_weight(bits, outputs, 32 * groups, torch.Generator().manual_seed(seed))
    torch.testing.assert_close(block_dequantize_cpu(weight), weight.dequantize(torch.float32), atol=1e-6, rtol=1e-6)


def test_block_kernels_reject_what_they_cannot_multiply():
    weight = Int4Weight.quantize(torch.randn(16, 64))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        block_matmul_cpu(torch.randn(2, 32), weight)
    wide_groups = Int4Weight.quantize(torch.randn(16, 128), group=64)
    with pytest.raises(ValueError, match="groups of 32 columns"):
        block_matmul_cpu(torch.randn(2, 128), wide_groups)
    with pytest.raises(ValueError, match="groups of 32 columns"):
        block_dequantize_cpu(wide_groups)
