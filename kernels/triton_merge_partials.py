"""Merging partial attention results by their log-sum-exps, in Triton, with its plain-torch
reference (``reference_merge_partials``).

A row's attention computed in pieces (split-KV ranges, cascade segments) is exact once each
piece's output is weighted by ``exp(lse_piece - lse_total)``: a softmax over the pieces'
log-sum-exps. A piece with log-sum-exp -inf (an empty range, an unused slot) weighs nothing,
whatever its output holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import INTERPRETED, cast


@triton.jit
def _merge_kernel(
    out_ptr, lse_ptr, merged_ptr, slots,
    stride_or, stride_os, stride_oh, stride_lr, stride_ls, stride_mr, stride_mh,
    SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SLOTS)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * stride_lr + s * stride_ls + head, mask=s < slots, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.exp(lse - top)  # every row has one finite slot at least, so top is finite
    used = weights > 0
    parts = tl.load(out_ptr + row * stride_or + s[:, None] * stride_os + head * stride_oh + d[None, :],
                    mask=used[:, None], other=0.0)
    merged = tl.sum(tl.where(used[:, None], parts * weights[:, None], 0.0), axis=0) / tl.sum(weights, axis=0)
    tl.store(merged_ptr + row * stride_mr + head * stride_mh + d, cast(merged, merged_ptr.dtype.element_ty, INTERPRETED))


def merge_partials(
    out: torch.Tensor,  # [rows, slots, heads, head_dim] float32
    lse: torch.Tensor,  # [rows, slots, heads] float32, at least one finite per (row, head)
    dtype: torch.dtype,
) -> torch.Tensor:  # [rows, heads, head_dim] in dtype
    """Each row's exact attention from its partial results."""
    rows, slots, heads, dim = out.shape
    if slots == 1:
        return out[:, 0].to(dtype)
    merged = torch.empty(rows, heads, dim, dtype=dtype, device=out.device)
    if rows:
        _merge_kernel[(rows, heads)](
            out, lse, merged, slots,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), merged.stride(0),
            merged.stride(1), SLOTS=triton.next_power_of_2(slots), HEAD_DIM=dim, INTERPRETED=INTERPRETED,
        )
    return merged


def reference_merge_partials(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain torch: the softmax of the slots' log-sum-exps weighs their outputs."""
    weights = torch.softmax(lse, dim=1)[..., None]  # [rows, slots, heads, 1]
    return torch.where(weights > 0, out * weights, 0.0).sum(dim=1).to(dtype)
