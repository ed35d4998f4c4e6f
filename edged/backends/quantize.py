"""Weight-only int8 and int4 quantization of a model's linear layers (activations stay float).

- **int8**: one symmetric scale per output row; ``torch.ops.aten._weight_int8pack_mm`` on the
  CPU, the Triton GEMV/GEMM of ``kernels.triton_int8_matmul`` on CUDA.
- **int4**: asymmetric, one (scale, minimum) per group of ``INT4_GROUP`` input columns (Q4_1's
  form, ``kernels.triton_int4_matmul.Int4Weight``); packed for
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the CPU, the Triton GEMV/GEMM on CUDA.

Embeddings stay float; the LM head (tied to the embeddings in small models) is quantized as its
own copy.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.triton_int4_matmul import Int4Weight, int4_matmul
from kernels.triton_int8_matmul import int8_matmul

INT4_GROUP = 32


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.is_cuda:
            y = int8_matmul(flat, self.weight, self.scales)
        elif flat.shape[0] == 1:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        else:
            # NOTE: on CPUs without AVX-512 the packed kernel costs ~2 ms per row; a prefill
            # dequantizes the weight once and multiplies plainly (same rounding, same result).
            y = flat @ (self.weight.to(flat.dtype) * self.scales[:, None]).T
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        w = linear.weight.detach()
        out_features, in_features = w.shape
        if in_features % group or out_features % 16:
            raise ValueError(f"int4 needs in_features a multiple of {group} and out_features of 16, "
                             f"got {in_features} and {out_features}")
        quantized = Int4Weight.quantize(w, group)
        self.group = group
        self.on_gpu = w.is_cuda
        if self.on_gpu:  # the Triton kernels read Q4_1's form as it is
            self.register_buffer("packed", quantized.packed)
            self.register_buffer("scales", quantized.scales)
            self.register_buffer("minimums", quantized.minimums)
        else:
            codes = torch.stack([quantized.packed & 15, quantized.packed >> 4], dim=-1).flatten(1).to(torch.int32)
            # torch's kernel computes (code - 8) * scale + zero: zero is the group minimum + 8 scales
            zeros = quantized.minimums + 8 * quantized.scales
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
            self.register_buffer("scales_and_zeros", torch.stack([quantized.scales.T, zeros.T], dim=-1)
                                 .contiguous().to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.on_gpu:
            y = int4_matmul(flat, Int4Weight(self.packed, self.scales, self.minimums, self.group))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


QUANTIZED_LINEAR = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linears(model: nn.Module, quant: str) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by its ``quant`` twin; "none" is a no-op.

    A tied LM head is quantized from a copy, so the embedding table stays float.
    """
    if quant == "none":
        return model
    if quant not in QUANTIZED_LINEAR:
        raise ValueError(f"quantization {quant!r}: the torch backend has none, int8 and int4 (weight-only); "
                         "int4-a8 is an ONNX graph's")
    make = QUANTIZED_LINEAR[quant]
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(linear))
    return model
