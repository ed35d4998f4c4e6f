"""Dense products on oneDNN with each weight packed once, for the CPU the engine runs on.

``torch.nn.functional.linear`` on a CPU hands a bf16 product to oneDNN, which reorders the weight
into the blocked layout its AMX or AVX-512 code reads on every call: at the decode rows of a
batched step (16-64 rows) that reorder costs about as much as the product (measured on a 2-core
Xeon with AMX, Qwen2.5-Coder-1.5B's layer shapes at 64 rows: 14.4 ms a layer through ``linear``,
9.9 ms packed). ``PackedLinear`` reorders its weight once, at start-up, and keeps only the packed
copy (the dense one is dropped, so packing costs no memory).

The packed weight is oneDNN's opaque tensor, which ``torch.compile`` cannot trace: it is a weight
form (``kernels.weight_forms``), which the layers reach through a handle and ``form_linear``.

The LM head gets the same in vocabulary slices (``PackedHead``), which ``kernels.greedy_head``'s
slice-at-a-time argmax reads. Whether packing beats plain ``linear`` depends on the CPU and the
shapes (on the Xeon above a 135M model's prefill rows ran faster through ``linear``), so
``shared.engine.kernel_choice`` times both on the model's shapes and packs only where it wins.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.greedy_head import MAX_VOCAB_SLICE, greedy_over_slices
from kernels.weight_forms import FormLinear, form_linear


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


class PackedWeight:
    """A weight form (``kernels.weight_forms.WeightForm``): the weight packed once; its product
    is what ``nn.functional.linear`` gives on the dense weight, up to the sums' order."""

    def __init__(self, weight: torch.Tensor):
        self.packed = pack_weight(weight)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class PackedLinear(FormLinear):
    """A bias-optional linear layer whose weight lives only in oneDNN's packed layout (the dense
    one is not kept); ``weight`` is its handle."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(PackedWeight(weight), *weight.shape, bias)


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
        return torch.cat([form_linear(hidden, part.weight) for part in self._slices], dim=-1)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows] int64
        return greedy_over_slices(hidden.shape[0], ((i * self.slice_rows, form_linear(hidden, part.weight))
                                                    for i, part in enumerate(self._slices)))

