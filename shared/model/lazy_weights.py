"""A checkpoint's weights read from their file one tensor at a time, when a consumer asks.

A GGUF's 1.5B model dequantized all at once is 7 GB of float32; read lazily, a consumer that
copies each weight where it goes holds one tensor at a time, and `read_into` converts a
weight straight into its destination (a bfloat16 parameter's rows, say) without even that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSource:
    """One weight in its file: its shape, and how to read it into a tensor of that shape."""

    shape: tuple[int, ...]
    # writes the weight into `out` [*shape] (any float dtype, contiguous), converting to out's dtype
    read_into: Callable[[torch.Tensor], None]


class LazyWeights(Mapping[str, torch.Tensor]):
    """HF-named weights produced on access: ``weights[name]`` reads the tensor from its file and
    returns a new float32 tensor the caller owns; nothing is retained, so a second access reads
    (and dequantizes) again. Keys, ``len`` and iteration cost nothing."""

    def __init__(self, sources: Mapping[str, TensorSource]) -> None:
        self._sources = dict(sources)

    def __getitem__(self, name: str) -> torch.Tensor:
        out = torch.empty(self._sources[name].shape, dtype=torch.float32)
        self._sources[name].read_into(out)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def source(self, name: str) -> TensorSource:
        """The weight's source, read later; KeyError naming a missing weight."""
        return self._sources[name]


def tensor_source(weights: Mapping[str, torch.Tensor], name: str) -> TensorSource:
    """``weights[name]`` as a TensorSource: a LazyWeights' own (nothing read yet), any other
    Mapping's tensor wrapped. KeyError naming a missing weight."""
    if isinstance(weights, LazyWeights):
        return weights.source(name)
    tensor = weights[name]
    return TensorSource(tuple(tensor.shape), lambda out: out.copy_(tensor))
