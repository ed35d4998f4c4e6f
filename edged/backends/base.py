"""The one interface edged's batch-1 loop drives: a model with a single, preallocated KV buffer.

A backend holds KV for positions ``0 .. max_len-1`` of exactly one sequence. ``forward`` writes
the K/V of ``token_ids`` at positions ``start ..`` and returns the logits of the last of them;
whatever the buffer held at ``start`` and beyond is overwritten or stale, and positions below
``start`` must already hold the K/V of the same tokens (the caller tracks which tokens the
buffer holds). ``save_kv``/``load_kv`` move a prefix of the buffer to and from host arrays, so a
pinned system prompt is computed once and copied in afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

# int4-a8: int4 weights with int8 activations, an ONNX CPU graph only (faster, less exact)
QUANTS = ("none", "int8", "int4", "int4-a8")
BACKENDS = ("onnx", "torch")


@dataclass(frozen=True)
class KVSnapshot:
    """The K/V of the first ``length`` positions: ``keys[i]``/``values[i]`` are layer i's
    ``[kv_heads, length, head_dim]`` float32 arrays (C-contiguous)."""

    length: int
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]


class Batch1Backend(Protocol):
    name: str  # "onnx" | "torch"
    quant: str  # one of QUANTS
    max_len: int  # positions the KV buffer holds
    vocab_size: int
    # Whether a one-token forward computes the logits a row of a multi-token forward does (to
    # float rounding). False where activations are quantized per forward path (ONNX int8, int4-a8):
    # the generator then never sends one token alone after position 0.
    row_exact: bool
    # The precision of the int4 block kernel's products ("float32" | "bfloat16",
    # kernels.block_products); None where the forward has no block products.
    products: str | None

    def forward(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Logits ``[vocab]`` float32 (CPU) of the last of ``token_ids`` placed at ``start``.

        Raises ValueError when ``start + len(token_ids) > max_len`` or ``token_ids`` is empty.
        """
        ...

    def forward_rows(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """As ``forward``, but the logits of every one of ``token_ids``: ``[len(token_ids), vocab]``
        float32 (CPU); row i predicts the token after ``token_ids[i]`` (speculative verification)."""
        ...

    def save_kv(self, length: int) -> KVSnapshot:
        """A copy of the K/V of positions ``0 .. length-1``."""
        ...

    def load_kv(self, snapshot: KVSnapshot) -> None:
        """Overwrite positions ``0 .. snapshot.length-1`` with ``snapshot``."""
        ...

    def identity(self) -> str:
        """What the KV depends on (model file, backend, quantization, products, dtype), for cache keys."""
        ...
