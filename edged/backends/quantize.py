"""Weight-only int8 and int4 quantization of a model's linear layers (activations stay float).

- **int8**: one symmetric scale per output row; ``torch.ops.aten._weight_int8pack_mm`` on the
  CPU, the Triton GEMV/GEMM of ``kernels.triton_int8_matmul`` on CUDA.
- **int4**: asymmetric, one (scale, minimum) per group of ``INT4_GROUP`` input columns (Q4_1's
  form, ``kernels.triton_int4_matmul.Int4Weight``), read as it is by
  ``kernels.block_matmul_cpu`` on the CPU and by the Triton GEMV/GEMM on CUDA. A ``BlockLinear``
  can also hold weights quantized elsewhere in that form, 4- or 8-bit: a GGUF's own blocks
  (``edged.backends.gguf_linears``).

Embeddings stay float; the LM head (tied to the embeddings in small models) is quantized as its
own copy.

The model's layer functions (``shared.model.llama``, ``kernels.triton_layers``) take each
projection's ``weight`` and call ``nn.functional.linear`` on it. A quantized layer's ``weight``
is a ``QuantizedWeight``: torch hands ``linear`` calls on it to the layer's own matmul (torch's
``__torch_function__`` protocol), so the same layer functions run float and quantized models.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.block_matmul_cpu import Int8BlockWeight, PackedBlockWeight, block_dequantize_cpu, block_matmul_cpu
from kernels.triton_int4_matmul import Int4Weight, int4_matmul
from kernels.triton_int8_matmul import int8_matmul

INT4_GROUP = 32
# Forwards of more rows than this (prefills) dequantize a block weight on the CPU and multiply
# plainly (kernels.block_matmul_cpu): the float GEMM wins past ~32 rows (a 135M model on a
# 2-core EPYC: 24 rows 94 against 134 ms, 40 rows 215 against 152 ms); speculative forwards stay below.
BLOCK_KERNEL_MAX_ROWS = 32


class QuantizedWeight:
    """What a quantized layer shows as its ``weight``: ``nn.functional.linear(x, weight, bias)``
    runs the layer's matmul (any other torch function on it raises TypeError)."""

    def __init__(self, layer: "QuantizedLinear"):
        self.layer = layer

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.layer.out_features, self.layer.in_features))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is not nn.functional.linear:
            return NotImplemented
        x, weight, bias = _linear_arguments(*args, **(kwargs or {}))
        return weight.layer.project(x, bias)


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is quantized. Subclasses hold the weight's buffers and define
    ``matmul(flat)``: ``flat`` [M, K] times the weight transposed, [M, N]."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.weight = QuantizedWeight(self)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` over ``x``'s last dimension."""
        # NOTE: the layer functions pass [T, hidden]; every op saved here is ~2 us a projection
        y = self.matmul(x) if x.dim() == 2 else self.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class Int8Linear(QuantizedLinear):
    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.register_buffer("codes", torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.is_cuda:
            return int8_matmul(flat, self.codes, self.scales)
        if flat.shape[0] == 1:
            return torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
        # NOTE: on CPUs without AVX-512 the packed kernel costs ~2 ms per row; a prefill
        # dequantizes the weight once and multiplies plainly (same rounding, same result).
        return flat @ (self.codes.to(flat.dtype) * self.scales[:, None]).T


class BlockLinear(QuantizedLinear):
    """A weight in blocks of 32 input columns, ``scale * code + minimum``: 4-bit (``Int4Weight``)
    or 8-bit (``Int8BlockWeight``). On a GPU the 4-bit form runs the Triton GEMV/GEMM and the
    8-bit form is dequantized for each call."""

    def __init__(self, weight: PackedBlockWeight, bias: torch.Tensor | None = None):
        out_features, columns = weight.packed.shape
        super().__init__(columns * (2 if isinstance(weight, Int4Weight) else 1), out_features, bias)
        self.group = weight.group if isinstance(weight, Int4Weight) else None  # None: 8-bit codes
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("minimums", weight.minimums)
        self._block_weight: PackedBlockWeight | None = None  # built on first use, dropped by .to()
        self.bf16_products = False  # the CPU kernels' products in bfloat16 (kernels.block_matmul_cpu)

    @staticmethod
    def quantize(linear: nn.Linear, group: int = INT4_GROUP) -> "BlockLinear":
        """``linear`` rounded to 4 bits, each group of ``group`` columns between its minimum and
        maximum. Raises ValueError when the shape does not allow it."""
        out_features, in_features = linear.weight.shape
        if in_features % group or out_features % 16:
            raise ValueError(f"int4 needs in_features a multiple of {group} and out_features of 16, "
                             f"got {in_features} and {out_features}")
        return BlockLinear(Int4Weight.quantize(linear.weight.detach(), group), linear.bias)

    @property
    def block_weight(self) -> PackedBlockWeight:
        """The weight over this layer's buffers (wherever ``.to()`` has moved them). Kept between
        calls: a one-token forward reads ~120 of them (rebuilding each cost ~0.45 of 12 ms)."""
        if self._block_weight is None:
            self._block_weight = (Int8BlockWeight(self.packed, self.scales, self.minimums) if self.group is None
                                  else Int4Weight(self.packed, self.scales, self.minimums, self.group))
        return self._block_weight

    def _apply(self, fn, recurse: bool = True):  # .to(), .cuda(), ...: the buffers are new tensors
        self._block_weight = None
        return super()._apply(fn, recurse)

    def matmul(self, flat: torch.Tensor) -> torch.Tensor:
        weight = self.block_weight
        if flat.is_cuda:
            if isinstance(weight, Int4Weight):
                return int4_matmul(flat, weight)
            return flat @ weight.dequantize(flat.dtype).T
        if flat.shape[0] > BLOCK_KERNEL_MAX_ROWS:
            return flat @ block_dequantize_cpu(weight).to(flat.dtype).T
        if flat.dtype == torch.float32:
            return block_matmul_cpu(flat.contiguous(), weight, self.bf16_products)
        return block_matmul_cpu(flat.float().contiguous(), weight, self.bf16_products).to(flat.dtype)


QUANTIZED_LINEAR = {"int8": Int8Linear, "int4": BlockLinear.quantize}


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


def _linear_arguments(input, weight, bias=None):  # noqa: A002 -- nn.functional.linear's own names
    return input, weight, bias
