"""A layer's dense halves on the Triton kernels (``kernels.layer_math.LayerFunctions``): RMSNorm
in one kernel, the post-attention residual add fused into the second RMSNorm
(``kernels.triton_rms_norm``), q and k left unrotated for ``kernels.triton_attention``'s step
to rotate as it writes the KV cache. The projections stay the GPU library's GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.triton_rms_norm import add_rms_norm
from kernels.layer_math import LayerFunctions, swiglu


def attention_inputs(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, heads, D], k and v [T, kv_heads, D]: unrotated
    """RMSNorm and the fused QKV projection (``kernels.layer_math.attention_inputs`` without
    the rotary, which the step fuses with its KV write)."""
    normed, _ = add_rms_norm(x, norm_weight, eps)
    qkv = nn.functional.linear(normed, qkv_weight, qkv_bias)
    head_dim = cos.shape[-1] * 2
    return qkv.view(len(x), -1, head_dim).split((num_heads, num_kv_heads, num_kv_heads), dim=1)


def attention_outputs(
    x: torch.Tensor, attended: torch.Tensor, o_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
) -> torch.Tensor:  # [T, hidden] the residual stream after the layer
    """The output projection, its residual add fused into the second RMSNorm, the SwiGLU MLP
    and its residual (``kernels.layer_math.attention_outputs``)."""
    normed, x = add_rms_norm(nn.functional.linear(attended.flatten(1), o_weight), norm_weight, eps, residual=x)
    return x + swiglu(normed, gate_up_weight, down_weight)


TRITON_LAYERS = LayerFunctions(attention_inputs=attention_inputs, attention_outputs=attention_outputs,
                               rotary_in_attention=True)
