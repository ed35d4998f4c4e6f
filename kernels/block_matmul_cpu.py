"""x @ W^T on the CPU for a weight quantized in blocks of 32 input columns, each block a scale
and a minimum (``w = scale * code + minimum``): 4-bit ``Int4Weight`` (Q4_1's form; a Q4_0 or
Q4_1 GGUF's blocks as they are) or 8-bit ``Int8BlockWeight`` (a Q8_0 GGUF's). The kernels
(``csrc/block_matmul_cpu.cpp``, built with the other CPU kernels by ``kernels.cpu_extension``)
widen each weight to float in registers as it is read, float activations, for the few rows of
edged's batch-1 forwards (one token, or a token and its speculative drafts); a row's result does
not depend on how many rows come with it. ``block_dequantize_cpu`` widens the whole weight
once, for a prefill's plain GEMM.

**Products.** In float32, or in bfloat16 where the CPU has AVX-512 BF16: x and the widened
weights rounded to bf16 (to nearest even) and multiplied into float32 sums by VDPBF16PS, 32
products an instruction where float FMAs take 16. On a 2-core AVX-512 BF16 EPYC, SmolLM2-135M's
products (a forward's) took 17.5-18 against 24-27 ms for 12 rows and 6.0-6.5 against 6.5-7.0
ms for one (a 4-bit group's bf16 weights looked up from the 16 values its codes stand for).
Which one runs: ``kernels.block_products``; the rounding is that of a bf16 model (``edged
quality`` in docs/edged.md).

Where the extension cannot be built, both take the weight's ``dequantize`` (the same values,
the products rounded in another order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_extension import cpu_kernels
from kernels.triton_int4_matmul import Int4Weight

GROUP = 32  # input columns per block


@dataclass(frozen=True)
class Int8BlockWeight:
    """A [N, K] weight of 8-bit codes, ``scale * code + minimum`` per block of ``GROUP`` columns
    (a Q8_0 block ``d * q``: code ``q + 128``, minimum ``-128 d``)."""

    packed: torch.Tensor  # [N, K] uint8, one code per column
    scales: torch.Tensor  # [N, K // GROUP] float32
    minimums: torch.Tensor  # [N, K // GROUP] float32

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        n, k = self.packed.shape
        blocks = self.packed.view(n, -1, GROUP).float() * self.scales[..., None] + self.minimums[..., None]
        return blocks.view(n, k).to(dtype)


PackedBlockWeight = Int4Weight | Int8BlockWeight  # the torch forms the kernels read


def block_matmul_cpu(x: torch.Tensor, weight: PackedBlockWeight, bf16_products: bool = False) -> torch.Tensor:
    """``x`` [M, K] float32 times ``weight`` [N, K] transposed: [M, N] float32, the products in
    bfloat16 with ``bf16_products``.

    Raises ValueError for a 4-bit weight in groups other than 32, an ``x`` that is not [M, K]
    float32 (contiguous; the kernel's own checks, called once per projection of a forward, so
    kept in C++), or bf16 products where ``kernels.block_products.bf16_products_built()`` is false.
    """
    module = cpu_kernels()
    if module is None:
        if bf16_products:
            raise ValueError("block_matmul: bf16 products need the CPU kernels, which are not built here")
        bits = _bits(weight)
        k = weight.packed.shape[1] * 8 // bits
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"block_matmul: x must be [M, {k}], got {list(x.shape)}")
        return x.float() @ weight.dequantize(torch.float32).T
    return module.block_matmul(x, *kernel_args(weight), bf16_products=bf16_products)


def block_dequantize_cpu(weight: PackedBlockWeight) -> torch.Tensor:
    """``weight`` [N, K] as float32. Raises ValueError for a 4-bit weight in groups other than 32."""
    bits = _bits(weight)
    module = cpu_kernels()
    if module is None:
        return weight.dequantize(torch.float32)
    return module.block_dequantize(weight.packed, weight.scales, weight.minimums, bits)


def kernel_args(weight: PackedBlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(packed, scales, minimums, bits)``: the form the C++ kernels take a block weight in.
    Raises ValueError for a 4-bit weight in groups other than 32."""
    return weight.packed, weight.scales, weight.minimums, _bits(weight)


def _bits(weight: PackedBlockWeight) -> int:
    if isinstance(weight, Int8BlockWeight):
        return 8
    if weight.group != GROUP:
        raise ValueError(f"block CPU kernels: groups of {GROUP} columns, got {weight.group}")
    return 4
