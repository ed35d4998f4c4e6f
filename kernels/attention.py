"""Paged attention, plain-torch reference (the CPU path and the twin of any GPU kernel).

KV lives in per-layer pools ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``.
The token at position ``p`` of a sequence sits at slot
``block_table[p // block_size] * block_size + p % block_size``.

A step's tokens are laid out flat: first one token for each *decode* sequence, then the new
tokens of each *prefill* segment (a chunk of a prompt, after any cached prefix)::

    | decode 0 | decode 1 | ... | prefill A (n_A tokens) | prefill B (n_B tokens) | ...

All masks are built once per step (``AttentionMetadata``), not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSegment:
    """New tokens of one sequence that attend causally to its cached context and to each other."""

    start: int  # first row of the segment in the flat token batch
    num_new: int  # tokens computed this step
    block_table: torch.Tensor  # [num_blocks_for_context] int64
    mask: torch.Tensor  # [num_new, context_len] bool; True = may attend

    @property
    def context_len(self) -> int:
        return self.mask.shape[1]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's K/V go and what each query may see."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    num_decodes: int  # the first num_decodes rows are decode queries, one per sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64; padded with NULL_BLOCK
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: tuple[PrefillSegment, ...]

    @staticmethod
    def build(
        decode_block_tables: list[list[int]],
        decode_context_lens: list[int],
        prefills: list[tuple[list[int], int, int]],
        slot_mapping: list[int],
        block_size: int,
        null_block: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build metadata from plain ints.

        Args:
            decode_block_tables / decode_context_lens: per decode sequence, its block ids and its
                context length including the token computed this step.
            prefills: per prefill segment ``(block_table, num_cached, num_new)``; the segment's
                rows follow the decode rows in this order.
        """
        num_decodes = len(decode_block_tables)
        max_blocks = max((len(t) for t in decode_block_tables), default=0)
        tables = torch.full((num_decodes, max_blocks), null_block, dtype=torch.int64)
        for i, table in enumerate(decode_block_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
        lens = torch.tensor(decode_context_lens, dtype=torch.int64)
        key_pos = torch.arange(max_blocks * block_size)
        decode_mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]

        segments = []
        start = num_decodes
        for table, num_cached, num_new in prefills:
            context_len = num_cached + num_new
            query_pos = torch.arange(num_cached, context_len)
            mask = torch.arange(context_len)[None, :] <= query_pos[:, None]
            segments.append(
                PrefillSegment(
                    start=start,
                    num_new=num_new,
                    block_table=torch.tensor(table, dtype=torch.int64, device=device),
                    mask=mask.to(device),
                )
            )
            start += num_new
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_decodes=num_decodes,
            decode_block_tables=tables.to(device),
            decode_mask=decode_mask.to(device),
            prefills=tuple(segments),
        )


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store the new tokens' K/V at their slots (in place)."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., nb] block ids -> [..., nb * block_size, kv_heads, head_dim] contiguous K or V."""
    gathered = cache[block_table]  # [..., nb, block_size, kv_heads, head_dim]
    return gathered.flatten(-4, -3)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Attention of every query over its sequence's paged context (new K/V already written)."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        k = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [nd, kvh, L, D]
        v = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),  # [nd, H, 1, D]
            k,
            v,
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=True,
        ).squeeze(2)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_new)
        k = _gather(k_cache, seg.block_table)[: seg.context_len].transpose(0, 1)  # [kvh, L, D]
        v = _gather(v_cache, seg.block_table)[: seg.context_len].transpose(0, 1)
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),  # [H, n, D]
            k,
            v,
            attn_mask=seg.mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
    return out
