"""The layer functions of an int4 model on the CPU: each layer's dense halves in one C++ call
over its block weights (``kernels.block_layers_cpu``) for forwards of up to
``BLOCK_KERNEL_MAX_ROWS`` tokens (a decode token with its speculative drafts); longer forwards
(prefills) take the plain layer functions, whose projections dequantize for a float GEMM.
The products' precision is the layers' own (``BlockLinear.bf16_products``).

Measured on a 2-core AVX2 EPYC with SmolLM2-135M from its Q4_1 GGUF, at a 630-token context
(interleaved medians): one token 24.2 -> 14.1 ms a forward, thirteen tokens 72.7 -> 62.9 ms.
"""

from __future__ import annotations

import torch

from edged.backends.quantize import BLOCK_KERNEL_MAX_ROWS, QuantizedWeight
from kernels.block_layers_cpu import block_attention_inputs, block_attention_outputs
from kernels.layer_math import LayerFunctions, attention_inputs, attention_outputs


def fused_attention_inputs(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: QuantizedWeight,
                           qkv_bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                           num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.layer_math.attention_inputs`` for a layer whose QKV is a ``BlockLinear``."""
    if x.shape[0] > BLOCK_KERNEL_MAX_ROWS:
        return attention_inputs(x, norm_weight, eps, qkv_weight, qkv_bias, cos, sin, num_heads, num_kv_heads)
    return block_attention_inputs(x, norm_weight, eps, qkv_weight.layer.block_weight, qkv_bias, cos, sin,
                                  num_heads, num_kv_heads, qkv_weight.layer.bf16_products)


def fused_attention_outputs(x: torch.Tensor, attended: torch.Tensor, o_weight: QuantizedWeight,
                            norm_weight: torch.Tensor, eps: float, gate_up_weight: QuantizedWeight,
                            down_weight: QuantizedWeight) -> torch.Tensor:
    """``kernels.layer_math.attention_outputs`` for a layer whose projections are ``BlockLinear``s."""
    if x.shape[0] > BLOCK_KERNEL_MAX_ROWS:
        return attention_outputs(x, attended, o_weight, norm_weight, eps, gate_up_weight, down_weight)
    return block_attention_outputs(x, attended, o_weight.layer.block_weight, norm_weight, eps,
                                   gate_up_weight.layer.block_weight, down_weight.layer.block_weight,
                                   o_weight.layer.bf16_products)


BLOCK_LAYERS_CPU = LayerFunctions(attention_inputs=fused_attention_inputs, attention_outputs=fused_attention_outputs)
