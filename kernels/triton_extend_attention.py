"""Prefill / extend attention over the paged KV in Triton (the GPU path; the CPU runs it under
``TRITON_INTERPRET=1``), with its plain-torch reference (``reference_extend_attention``).

A step's prefill *segments* (a prompt chunk, or jump-forward drafts) each add ``num_new`` tokens to a sequence with ``num_cached`` tokens in
the pool; their K/V are already written. New token ``i`` (position ``num_cached + i``) attends
to every key at positions ``0 .. num_cached + i``: the cached prefix through the block table,
the new tokens causally. One program per (segment, tile of ``BLOCK_M`` new tokens, query head),
reading its KV head's blocks one at a time with an online softmax.

Contract: ``block_size`` and ``head_dim`` are powers of two, at least 16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import padded_rows
from kernels.triton_support import INTERPRETED, cast, check_tiles, dot_precision, mma

BLOCK_M = 32  # new tokens per program


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    starts_ptr, num_new_ptr, num_cached_ptr, blocks_ptr,
    scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh, stride_blocks,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    segment = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    num_new = tl.load(num_new_ptr + segment)
    num_cached = tl.load(num_cached_ptr + segment)
    start = tl.load(starts_ptr + segment)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # new tokens of this tile
    live = i < num_new
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (start + i)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=live[:, None], other=0.0)
    # keys the tile's last live token sees (none for a tile past the segment's end)
    end = tl.where(tile * BLOCK_M < num_new, num_cached + tl.minimum(num_new, (tile + 1) * BLOCK_M), 0)
    t = tl.arange(0, BLOCK_SIZE)
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for index in range(0, tl.cdiv(end, BLOCK_SIZE)):
        block = tl.load(blocks_ptr + segment * stride_blocks + index)
        offsets = block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + offsets)
        v = tl.load(v_cache_ptr + offsets)
        scores = mma(q, tl.trans(k), PRECISION, INTERPRETED) * scale  # [BLOCK_M, BLOCK_SIZE]
        visible = (index * BLOCK_SIZE + t)[None, :] <= (num_cached + i)[:, None]  # key 0 always: no empty row
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        correction = tl.exp(run_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        run_sum = run_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + mma(cast(probs, v.dtype, INTERPRETED), v, PRECISION, INTERPRETED)
        run_max = new_max
    out = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]
    tl.store(out_ptr + (start + i)[:, None] * stride_ot + head * stride_oh + d[None, :],
             cast(out, out_ptr.dtype.element_ty, INTERPRETED), mask=live[:, None])


@dataclass(frozen=True)
class ExtendPlan:
    """A step's prefill segments as tensors on the pools' device."""

    starts: torch.Tensor  # [S] int64 first row of each segment in the step's flat tokens
    num_new: torch.Tensor  # [S] int64
    num_cached: torch.Tensor  # [S] int64
    blocks: torch.Tensor  # [S, B] int64 each segment's block table (padding never read)
    max_new: int

    @staticmethod
    def build(prefills: Sequence[tuple[Sequence[int], int, int]], first_row: int,
              device: torch.device | str) -> "ExtendPlan":
        """From ``(block_table, num_cached, num_new)`` per segment (``AttentionMetadata.build``'s
        form), their rows laid out one after another from ``first_row``."""
        starts = [first_row]
        for _, _, num_new in prefills:
            starts.append(starts[-1] + num_new)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)
        return ExtendPlan(
            starts=ints(starts[:-1]),
            num_new=ints([n for _, _, n in prefills]),
            num_cached=ints([c for _, c, _ in prefills]),
            blocks=padded_rows([t for t, _, _ in prefills], 0, device),
            max_new=max((n for _, _, n in prefills), default=0),
        )


def extend_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]: the step's flat queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: ExtendPlan,
    out: torch.Tensor,  # [num_tokens, heads, head_dim]: each segment's rows are written
    scale: float,
) -> None:
    """Every segment's new tokens over their context, into their rows of ``out``."""
    _, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_tiles(block_size=block_size, head_dim=dim)
    if plan.max_new == 0:
        return
    grid = (len(plan.num_new), triton.cdiv(plan.max_new, BLOCK_M), heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, plan.starts, plan.num_new, plan.num_cached, plan.blocks, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        out.stride(1), plan.blocks.stride(0),
        GROUP=heads // kv_heads, BLOCK_M=BLOCK_M, BLOCK_SIZE=block_size, HEAD_DIM=dim,
        PRECISION=dot_precision(q.dtype), INTERPRETED=INTERPRETED,
    )


def reference_extend_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: Sequence[tuple[int, int, int, Sequence[int]]],  # (start, num_new, num_cached, block_table)
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]: segment rows filled, the rest zeros
    """Plain torch in float32: each segment's queries over its gathered context, causally."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for start, num_new, num_cached, table in segments:
        n = num_cached + num_new
        k = k_cache[list(table)].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[list(table)].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[start:start + num_new].float(), k) * scale
        hidden = torch.arange(n)[None, :] > torch.arange(num_cached, n)[:, None]
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[start:start + num_new] = torch.einsum("htn,nhd->thd", probs, v).to(q.dtype)
    return out
