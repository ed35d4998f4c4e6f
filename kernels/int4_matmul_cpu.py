"""x @ W^T for a 4-bit weight in Q4_1 form on the CPU (``csrc/int4_matmul_cpu.cpp``, built with
the other CPU kernels by ``kernels.cpu_extension``): each weight widened to float in registers
as it is read, float activations, for the few rows of edged's batch-1 forwards (one token, or a
token and its speculative drafts). A row's result does not depend on how many rows come with it.

Where the extension cannot be built, the weight is dequantized and multiplied plainly (the same
products, rounded in another order).
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels
from kernels.triton_int4_matmul import Int4Weight


def int4_matmul_cpu(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """``x`` [M, K] float32 times ``weight`` [N, K] (group 32) transposed: [M, N] float32.

    Raises ValueError for another group size or a K that does not match the weight.
    """
    n, half_k = weight.packed.shape
    if weight.group != 32:
        raise ValueError(f"int4_matmul_cpu: groups of 32 columns, got {weight.group}")
    if x.dim() != 2 or x.shape[1] != 2 * half_k:
        raise ValueError(f"int4_matmul_cpu: x must be [M, {2 * half_k}], got {list(x.shape)}")
    module = cpu_kernels()
    if module is None:
        return x.float() @ weight.dequantize(torch.float32).T
    return module.int4_matmul(x.float().contiguous(), weight.packed, weight.scales, weight.minimums)
