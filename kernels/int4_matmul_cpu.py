"""x @ W^T for a 4-bit weight in Q4_1 form on the CPU (``csrc/int4_matmul_cpu.cpp``, built with
the other CPU kernels by ``kernels.cpu_extension``): each weight widened to float in registers
as it is read, float activations, for the few rows of edged's batch-1 forwards (one token, or a
token and its speculative drafts). A row's result does not depend on how many rows come with it.
``int4_dequantize_cpu`` widens the whole weight once, for a prefill's plain GEMM.

Where the extension cannot be built, both take ``Int4Weight.dequantize`` (the same values, the
products rounded in another order).
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels
from kernels.triton_int4_matmul import Int4Weight


def int4_matmul_cpu(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """``x`` [M, K] float32 times ``weight`` [N, K] (group 32) transposed: [M, N] float32.

    Raises ValueError for another group size or a K that does not match the weight.
    """
    _check_group(weight)
    half_k = weight.packed.shape[1]
    if x.dim() != 2 or x.shape[1] != 2 * half_k:
        raise ValueError(f"int4_matmul_cpu: x must be [M, {2 * half_k}], got {list(x.shape)}")
    module = cpu_kernels()
    if module is None:
        return x.float() @ weight.dequantize(torch.float32).T
    return module.int4_matmul(x.float().contiguous(), weight.packed, weight.scales, weight.minimums)


def int4_dequantize_cpu(weight: Int4Weight) -> torch.Tensor:
    """``weight`` [N, K] (group 32) as float32: scale * code + minimum. Raises ValueError for
    another group size."""
    _check_group(weight)
    module = cpu_kernels()
    if module is None:
        return weight.dequantize(torch.float32)
    return module.int4_dequantize(weight.packed, weight.scales, weight.minimums)


def _check_group(weight: Int4Weight) -> None:
    if weight.group != 32:
        raise ValueError(f"int4 CPU kernels: groups of 32 columns, got {weight.group}")
