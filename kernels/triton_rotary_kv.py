"""Rotary embedding fused with the KV-cache write, in Triton (the GPU path; the CPU runs it
under ``TRITON_INTERPRET=1``), with its plain-torch reference (``reference_rotary_kv``).

For each token: its query heads rotated into a new tensor; its key heads rotated and, with its
value heads, stored at its slot of the paged pools (``slot = block * block_size + offset``).
Rotate-half form, as HF checkpoints store Q/K; the arithmetic is the model's
(``kernels.layer_math.apply_rotary``): cos and sin in the model's dtype, each product and the
sum rounded to it. One program per token, every head of it in one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_layout import write_kv
from kernels.triton_support import INTERPRETED, cast
from kernels.layer_math import RopeTables, apply_rotary


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_slot, stride_ch,
    stride_ot, stride_oh,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.arange(0, HEADS_P2)
    j = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + token * stride_ct + j)[None, :].to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_ct + j)[None, :].to(tl.float32)
    slot = tl.load(slots_ptr + token)

    _rotate_rows(q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * stride_ot, stride_oh, h, h < HEADS, j,
                 cos, sin, HALF, INTERPRETED)
    is_kv = h < KV_HEADS
    _rotate_rows(k_ptr + token * stride_kt, stride_kh, k_cache_ptr + slot * stride_slot, stride_ch, h, is_kv, j,
                 cos, sin, HALF, INTERPRETED)
    cache_rows = slot * stride_slot + h * stride_ch
    v_rows = token * stride_vt + h * stride_vh
    for offset in tl.static_range(0, 2 * HALF, HALF):
        v = tl.load(v_ptr + v_rows[:, None] + offset + j[None, :], mask=is_kv[:, None], other=0.0)
        tl.store(v_cache_ptr + cache_rows[:, None] + offset + j[None, :], v, mask=is_kv[:, None])


@triton.jit
def _rotate_rows(src_ptr, src_stride, dst_ptr, dst_stride, h, live, j, cos, sin, HALF: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """One token's heads ``h`` where ``live``: read at ``src_ptr + head * src_stride``, rotated,
    written at ``dst_ptr + head * dst_stride`` (``j``: the indices of half a head)."""
    src = src_ptr + (h * src_stride)[:, None] + j[None, :]
    x1 = tl.load(src, mask=live[:, None], other=0.0)
    x2 = tl.load(src + HALF, mask=live[:, None], other=0.0)
    first, second = _rotated(x1, x2, cos, sin, INTERPRETED)
    dst = dst_ptr + (h * dst_stride)[:, None] + j[None, :]
    tl.store(dst, first, mask=live[:, None])
    tl.store(dst + HALF, second, mask=live[:, None])


@triton.jit
def _rotated(x1, x2, cos, sin, INTERPRETED: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to x's dtype."""
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    first = cast(a * cos, dtype, INTERPRETED).to(tl.float32) - cast(b * sin, dtype, INTERPRETED).to(tl.float32)
    second = cast(b * cos, dtype, INTERPRETED).to(tl.float32) + cast(a * sin, dtype, INTERPRETED).to(tl.float32)
    return cast(first, dtype, INTERPRETED), cast(second, dtype, INTERPRETED)


def rotary_kv(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    rope: RopeTables,  # cos, sin [T, 1, head_dim // 2] in the model's dtype
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # q rotated [T, heads, head_dim]
    """Rotate q and k; store rotated k and v at their slots; return rotated q."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rotary_kv writes slots of contiguous KV pools")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"rotary_kv needs {name}'s head dimension contiguous")
    cos, sin = (table.reshape(tokens, dim // 2) for table in rope)
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if tokens:
        _rotary_kv_kernel[(tokens,)](
            q, k, v, cos, sin, slot_mapping, q_out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_cache.stride(1), k_cache.stride(2), q_out.stride(0), q_out.stride(1),
            HEADS=heads, KV_HEADS=kv_heads, HEADS_P2=triton.next_power_of_2(max(heads, kv_heads)), HALF=dim // 2,
            INTERPRETED=INTERPRETED,
        )
    return q_out


def reference_rotary_kv(q, k, v, rope: RopeTables, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Plain torch: the model's ``apply_rotary`` and ``write_kv``."""
    write_kv(k_cache, v_cache, apply_rotary(k, rope), v, slot_mapping)
    return apply_rotary(q, rope)
