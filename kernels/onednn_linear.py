"""Dense products on oneDNN with each weight packed once, for the CPU the engine runs on.

``torch.nn.functional.linear`` on a CPU hands a bf16 product to oneDNN, which reorders the weight
into the blocked layout its AMX or AVX-512 code reads on every call: at the decode rows of a
batched step (16-64 rows) that reorder costs about as much as the product (measured on a 2-core
Xeon with AMX, Qwen2.5-Coder-1.5B's layer shapes at 64 rows: 14.4 ms a layer through ``linear``,
9.9 ms packed). ``PackedLinear`` reorders its weight once, at start-up, and keeps only the packed
copy (the dense one is dropped, so packing costs no memory); ``packed_linear`` multiplies by it.

The packed weight is oneDNN's opaque tensor, which ``torch.compile`` cannot trace, so the layers'
compiled halves reach it through a custom op (``fleetserve::packed_linear``) that inductor calls
as a library kernel, keyed by a *handle*: the layer's ``weight`` becomes a tensor of the dense
weight's shape and int8 dtype that owns one byte (a zero-stride view), whose storage address names
its packed weight. Anything that still multiplied by ``weight`` itself fails on the dtype instead
of computing with a stale copy.

The LM head gets the same in vocabulary slices (``PackedHead``), which ``kernels.greedy_head``'s
slice-at-a-time argmax reads. Whether packing beats plain ``linear`` depends on the CPU and the
shapes (on the Xeon above a 135M model's prefill rows ran faster through ``linear``), so
``shared.engine.kernel_choice`` times both on the model's shapes and packs only where it wins.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from kernels.greedy_head import MAX_VOCAB_SLICE, greedy_over_slices
from kernels.layer_math import LayerFunctions, attention_inputs, attention_outputs

_PACKED: dict[int, torch.Tensor] = {}  # a handle's storage address -> its packed weight


def supported(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU have oneDNN's packed products in ``dtype``."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (CPU, float32 or bfloat16) in oneDNN's blocked layout for linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


@torch.library.custom_op("fleetserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] times the packed weight that ``handle`` names, transposed, plus ``bias``:
    [M, N], what ``nn.functional.linear`` gives on the dense weight (up to the products'
    rounding order)."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[handle.untyped_storage().data_ptr()], bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], handle.shape[0]))


def weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` times ``weight`` transposed plus ``bias``, whichever form the weight is in: a packed
    weight's handle (int8) through ``packed_linear``, a dense one through ``F.linear``."""
    if weight.dtype == torch.int8:
        return packed_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """A bias-optional linear layer whose weight lives only in oneDNN's packed layout.
    ``weight`` is the handle (shape [N, K] like the dense weight, int8, one byte), so a layer
    function passes it where it passed the dense weight and calls ``packed_linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = pack_weight(weight)
        handle = torch.zeros(1, dtype=torch.int8).expand(self.out_features, self.in_features)
        key = handle.untyped_storage().data_ptr()
        _PACKED[key] = packed
        weakref.finalize(handle.untyped_storage(), _PACKED.pop, key, None)
        self.register_buffer("weight", handle, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x.flatten(0, -2), self.weight, self.bias).view(*x.shape[:-1], self.out_features)


class PackedHead(nn.Module):
    """An LM head whose weight is also packed, in vocabulary slices of ``slice_rows``: full logits
    are the slices' products side by side, and ``greedy`` takes each slice's maxima while they
    are in cache, as ``kernels.greedy_head`` does over the dense weight (same tokens, first of
    equals). ``weight`` stays the dense one (a tied head's is the embeddings, which the model
    still reads), so the packed slices are extra memory: the head's size again."""

    def __init__(self, head: nn.Linear, slice_rows: int = MAX_VOCAB_SLICE):
        super().__init__()
        self.weight = head.weight
        self.slice_rows = slice_rows
        vocab = head.weight.shape[0]
        self._slices = [PackedLinear(head.weight[start : start + slice_rows]) for start in range(0, vocab, slice_rows)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        return torch.cat([packed_linear(hidden, part.weight) for part in self._slices], dim=-1)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows] int64
        return greedy_over_slices(hidden.shape[0], ((i * self.slice_rows, packed_linear(hidden, part.weight))
                                                    for i, part in enumerate(self._slices)))


# the layers' dense halves with ``packed_linear`` for their products (weights: the handles)
PACKED_LAYERS = LayerFunctions(attention_inputs=functools.partial(attention_inputs, linear=packed_linear),
                               attention_outputs=functools.partial(attention_outputs, linear=packed_linear))
