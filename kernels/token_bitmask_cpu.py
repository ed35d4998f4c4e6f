"""A grammar's token bitmask applied to CPU logits in place (``csrc/token_bitmask_cpu.cpp``,
built with the other CPU kernels by ``kernels.cpu_extension``): every token the mask forbids
becomes -inf, xgrammar's ``apply_token_bitmask_inplace`` contract at a twentieth of its CPU
kernel's time on a structured-output row (most words of the mask all forbidden or all allowed).

``apply_token_bitmask_cpu`` runs the kernel, or ``apply_token_bitmask_reference`` (plain torch,
the same contract) wherever the extension is not built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.cpu_extension import cpu_kernels

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """``logits[r, j] = -inf`` for every row ``r`` of ``rows`` and token ``j`` whose bit in
    ``bitmask[r]`` is 0 (bit ``j % 32`` of word ``j // 32``).

    logits: [batch, vocab] float32, bfloat16 or float16 on the CPU, each row contiguous;
    bitmask: [capacity, ceil(vocab / 32)] int32, contiguous; rows: distinct, each below both
    first dimensions. Raises ValueError otherwise (the kernel's checks).
    """
    module = cpu_kernels()
    if module is None:
        apply_token_bitmask_reference(logits, bitmask, rows)
        return
    module.apply_token_bitmask_(logits, bitmask, torch.tensor(list(rows), dtype=torch.int64))


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """``apply_token_bitmask_cpu`` in plain torch."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"logits [batch, vocab] and bitmask [capacity, >= vocab / 32], got "
                         f"{list(logits.shape)} and {list(bitmask.shape)}")
    index = torch.tensor(list(rows), dtype=torch.int64)
    if len(index) == 0:
        return
    vocab = logits.shape[1]
    allowed = ((bitmask[index, :, None] >> _BITS) & 1).reshape(len(index), -1)[:, :vocab].bool()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
