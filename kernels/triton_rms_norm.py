"""RMSNorm, optionally fused with the residual add before it, in Triton (the GPU path; the CPU
runs it under ``TRITON_INTERPRET=1``), with its plain-torch reference
(``reference_add_rms_norm``).

Numerics are HF's (``kernels.layer_math.rms_norm``): the residual sum rounded to the model's
dtype, normalized in float32, rounded, then scaled by the weight in the model's dtype. One
program per row; the whole hidden vector in one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import INTERPRETED, cast
from kernels.layer_math import rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, hidden, eps,
    stride_x, stride_r, stride_o, stride_s,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    inside = c < hidden
    x = tl.load(x_ptr + row * stride_x + c, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + c, mask=inside, other=0.0)
        x = cast(x.to(tl.float32) + residual.to(tl.float32), x.dtype, INTERPRETED)  # rounded as the model's add
        tl.store(sum_ptr + row * stride_s + c, x, mask=inside)
    wide = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(wide * wide, axis=0) / hidden + eps)
    normed = cast(wide * rstd, x.dtype, INTERPRETED).to(tl.float32)
    weight = tl.load(weight_ptr + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, cast(normed * weight, out_ptr.dtype.element_ty, INTERPRETED), mask=inside)


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]: added to x first
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], x + residual, or x itself without one)
    """``rms_norm(x + residual)`` and the sum (the residual stream after the add)."""
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=torch.result_type(x, weight), device=x.device)
    total = torch.empty_like(x) if residual is not None else x
    if rows:
        other = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](
            x, other, weight, out, total, hidden, eps,
            x.stride(0), other.stride(0), out.stride(0), total.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden), INTERPRETED=INTERPRETED,
        )
    return out, total


def reference_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the model's own add and ``rms_norm``."""
    total = x if residual is None else x + residual
    return rms_norm(total, weight, eps), total
