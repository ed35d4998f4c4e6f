"""A layer's fused dense halves over block weights against the model's own layer functions
(``shared.model.llama``) run on the same weights dequantized."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.backends.quantize import BlockLinear
from kernels.block_layers_cpu import block_attention_inputs, block_attention_outputs
from kernels.layer_math import attention_inputs, attention_outputs
from tests.kernels.test_block_matmul_cpu import needs_bf16, needs_kernels, random_weight

EPS = 1e-5


def unit_weight(bits: int, outputs: int, columns: int, generator: torch.Generator):
    """A random block weight scaled so that a projection keeps its input's magnitude (as trained
    weights do; unscaled, the MLP's outputs reach 1e5 and float32 rounding dominates the check)."""
    weight = random_weight(bits, outputs, columns, generator)
    weight.scales.div_(columns**0.5)
    weight.minimums.div_(columns**0.5)
    return weight


def float_weight(weight) -> torch.Tensor:
    return weight.dequantize(torch.float32)


def rope(rows: int, head_dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, 1, head_dim // 2, generator=generator) * 6.28
    return angles.cos(), angles.sin()


def inputs_case(bits, rows, heads, kv_heads, head_dim, hidden_groups, with_bias, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = 32 * hidden_groups
    width = (heads + 2 * kv_heads) * head_dim
    qkv = unit_weight(bits, width, hidden, generator)
    bias = torch.randn(width, generator=generator) if with_bias else None
    x = torch.randn(rows, hidden, generator=generator) * 3
    norm = torch.rand(hidden, generator=generator) + 0.5
    return x, norm, qkv, bias, *rope(rows, head_dim, generator)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 9), heads=st.sampled_from([(2, 1), (3, 3), (4, 2)]),
       head_dim=st.sampled_from([8, 16, 64]), hidden_groups=st.integers(1, 3), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attention_inputs_are_the_layer_functions(bits, rows, heads, head_dim, hidden_groups, with_bias, seed):
    x, norm, qkv, bias, cos, sin = inputs_case(bits, rows, *heads, head_dim, hidden_groups, with_bias, seed)
    fused = block_attention_inputs(x, norm, EPS, qkv, bias, cos, sin, *heads)
    reference = attention_inputs(x, norm, EPS, float_weight(qkv), bias, cos, sin, *heads)
    for got, want in zip(fused, reference, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    # a row's q, k and v do not depend on the rows beside it (speculation's drafts)
    for r in range(rows):
        alone = block_attention_inputs(x[r:r + 1], norm, EPS, qkv, bias, cos[r:r + 1], sin[r:r + 1], *heads)
        for got, row in zip(alone, fused, strict=True):
            assert torch.equal(got[0], row[r])


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 9), attended_groups=st.integers(1, 2),
       hidden_groups=st.integers(1, 3), inner_groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_attention_outputs_are_the_layer_functions(bits, rows, attended_groups, hidden_groups, inner_groups, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = 32 * hidden_groups, 32 * inner_groups
    o = unit_weight(bits, hidden, 32 * attended_groups, generator)
    gate_up = unit_weight(bits, 2 * inner, hidden, generator)
    down = unit_weight(bits, hidden, inner, generator)
    x = torch.randn(rows, hidden, generator=generator)
    attended = torch.randn(rows, 2, 16 * attended_groups, generator=generator)
    norm = torch.rand(hidden, generator=generator) + 0.5
    fused = block_attention_outputs(x, attended, o, norm, EPS, gate_up, down)
    reference = attention_outputs(x, attended, float_weight(o), norm, EPS, float_weight(gate_up), float_weight(down))
    torch.testing.assert_close(fused, reference, atol=2e-4, rtol=2e-4)
    for r in range(rows):
        alone = block_attention_outputs(x[r:r + 1], attended[r:r + 1], o, norm, EPS, gate_up, down)
        assert torch.equal(alone[0], fused[r])


def bf16_weight(weight) -> torch.Tensor:
    """``weight`` as a ``BlockLinear``'s stand-in weight whose products are in bf16: the layer
    functions' projections then run the block kernel's bf16 products."""
    layer = BlockLinear(weight)
    layer.bf16_products = True
    return layer.weight


@needs_bf16
@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_bf16_products_reach_every_projection_and_keep_rows_apart(bits, rows, seed):
    """Both halves with bf16 products are the layer functions over bf16 projections (to the odd
    operand that a C++ and a torch RMSNorm or silu round to neighbouring bf16 values), and each
    row is the same alone as with the others."""
    heads = (4, 2)
    x, norm, qkv, bias, cos, sin = inputs_case(bits, rows, *heads, 16, 2, False, seed)
    fused = block_attention_inputs(x, norm, EPS, qkv, bias, cos, sin, *heads, bf16_products=True)
    reference = attention_inputs(x, norm, EPS, bf16_weight(qkv), bias, cos, sin, *heads)
    for got, want in zip(fused, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    generator = torch.Generator().manual_seed(seed)
    o, gate_up, down = (unit_weight(bits, n, k, generator) for n, k in ((64, 64), (128, 64), (64, 64)))
    attended = torch.randn(rows, 4, 16, generator=generator)
    outputs = block_attention_outputs(x, attended, o, norm, EPS, gate_up, down, bf16_products=True)
    reference = attention_outputs(x, attended, bf16_weight(o), norm, EPS, bf16_weight(gate_up), bf16_weight(down))
    torch.testing.assert_close(outputs, reference, atol=1e-2, rtol=1e-2)
    for r in range(rows):
        alone = block_attention_outputs(x[r:r + 1], attended[r:r + 1], o, norm, EPS, gate_up, down, bf16_products=True)
        assert torch.equal(alone[0], outputs[r])


@needs_kernels
def test_silu_holds_for_large_gate_values_of_either_sign():
    """The MLP's silu at gates far from 0, where the sigmoid saturates on either side."""
    generator = torch.Generator().manual_seed(3)
    hidden, inner = 32, 32
    o = unit_weight(8, hidden, 32, generator)
    gate_up = unit_weight(8, 2 * inner, hidden, generator)
    gate_up.scales.mul_(100)  # gates of a hundred or more, both signs
    gate_up.minimums.mul_(100)
    down = unit_weight(8, hidden, inner, generator)
    x, attended, norm = torch.randn(2, hidden, generator=generator), torch.randn(2, 2, 16, generator=generator), torch.ones(hidden)
    fused = block_attention_outputs(x, attended, o, norm, EPS, gate_up, down)
    reference = attention_outputs(x, attended, float_weight(o), norm, EPS, float_weight(gate_up), float_weight(down))
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, reference, atol=1e-3, rtol=1e-4)


@needs_kernels
def test_fused_layers_reject_weights_that_do_not_fit():
    x, norm, qkv, bias, cos, sin = inputs_case(4, 2, 2, 1, 16, 2, False, 0)
    with pytest.raises(ValueError, match="qkv weight"):
        block_attention_inputs(x, norm, EPS, qkv, bias, cos, sin, 3, 1)  # one head too many
    with pytest.raises(ValueError, match="x: 2 x 64 float32"):
        block_attention_inputs(x.double(), norm, EPS, qkv, bias, cos, sin, 2, 1)
    generator = torch.Generator().manual_seed(1)
    o, down = random_weight(4, 64, 32, generator), random_weight(4, 64, 32, generator)
    gate_up = random_weight(4, 96, 64, generator)  # inner 48, but down takes 32
    with pytest.raises(ValueError, match="weights: o"):
        block_attention_outputs(x, torch.randn(2, 2, 16), o, norm, EPS, gate_up, down)
