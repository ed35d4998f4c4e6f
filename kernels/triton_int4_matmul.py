"""Weight-only int4 matmul in Triton (the GPU path of edged's torch backend; the CPU runs it
under ``TRITON_INTERPRET=1``), with its plain-torch reference (``reference_int4_matmul``).

The weight format is Q4_1's: per row and group of ``group`` input columns a float scale and
minimum, each weight ``code * scale + minimum`` with ``code`` in 0..15. Two codes per byte
along the input dimension (``Int4Weight``: even column in the low nibble). Activations stay in
their float dtype; a tile of weights is dequantized to it and multiplied with float32
accumulation. A GEMV for one row (batch-1 decode: no tensor-core tile to fill), a GEMM for more
(prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_support import INTERPRETED, MIN_TILE, cast, dot_precision, mma

BLOCK_N_GEMV = 64
BLOCK_M, BLOCK_N = 32, 64


@dataclass(frozen=True)
class Int4Weight:
    """A [out_features, in_features] weight in Q4_1 form (see the module docstring)."""

    packed: torch.Tensor  # [N, K // 2] uint8
    scales: torch.Tensor  # [N, K // group] float32
    minimums: torch.Tensor  # [N, K // group] float32
    group: int

    @staticmethod
    def quantize(weight: torch.Tensor, group: int = 32) -> "Int4Weight":
        """Round each group to 16 levels between its minimum and maximum."""
        out_features, in_features = weight.shape
        if group < 2 * MIN_TILE or group & (group - 1) or in_features % group:
            raise ValueError(f"int4 groups must be a power of two >= {2 * MIN_TILE} dividing in_features "
                             f"({in_features}), got {group}")
        grouped = weight.detach().float().view(out_features, -1, group)
        low, high = grouped.amin(-1), grouped.amax(-1)
        scales = (high - low).clamp(min=1e-8) / 15
        codes = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
        return Int4Weight.from_codes(codes.view(out_features, in_features), scales, low, group)

    @staticmethod
    def from_codes(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, group: int) -> "Int4Weight":
        """From codes [N, K] in 0..15 and per-group scales and minimums [N, K // group] (a Q4_1
        GGUF's blocks map onto this as they are)."""
        codes = codes.to(torch.uint8)
        return Int4Weight((codes[:, 0::2] | codes[:, 1::2] << 4).contiguous(), scales.float().contiguous(),
                          minimums.float().contiguous(), group)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        codes = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).flatten(1).float()
        n, k = codes.shape
        grouped = codes.view(n, -1, self.group) * self.scales[..., None] + self.minimums[..., None]
        return grouped.view(n, k).to(dtype)


@triton.jit
def _dequantized_halves(packed_ptr, scales_ptr, minimums_ptr, n, n_live, g, stride_p, stride_s,
                        HALF: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Group ``g`` of rows ``n``: the even and odd columns' weights [len(n), HALF] in DTYPE."""
    j = tl.arange(0, HALF)
    bytes_ = tl.load(packed_ptr + n[:, None] * stride_p + g * HALF + j[None, :], mask=n_live[:, None], other=0)
    scale = tl.load(scales_ptr + n * stride_s + g, mask=n_live, other=0.0)[:, None]
    minimum = tl.load(minimums_ptr + n * stride_s + g, mask=n_live, other=0.0)[:, None]
    even = cast((bytes_ & 15).to(tl.float32) * scale + minimum, DTYPE, INTERPRETED)
    odd = cast((bytes_ >> 4).to(tl.float32) * scale + minimum, DTYPE, INTERPRETED)
    return even, odd


@triton.jit
def _int4_gemv_kernel(x_ptr, packed_ptr, scales_ptr, minimums_ptr, out_ptr, n_features, groups,
                      stride_p, stride_s, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = n < n_features
    j = tl.arange(0, GROUP // 2)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, groups):
        x_even = tl.load(x_ptr + g * GROUP + 2 * j).to(tl.float32)
        x_odd = tl.load(x_ptr + g * GROUP + 2 * j + 1).to(tl.float32)
        even, odd = _dequantized_halves(packed_ptr, scales_ptr, minimums_ptr, n, n_live, g, stride_p, stride_s,
                                        GROUP // 2, x_ptr.dtype.element_ty, INTERPRETED)
        acc += tl.sum(even.to(tl.float32) * x_even[None, :] + odd.to(tl.float32) * x_odd[None, :], axis=1)
    tl.store(out_ptr + n, cast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=n_live)


@triton.jit
def _int4_gemm_kernel(x_ptr, packed_ptr, scales_ptr, minimums_ptr, out_ptr, m_rows, n_features, groups,
                      stride_x, stride_p, stride_s, stride_o,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_live, n_live = m < m_rows, n < n_features
    j = tl.arange(0, GROUP // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, groups):
        columns = g * GROUP + 2 * j
        x_even = tl.load(x_ptr + m[:, None] * stride_x + columns[None, :], mask=m_live[:, None], other=0.0)
        x_odd = tl.load(x_ptr + m[:, None] * stride_x + columns[None, :] + 1, mask=m_live[:, None], other=0.0)
        even, odd = _dequantized_halves(packed_ptr, scales_ptr, minimums_ptr, n, n_live, g, stride_p, stride_s,
                                        GROUP // 2, x_ptr.dtype.element_ty, INTERPRETED)
        acc += mma(x_even, tl.trans(even), PRECISION, INTERPRETED) + mma(x_odd, tl.trans(odd), PRECISION, INTERPRETED)
    tl.store(out_ptr + m[:, None] * stride_o + n[None, :], cast(acc, out_ptr.dtype.element_ty, INTERPRETED),
             mask=m_live[:, None] & n_live[None, :])


def int4_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """``x @ weight.T`` for x [..., K] in a float dtype: [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    rows, k = flat.shape
    n = weight.packed.shape[0]
    if k != 2 * weight.packed.shape[1]:
        raise ValueError(f"x has {k} features, the weight {2 * weight.packed.shape[1]}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    groups = k // weight.group
    if rows == 1:
        _int4_gemv_kernel[(triton.cdiv(n, BLOCK_N_GEMV),)](
            flat, weight.packed, weight.scales, weight.minimums, out, n, groups,
            weight.packed.stride(0), weight.scales.stride(0), GROUP=weight.group, BLOCK_N=BLOCK_N_GEMV,
            INTERPRETED=INTERPRETED)
    elif rows > 1:
        _int4_gemm_kernel[(triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))](
            flat, weight.packed, weight.scales, weight.minimums, out, rows, n, groups,
            flat.stride(0), weight.packed.stride(0), weight.scales.stride(0), out.stride(0),
            GROUP=weight.group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=dot_precision(x.dtype),
            INTERPRETED=INTERPRETED)
    return out.view(*x.shape[:-1], n)


def reference_int4_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """Plain torch: dequantize to x's dtype, then matmul."""
    return x @ weight.dequantize(x.dtype).T
