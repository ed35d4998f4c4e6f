"""Each row's first largest value on the CPU (``csrc/argmax_cpu.cpp``, built with the other CPU
kernels by ``kernels.cpu_extension``): greedy sampling over a step's logits, in their own dtype.
``argmax_rows`` falls back to ``torch.max``'s indices (the same first-of-ties index) wherever the
extension is not built or the tensor is not on the CPU."""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [rows, n] without NaN -> [rows] int64
    module = cpu_kernels() if x.is_cpu else None
    if module is None or x.shape[1] == 0:
        # NOTE: max's indices, not argmax: on a CPU argmax over bf16 is a scalar loop
        return x.max(dim=-1).indices
    return module.argmax_rows(x)
