"""Layer weights kept in a form other than a dense tensor, multiplied through one custom op.

A *form* holds a projection's weight as some product needs it (oneDNN's packed layout:
``kernels.onednn_linear.PackedWeight``; int8 codes with a scale per output:
``kernels.int8_linear.Int8Weight``) and computes ``x @ W^T + bias`` from it. The model's layers
pass weights to their functions (``kernels.layer_math``) as tensors, and ``torch.compile`` cannot
trace a form, so a layer whose weight has a form holds a *handle* in its place: a tensor of the
dense weight's shape and int8 dtype that owns one byte (a zero-stride view), whose storage
address names its form. ``form_linear`` (the custom op ``fleetserve::form_linear``, which
inductor calls as a library kernel) multiplies by the form a handle names. Anything that still
multiplied by ``weight`` itself fails on the dtype instead of computing with a stale copy.
A form lives as long as its handle.
"""

from __future__ import annotations

import functools
import weakref
from typing import Protocol

import torch
from torch import nn

from kernels.layer_math import LayerFunctions, attention_inputs, attention_outputs

_FORMS: dict[int, "WeightForm"] = {}  # a handle's storage address -> its form


class WeightForm(Protocol):
    """A projection's weight [N, K] in some form, and its product."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [M, K] times the weight transposed, plus ``bias``: [M, N] in ``x``'s dtype."""
        ...


def handle_for(form: WeightForm, out_features: int, in_features: int) -> torch.Tensor:
    """A new handle [out_features, in_features] (int8, one byte) naming ``form``."""
    handle = torch.zeros(1, dtype=torch.int8).expand(out_features, in_features)
    key = handle.untyped_storage().data_ptr()
    _FORMS[key] = form
    weakref.finalize(handle.untyped_storage(), _FORMS.pop, key, None)
    return handle


def form_of(handle: torch.Tensor) -> WeightForm:
    """The form ``handle`` names. KeyError for a tensor that is no live handle."""
    return _FORMS[handle.untyped_storage().data_ptr()]


@torch.library.custom_op("fleetserve::form_linear", mutates_args=())
def form_linear(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] times the weight ``handle`` names, transposed, plus ``bias``: [M, N]."""
    return form_of(handle).linear(x, bias)


@form_linear.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], handle.shape[0]))


def weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` times ``weight`` transposed plus ``bias``, whichever form the weight is in: a
    handle (int8) through ``form_linear``, a dense weight through ``F.linear``."""
    if weight.dtype == torch.int8:
        return form_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class FormLinear(nn.Module):
    """A bias-optional linear layer whose weight lives only in ``form``. ``weight`` is its handle
    (shape [N, K] like the dense weight, int8, one byte), so a layer function passes it where it
    passed the dense weight and calls ``form_linear``."""

    def __init__(self, form: WeightForm, out_features: int, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("weight", handle_for(form, out_features, in_features), persistent=False)
        self.bias = bias

    @property
    def form(self) -> WeightForm:
        return form_of(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return form_linear(x.flatten(0, -2), self.weight, self.bias).view(*x.shape[:-1], self.out_features)


# the layers' dense halves with ``form_linear`` for their products (weights: the handles)
FORM_LAYERS = LayerFunctions(attention_inputs=functools.partial(attention_inputs, linear=form_linear),
                             attention_outputs=functools.partial(attention_outputs, linear=form_linear))
