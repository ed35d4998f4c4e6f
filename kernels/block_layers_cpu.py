"""A decoder layer's two dense halves for a few rows on the CPU, over weights in blocks of 32
columns (``kernels.block_matmul_cpu``): ``kernels.layer_math.attention_inputs`` and
``attention_outputs`` each in one C++ call (``csrc/block_layer_cpu.cpp``) instead of ~20 torch
ops, which is most of a one-token forward's time on a small model.

Float32 activations; the results equal the torch ops' up to rounding, and a row's result does
not depend on the rows beside it (bit for bit). Needs the CPU kernels (``cpu_kernels()`` not
None); callers keep the torch ops where they are missing.
"""

from __future__ import annotations

import torch

from kernels.block_matmul_cpu import PackedBlockWeight, kernel_args
from kernels.cpu_extension import cpu_kernels


def block_attention_inputs(
    x: torch.Tensor,  # [T, hidden] float32, contiguous: the residual stream
    norm_weight: torch.Tensor,  # [hidden]
    eps: float,
    qkv: PackedBlockWeight,  # [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,  # [T, 1, head_dim // 2]
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    bf16_products: bool = False,  # kernels.block_matmul_cpu's products in bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, heads, D], k and v [T, kv_heads, D]
    """RMSNorm, the fused QKV projection (+ bias) and rotary on q and k; ValueError on shapes or
    dtypes that do not fit (float32, contiguous)."""
    return cpu_kernels().block_attention_inputs(x, norm_weight, eps, kernel_args(qkv), qkv_bias, cos, sin,
                                                num_heads, num_kv_heads, bf16_products)


def block_attention_outputs(
    x: torch.Tensor,  # [T, hidden] float32, contiguous: the residual stream
    attended: torch.Tensor,  # [T, heads, head_dim] float32, contiguous
    o: PackedBlockWeight,  # [hidden, heads * head_dim]
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: PackedBlockWeight,  # [2 * intermediate, hidden], gate rows first
    down: PackedBlockWeight,  # [hidden, intermediate]
    bf16_products: bool = False,
) -> torch.Tensor:  # [T, hidden] the residual stream after the layer
    """The output projection and residual, RMSNorm, the SwiGLU MLP and residual; ValueError on
    shapes or dtypes that do not fit."""
    return cpu_kernels().block_attention_outputs(x, attended, kernel_args(o), norm_weight, eps, kernel_args(gate_up),
                                                 kernel_args(down), bf16_products)
