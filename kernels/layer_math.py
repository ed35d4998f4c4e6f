"""The dense math of a Llama-family decoder layer in plain torch: HF's RMSNorm, rotary
embeddings in rotate-half form, the SwiGLU MLP, and a layer's two dense halves around attention
(``attention_inputs``, ``attention_outputs``), with ``LayerFunctions`` naming which
implementation of those halves a model runs.

These are the reference numerics: ``shared.model.llama`` runs them, and the device kernels
(``kernels.triton_layers``, ``kernels.triton_rms_norm``, ``kernels.triton_rotary_kv``,
``kernels.weight_forms``) reproduce or reuse them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, head_dim // 2] in the model's dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalized in float32, scaled in the model's dtype."""
    wide = x.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rotary(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated in rotate-half form (as HF checkpoints store Q/K)."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotated(q: torch.Tensor, k: torch.Tensor, rope: RopeTables | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by ``rope``; as they are without one (an ``AttentionStep``'s ``rope``)."""
    return (q, k) if rope is None else (apply_rotary(q, rope), apply_rotary(k, rope))


Linear = Callable[..., torch.Tensor]  # (x [T, K], weight [N, K], bias [N] | None) -> [T, N]


def swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
           linear: Linear = nn.functional.linear) -> torch.Tensor:
    """The SwiGLU MLP with gate and up projections fused into one weight (gate rows first)."""
    gate, up = linear(x, gate_up_weight).chunk(2, dim=-1)
    return linear(nn.functional.silu(gate) * up, down_weight)


def attention_inputs(
    x: torch.Tensor,  # [T, hidden] the residual stream
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    linear: Linear = nn.functional.linear,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, heads, D], k and v [T, kv_heads, D]
    """A layer's dense work before attention: RMSNorm, the fused QKV projection, rotary on q and
    k. ``linear`` multiplies by a weight (``kernels.weight_forms.form_linear``: one in another form)."""
    qkv = linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    head_dim = cos.shape[-1] * 2
    # q and k sit side by side in qkv's rows: one rotation for both
    qk = apply_rotary(qkv[:, : (num_heads + num_kv_heads) * head_dim].view(-1, num_heads + num_kv_heads, head_dim),
                      (cos, sin))
    q, k = qk.split((num_heads, num_kv_heads), dim=1)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    return q, k, v


def attention_outputs(
    x: torch.Tensor,  # [T, hidden] the residual stream
    attended: torch.Tensor,  # [T, heads, D]
    o_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    linear: Linear = nn.functional.linear,
) -> torch.Tensor:  # [T, hidden] the residual stream after the layer
    """A layer's dense work after attention: the output projection and residual, RMSNorm, the
    SwiGLU MLP and residual."""
    x = x + linear(attended.flatten(1), o_weight)
    return x + swiglu(rms_norm(x, norm_weight, eps), gate_up_weight, down_weight, linear)


@dataclass(frozen=True)
class LayerFunctions:
    """The two dense halves of every layer: eager, compiled once for all layers (the weights
    are arguments, so every layer runs the same compiled code), or a device's fused kernels
    (``kernels.triton_layers``)."""

    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = attention_inputs
    attention_outputs: Callable[..., torch.Tensor] = attention_outputs
    # attention_inputs leaves q and k unrotated: the step's attend rotates them (given the tables)
    rotary_in_attention: bool = False
