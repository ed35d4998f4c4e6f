"""Weight-only int8 and int4 quantization of a model's linear layers (activations stay float).

- **int8**: one symmetric scale per output row; ``torch.ops.aten._weight_int8pack_mm``.
- **int4**: asymmetric, one (scale, zero) per group of ``INT4_GROUP`` input columns, packed for
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (CPU) or ``_weight_int4pack_mm`` (CUDA, bf16).

Embeddings stay float; the LM head (tied to the embeddings in small models) is quantized as its
own copy.
"""

from __future__ import annotations

import torch
from torch import nn

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
        if flat.shape[0] == 1 or flat.is_cuda:
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
        w = linear.weight.detach().float()
        out_features, in_features = w.shape
        if in_features % group or out_features % 16:
            raise ValueError(f"int4 needs in_features a multiple of {group} and out_features of 16, "
                             f"got {in_features} and {out_features}")
        grouped = w.view(out_features, -1, group)
        low, high = grouped.amin(-1), grouped.amax(-1)
        scales = (high - low).clamp(min=1e-8) / 15
        codes = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        codes = codes.view(out_features, in_features)
        # The kernels compute (code - 8) * scale + zero, so zero is the group minimum + 8 scales.
        zeros = low + 8 * scales
        self.group = group
        self.cuda = w.is_cuda
        dtype = torch.bfloat16 if self.cuda else linear.weight.dtype
        self.register_buffer("packed", _pack_int4(codes))
        self.register_buffer("scales_and_zeros", torch.stack([scales.T, zeros.T], dim=-1).contiguous().to(dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.cuda:
            y = torch.ops.aten._weight_int4pack_mm(flat.to(torch.bfloat16), self.packed, self.group,
                                                   self.scales_and_zeros).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int32 codes [N, K] in 0..15 -> the layout the device's int4 matmul expects."""
    if codes.is_cuda:
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)


QUANTIZED_LINEAR = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linears(model: nn.Module, quant: str) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by its ``quant`` twin; "none" is a no-op.

    A tied LM head is quantized from a copy, so the embedding table stays float.
    """
    if quant == "none":
        return model
    if quant not in QUANTIZED_LINEAR:
        raise ValueError(f"unknown quantization {quant!r} (expected none, int8 or int4)")
    make = QUANTIZED_LINEAR[quant]
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(linear))
    return model
