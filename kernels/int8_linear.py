"""Dense products in int8 (W8A8): each weight quantized once per output row, each step's
activations per token, the sums in int32 by the CPU's int8 GEMM.

On CPUs with int8 dot products (AVX-512 VNNI, AMX-INT8) oneDNN's int8 GEMM (``torch._int_mm``)
does twice the multiply-adds of its bf16 one per cycle, and reads half the weight bytes: on a
2-core AMD EPYC, 700-870 against 350-440 GFLOP/s at Qwen2.5-1.5B's projection shapes (64-512
rows). This is what llama.cpp does for its K-quant products too (activations rounded to 8 bits
per block), and it changes the numbers beyond the sums' order, so it is never chosen by timing:
``[engine] kernels = "auto,dense=int8"`` asks for it (``shared.engine.kernel_choice``).

The numbers, for ``x`` [M, K] and a weight [N, K]:

- the weight: ``codes[n] = round(W[n] / s[n])`` with ``s[n] = max|W[n]| / 127`` (1 for a row of
  zeros), once at start-up; the dense weight is dropped (``Int8Weight``);
- the activations: the same per row of ``x`` at every call (``quantize_rows``);
- ``y[m, n] = (sum_k xcodes[m, k] codes[n, k]) * s[n] * xs[m] + bias[n]``, exact int32 sums
  scaled in float32 and rounded once to ``x``'s dtype (``scale_sums``).

Measured on Qwen2.5-Coder-1.5B (its Q4_K/Q6_K weights dequantized, then so quantized): teacher-
forced top-1 agreement with its bf16 greedy plans 99.65 % (the bf16 model's own, batched
differently: 99.83 %). The two passes around the GEMM are C++ (``csrc/int8_rows_cpu.cpp``);
``quantize_rows_reference`` and ``scale_sums_reference`` are the plain-torch definitions the
tests hold them to.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels
from kernels.weight_forms import FormLinear

LARGEST_CODE = 127


def int8_products_usable() -> bool:
    """Whether int8 products run here: the CPU kernels built (their passes around the GEMM)."""
    return cpu_kernels() is not None


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (float) as int8 codes [M, K] and float32 scales [M]: each row's largest
    magnitude / 127 (1 for a row of zeros), codes rounded to nearest even."""
    wide = x.float()
    top = wide.abs().amax(dim=1)
    scales = torch.where(top > 0, top / LARGEST_CODE, torch.ones_like(top))
    codes = (wide / scales[:, None]).round().clamp(-LARGEST_CODE, LARGEST_CODE).to(torch.int8)
    return codes, scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_reference`` in one C++ pass (the same codes and scales); ``x`` must be a
    contiguous CPU [M, K] float32, bfloat16 or float16 tensor."""
    return cpu_kernels().quantize_rows_int8(x.contiguous())


def scale_sums_reference(sums: torch.Tensor, row_scales: torch.Tensor, column_scales: torch.Tensor,
                         bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int32 ``sums`` [M, N] times ``column_scales`` [N] times ``row_scales`` [M], plus
    ``bias`` [N], in float32, rounded to ``dtype``."""
    y = sums.float() * column_scales * row_scales[:, None]
    return (y if bias is None else y + bias.float()).to(dtype)


def scale_sums(sums: torch.Tensor, row_scales: torch.Tensor, column_scales: torch.Tensor,
               bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``scale_sums_reference`` in one C++ pass (float32 rounding may differ in the last bit
    where it fuses the bias add)."""
    return cpu_kernels().scale_int32_rows(sums, row_scales, column_scales,
                                          None if bias is None else bias.to(dtype).contiguous(), dtype)


class Int8Weight:
    """A weight form (``kernels.weight_forms.WeightForm``): ``codes`` [N, K] int8 and ``scales``
    [N] float32, the weight's rows quantized as activations are (``quantize_rows``)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.shape[1] < 2:
            # NOTE: torch._int_mm (2.13, CPU) returns wrong sums for a single column
            raise ValueError(f"an int8 weight needs [outputs, inputs >= 2], got {list(weight.shape)}")
        # NOTE: the C++ pass: torch's ops would leave a float32 copy or two of each weight in
        # the allocator (a 1.5B model's conversion grew the process by 2-4 GB, more in some runs)
        self.codes, self.scales = quantize_rows(weight.detach())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        codes, scales = quantize_rows(x)
        sums = torch._int_mm(codes, self.codes.t())
        return scale_sums(sums, scales, self.scales, bias, x.dtype)


class Int8Linear(FormLinear):
    """A bias-optional linear layer whose weight lives only as int8 codes with a scale per
    output (the dense one is not kept: half the bytes of bf16); ``weight`` is its handle."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(Int8Weight(weight), *weight.shape, bias)
