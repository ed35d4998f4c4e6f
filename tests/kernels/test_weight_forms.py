"""Weights in another form (``kernels.weight_forms``), whatever the form: the handle stands in for
the weight where the layer functions take it, compiled callers reach the form through the custom
op at any row count, and a stale multiply by the handle itself fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import onednn_linear
from kernels.int8_linear import Int8Linear, int8_products_usable
from kernels.onednn_linear import PackedLinear
from kernels.weight_forms import form_linear, form_of, weight_linear

FORMS = [pytest.param(PackedLinear, marks=pytest.mark.skipif(not onednn_linear.supported(torch.float32),
                                                               reason="this torch build has no oneDNN")),
         pytest.param(Int8Linear, marks=pytest.mark.skipif(not int8_products_usable(),
                                                             reason="the CPU kernels do not build here"))]


@pytest.mark.parametrize("form", FORMS)
def test_a_compiled_function_calls_it_at_any_row_count(form):
    w, b = torch.randn(24, 16), torch.randn(24)
    layer = form(w, b)
    compiled = torch.compile(lambda x, handle, bias: F.silu(form_linear(x, handle, bias)) * 2, dynamic=True)
    for rows in (3, 17, 64):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x, layer.weight, b), F.silu(layer(x)) * 2)
        assert torch.equal(weight_linear(x, layer.weight, b), layer.form.linear(x, b))


@pytest.mark.parametrize("form", FORMS)
def test_multiplying_by_the_handle_as_if_it_were_the_weight_fails_loudly(form):
    layer = form(torch.randn(8, 4))
    assert layer.weight.shape == (8, 4) and layer.weight.dtype == torch.int8
    with pytest.raises(RuntimeError):
        F.linear(torch.randn(2, 4), layer.weight)


def test_a_tensor_that_is_no_handle_names_no_form():
    with pytest.raises(KeyError):
        form_of(torch.zeros(2, 2, dtype=torch.int8))
