"""The CPU block-quantized matmul and dequantize against the naive reference: the weight's own
``dequantize``, multiplied plainly (for bf16 products: x and the weights rounded to bf16 first)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.block_products as block_products_module
from kernels.block_matmul_cpu import Int8BlockWeight, block_dequantize_cpu, block_matmul_cpu
from kernels.block_products import bf16_products_built, resolve_products
from kernels.cpu_extension import cpu_kernels
from kernels.triton_int4_matmul import Int4Weight

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU extension cannot be built here")
needs_bf16 = pytest.mark.skipif(not bf16_products_built(), reason="bf16 products need a CPU with AVX-512 BF16")


def random_weight(bits: int, outputs: int, columns: int, generator: torch.Generator):
    if bits == 4:
        return Int4Weight.quantize(torch.randn(outputs, columns, generator=generator))
    scales = torch.rand(outputs, columns // 32, generator=generator) * 0.1
    codes = torch.randint(0, 256, (outputs, columns), generator=generator, dtype=torch.uint8)
    return Int8BlockWeight(codes, scales, -128 * scales)


# a weight of 4- or 8-bit blocks and rows of x: up to two whole row tiles and more (1-27 rows)
matmul_operands = given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 27), outputs=st.integers(1, 70),
                        groups=st.integers(1, 6), seed=st.integers(0, 2**16))


def operands(bits: int, rows: int, outputs: int, groups: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = random_weight(bits, outputs, 32 * groups, generator)
    return weight, torch.randn(rows, 32 * groups, generator=generator)


@needs_kernels
@settings(max_examples=40, deadline=None)
@matmul_operands
def test_block_matmul_is_the_dequantized_weights_product(bits, rows, outputs, groups, seed):
    weight, x = operands(bits, rows, outputs, groups, seed)
    y = block_matmul_cpu(x, weight)
    torch.testing.assert_close(y, x @ weight.dequantize(torch.float32).T, atol=1e-4, rtol=1e-4)
    # a row's result does not depend on the rows beside it (speculation's drafts)
    for r in range(rows):
        assert torch.equal(block_matmul_cpu(x[r:r + 1], weight)[0], y[r])


@needs_bf16
@settings(max_examples=40, deadline=None)
@matmul_operands
def test_bf16_products_are_the_rounded_operands_product(bits, rows, outputs, groups, seed):
    weight, x = operands(bits, rows, outputs, groups, seed)
    y = block_matmul_cpu(x, weight, bf16_products=True)
    x16, w16 = x.bfloat16().float(), weight.dequantize(torch.float32).bfloat16().float()
    # the kernel widens a weight with one FMA before rounding it, the reference with a multiply and
    # an add: a weight may round to the neighbouring bf16, at most 2^-8 of it
    bound = 2.0**-8 * (x16.abs() @ w16.abs().T) + 1e-4
    assert ((y - x16 @ w16.T).abs() <= bound).all()
    for r in range(rows):
        assert torch.equal(block_matmul_cpu(x[r:r + 1], weight, bf16_products=True)[0], y[r])


def test_products_auto_is_bf16_where_built(monkeypatch):
    assert resolve_products("auto") == ("bfloat16" if bf16_products_built() else "float32")
    assert resolve_products("float32") == "float32"
    with pytest.raises(ValueError, match="products must be one of"):
        resolve_products("int8")
    monkeypatch.setattr(block_products_module, "bf16_products_built", lambda: False)
    assert resolve_products("auto") == "float32"
    with pytest.raises(ValueError, match="AVX-512 BF16"):
        resolve_products("bfloat16")


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
