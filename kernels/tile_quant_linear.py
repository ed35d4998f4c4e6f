"""The layers' projections for small steps on their GGUF's K-quant codes
(``kernels.tile_quant_matmul_cpu``), beside the weights every other step multiplies by.

A projection's ``TileQuantProjection`` is its rows in segments (a fused q/k/v may hold parts of
different formats: q and k Q4_K, v Q6_K), attached to the layer's weight tensor (the dense
weight or its form's handle: ``attach``). ``tile_quant_linear`` is the ``linear`` the layer
functions take: a weight with a projection attached runs the codes' kernel, any other its usual
product (``kernels.weight_forms.weight_linear``), so a model with only
some projections in K-quants still runs. ``TILE_QUANT_LAYERS`` are the layer functions of small
steps (``LlamaModel.small_step_functions``).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from kernels.layer_math import LayerFunctions, attention_inputs, attention_outputs
from kernels.tile_quant_matmul_cpu import TileQuantWeight, tile_quant_matmul
from kernels.weight_forms import weight_linear

_ATTACHED: dict[int, "TileQuantProjection"] = {}  # a weight's data address -> its projection


@dataclass(frozen=True)
class TileQuantProjection:
    """A projection's [N, K] weight as K-quant codes, its rows in ``segments`` (in order)."""

    segments: tuple[TileQuantWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(s.shape[0] for s in self.segments), self.segments[0].shape[1]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [M, K] bf16 times the weight transposed, plus ``bias``: [M, N] bf16."""
        if len(self.segments) == 1:
            return tile_quant_matmul(x, self.segments[0], bias)
        outputs, row = [], 0
        for segment in self.segments:
            rows = segment.shape[0]
            outputs.append(tile_quant_matmul(x, segment, None if bias is None else bias[row:row + rows]))
            row += rows
        return torch.cat(outputs, dim=-1)


def attach(weight: torch.Tensor, projection: TileQuantProjection) -> None:
    """Run ``projection`` where ``tile_quant_linear`` is given ``weight`` (while it lives).
    ValueError where the shapes differ."""
    if tuple(weight.shape) != projection.shape:
        raise ValueError(f"projection {projection.shape} does not fit weight {tuple(weight.shape)}")
    key = weight.data_ptr()
    _ATTACHED[key] = projection
    weakref.finalize(weight.untyped_storage(), _ATTACHED.pop, key, None)


def attached(weight: torch.Tensor) -> TileQuantProjection | None:
    """The projection ``attach`` gave ``weight``; None for a weight without one."""
    return _ATTACHED.get(weight.data_ptr())


def tile_quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] times ``weight`` transposed plus ``bias``: on its attached K-quant codes
    where it has them, else as the weight's own form multiplies."""
    projection = attached(weight)
    return weight_linear(x, weight, bias) if projection is None else projection(x, bias)


TILE_QUANT_LAYERS = LayerFunctions(attention_inputs=functools.partial(attention_inputs, linear=tile_quant_linear),
                                   attention_outputs=functools.partial(attention_outputs, linear=tile_quant_linear))
