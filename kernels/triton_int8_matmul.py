"""Weight-only int8 matmul in Triton (the GPU path of edged's torch backend; the CPU runs it
under ``TRITON_INTERPRET=1``), with its plain-torch reference (``reference_int8_matmul``).

The weight is int8 [out_features, in_features] with one symmetric float scale per output row
(``edged.backends.quantize.Int8Linear``'s format): ``weight * scale``. Tiles are converted to
the activations' dtype and multiplied with float32 accumulation, the row's scale applied to the
sum. A GEMV for one row (batch-1 decode), a GEMM for more (prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_support import INTERPRETED, cast, dot_precision, mma

BLOCK_N_GEMV, BLOCK_K_GEMV = 64, 64
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit
def _int8_gemv_kernel(x_ptr, w_ptr, scales_ptr, out_ptr, n_features, k_features, stride_w,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = n < n_features
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_live = k < k_features
        x = tl.load(x_ptr + k, mask=k_live, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n_live[:, None] & k_live[None, :], other=0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    scale = tl.load(scales_ptr + n, mask=n_live, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, cast(acc * scale, out_ptr.dtype.element_ty, INTERPRETED), mask=n_live)


@triton.jit
def _int8_gemm_kernel(x_ptr, w_ptr, scales_ptr, out_ptr, m_rows, n_features, k_features,
                      stride_x, stride_w, stride_o,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_live, n_live = m < m_rows, n < n_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_live = k < k_features
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=m_live[:, None] & k_live[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n_live[:, None] & k_live[None, :], other=0)
        acc += mma(x, tl.trans(w.to(tl.float32).to(x.dtype)), PRECISION, INTERPRETED)  # exact: |w| <= 128
    scale = tl.load(scales_ptr + n, mask=n_live, other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * stride_o + n[None, :], cast(acc * scale[None, :], out_ptr.dtype.element_ty, INTERPRETED),
             mask=m_live[:, None] & n_live[None, :])


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T`` for x [..., K] float, weight int8 [N, K], scales [N]."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    rows, k = flat.shape
    n = weight.shape[0]
    if k != weight.shape[1]:
        raise ValueError(f"x has {k} features, the weight {weight.shape[1]}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 1:
        _int8_gemv_kernel[(triton.cdiv(n, BLOCK_N_GEMV),)](
            flat, weight, scales, out, n, k, weight.stride(0), BLOCK_N=BLOCK_N_GEMV, BLOCK_K=BLOCK_K_GEMV,
            INTERPRETED=INTERPRETED)
    elif rows > 1:
        _int8_gemm_kernel[(triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))](
            flat, weight, scales, out, rows, n, k, flat.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=dot_precision(x.dtype), INTERPRETED=INTERPRETED)
    return out.view(*x.shape[:-1], n)


def reference_int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain torch: dequantize to x's dtype, then matmul."""
    return x @ (weight.to(x.dtype) * scales[:, None].to(x.dtype)).T
