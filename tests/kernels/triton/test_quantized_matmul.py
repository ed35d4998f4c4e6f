"""Weight-only int4 (Q4_1-style groups) and int8 matmuls (kernels.triton_int4_matmul,
kernels.triton_int8_matmul) against dequantize-then-matmul: the GEMV (one row) and the GEMM."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.triton_int4_matmul import Int4Weight, int4_matmul, reference_int4_matmul
from kernels.triton_int8_matmul import int8_matmul, reference_int8_matmul
from tests.kernels.triton.conftest import tolerance

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.sampled_from([1, 1, 3, 40]), n=st.sampled_from([16, 70, 96]),
       groups=st.integers(1, 3), group=st.sampled_from([32, 64]), dtype=DTYPES)
def test_int4_matmul_equals_dequantize_then_matmul(device, seed, rows, n, groups, group, dtype):
    g = torch.Generator().manual_seed(seed)
    k = groups * group
    weight = Int4Weight.quantize(torch.randn(n, k, generator=g), group)
    weight = Int4Weight(*(t.to(device) for t in (weight.packed, weight.scales, weight.minimums)), group)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    torch.testing.assert_close(int4_matmul(x, weight).float().cpu(), reference_int4_matmul(x, weight).float().cpu(),
                               **tolerance(dtype) if dtype == torch.float32 else {"atol": 0.15, "rtol": 2e-2})


def test_int4_weight_keeps_a_q4_1_blocks_codes_scales_and_minimums():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), generator=g)
    scales, minimums = torch.rand(16, 2, generator=g), torch.randn(16, 2, generator=g)
    weight = Int4Weight.from_codes(codes, scales, minimums, 32)
    expected = (codes.float().view(16, 2, 32) * scales[..., None] + minimums[..., None]).view(16, 64)
    assert torch.equal(weight.dequantize(torch.float32), expected)


def test_int4_quantization_error_is_within_half_a_step():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    weight = Int4Weight.quantize(w, 32)
    assert ((weight.dequantize(torch.float32) - w).abs().view(16, 2, 32) <= weight.scales[..., None] / 2 + 1e-6).all()


def test_int4_groups_the_kernel_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="power of two >= 32"):
        Int4Weight.quantize(torch.zeros(16, 48), 16)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.sampled_from([1, 1, 5, 33]), n=st.sampled_from([16, 70]),
       k=st.sampled_from([32, 80, 130]), dtype=DTYPES)
def test_int8_matmul_equals_dequantize_then_matmul(device, seed, rows, n, k, dtype):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    scales = (torch.rand(n, generator=g) / 100).to(dtype).to(device)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    torch.testing.assert_close(int8_matmul(x, weight, scales).float().cpu(),
                               reference_int8_matmul(x, weight, scales).float().cpu(),
                               **tolerance(dtype) if dtype == torch.float32 else {"atol": 0.1, "rtol": 3e-2})
