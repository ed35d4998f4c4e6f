"""The CPU softmax of GEMM attention (``csrc/softmax_lse_cpu.cpp``, built with the other CPU
kernels by ``kernels.cpu_extension``): scores from ``q @ k^T`` turned into probabilities in
place, each row over its first ``visible`` keys (a causal mask as counts), with each row's
log-sum-exp; one pass per row in place of torch's several over the whole score tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu_extension import cpu_kernels

# (scores [B, M, L] float32 | bfloat16 | float16 contiguous, modified in place; visible [M] int64 in [1, L];
#  scale) -> lse [B, M] float32
SoftmaxLse = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def softmax_lse_kernel() -> SoftmaxLse | None:
    """The compiled kernel, or None where the CPU extension cannot be built here."""
    module = cpu_kernels()
    return None if module is None else module.softmax_lse_
