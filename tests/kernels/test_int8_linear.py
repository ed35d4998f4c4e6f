"""int8 products (``kernels.int8_linear``) against their plain-torch definitions: the C++ passes
around the GEMM give the reference's codes, scales and scaled sums; a product is the exact
integer sums of the quantized operands, scaled, and within the quantization's error bound of the
dense product; compiled callers and a whole model's forward run on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.int8_linear import (Int8Linear, Int8Weight, int8_products_usable, quantize_rows, quantize_rows_reference,
                                 scale_sums, scale_sums_reference)
from kernels.onednn_linear import PackedLinear
from kernels.weight_forms import FORM_LAYERS, form_linear
from shared.model.projection_forms import convert_layer_linears, dense_form
from tests.engine.tiny import dense_logits, tiny_model

pytestmark = pytest.mark.skipif(not int8_products_usable(), reason="the CPU kernels do not build here")
DTYPES = [torch.float32, torch.bfloat16]


def operands(generator: torch.Generator, shape: tuple[int, int], dtype: torch.dtype, zero_rows: int) -> torch.Tensor:
    """Random values at a random magnitude per row, the first ``zero_rows`` rows all zero."""
    x = torch.randn(shape, generator=generator) * torch.rand(shape[0], 1, generator=generator).mul(8).exp2()
    x[:zero_rows] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), zero_rows=st.integers(0, 2), seed=st.integers(0, 999))
def test_rows_quantize_to_the_references_codes_and_scales(dtype, rows, cols, zero_rows, seed):
    x = operands(torch.Generator().manual_seed(seed), (rows, cols), dtype, zero_rows)
    codes, scales = quantize_rows(x)
    want_codes, want_scales = quantize_rows_reference(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert codes.abs().max() <= 127 and torch.equal(scales[:zero_rows], torch.ones(min(zero_rows, rows)))
    nonzero = x[zero_rows:].float().abs().amax(dim=1)
    assert torch.equal(codes[zero_rows:].abs().amax(dim=1), torch.full_like(nonzero, 127, dtype=torch.int8))


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 700), bias=st.booleans(), seed=st.integers(0, 999))
def test_int32_sums_scale_back_as_the_reference_scales_them(dtype, rows, cols, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    sums = torch.randint(-2**24, 2**24, (rows, cols), generator=generator, dtype=torch.int32)
    row_scales, column_scales = torch.rand(rows, generator=generator), torch.rand(cols, generator=generator) / 1e3
    b = torch.randn(cols, generator=generator).to(dtype) if bias else None
    got = scale_sums(sums, row_scales, column_scales, b, dtype)
    want = scale_sums_reference(sums, row_scales, column_scales, b, dtype)
    assert got.dtype == dtype
    # float32: one rounding may differ where the bias add is fused; bf16: then one bf16 step
    tolerance = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), k=st.integers(2, 96), n=st.integers(1, 80), bias=st.booleans(), seed=st.integers(0, 999))
def test_a_product_is_the_exact_sums_of_the_quantized_operands_within_their_error_of_the_dense_one(
        dtype, rows, k, n, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w = operands(generator, (rows, k), dtype, 0), operands(generator, (n, k), dtype, 0)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    layer = Int8Linear(w, b)
    assert layer.weight.shape == (n, k) and layer.weight.dtype == torch.int8  # the handle, one byte
    got = form_linear(x, layer.weight, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    weight: Int8Weight = layer.form
    x_codes, x_scales = quantize_rows_reference(x)
    sums = (x_codes.long() @ weight.codes.long().T).to(torch.int32)  # exact: at most 127^2 * 96
    torch.testing.assert_close(got, scale_sums_reference(sums, x_scales, weight.scales, b, dtype))
    # each operand is off by at most half its row's step: |dy| <= sum |x||dw| + |w||dx| + |dx||dw|
    dense = F.linear(x.double(), w.double(), None if b is None else b.double())
    x_step, w_step = x_scales.double()[:, None] / 2, weight.scales.double()[:, None] / 2
    bound = (x.double().abs() @ w_step.expand(n, k).T + x_step.expand(rows, k) @ w.double().abs().T
             + k * x_step * w_step.T)
    rounding = 2**-7 if dtype == torch.bfloat16 else 1e-5  # of the output's own dtype, and float32 sums
    assert ((got.double() - dense).abs() <= bound * (1 + 1e-6) + rounding * dense.abs().clamp(min=1)).all()
    assert torch.equal(layer(x[None]).squeeze(0), got)  # the module's forward, any leading dims


@pytest.mark.parametrize("compiled", [False, True])
def test_an_int8_models_forward_is_near_the_dense_ones(compiled):
    dense, int8 = tiny_model(seed=3), tiny_model(seed=3)
    assert convert_layer_linears(int8, Int8Linear) == 4 * int8.config.num_layers
    assert convert_layer_linears(int8, Int8Linear) == 0 and dense_form(int8) == "int8"  # already: nothing to do
    int8.use_layer_functions(FORM_LAYERS)
    if compiled:
        int8.compile_layers(min_tokens=2)
    ids = list(range(3, 40))
    got, want = dense_logits(int8, ids), dense_logits(dense, ids)
    assert not torch.equal(got, want)  # it does run the int8 products
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_a_weight_of_one_column_is_refused():
    with pytest.raises(ValueError, match=r"needs \[outputs, inputs >= 2\], got \[8, 1\]"):
        Int8Linear(torch.randn(8, 1))


def test_projections_in_one_form_cannot_become_another():
    model = tiny_model(seed=1)
    convert_layer_linears(model, PackedLinear)
    with pytest.raises(ValueError, match="PackedLinear already: its dense weight is gone"):
        convert_layer_linears(model, Int8Linear)
