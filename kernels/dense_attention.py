"""Attention over one sequence's dense KV buffer: edged's batch-1 path.

Each layer's cache is ``k_cache, v_cache: [max_len, kv_heads, head_dim]``, position ``p`` at row
``p``. A step computes tokens at ``positions`` (consecutive); they attend causally to every
position before them. (On a GPU, edged runs the Triton kernels over the same buffer instead:
``edged.backends.torch_backend``.)

A step of a few tokens (a decode token and its speculative drafts) runs the CPU paged decode
kernel (``kernels.paged_decode_cpu``) where it is built: the buffer seen as a pool of
``DECODE_BLOCK``-row blocks, each token a decode row over the positions up to its own (measured
on a 2-core EPYC, one layer at a 640-token context: 62 us against 339 us for one token, 410
against 653 us for 13). Longer steps (prefills), and buffers whose rows are not whole blocks,
take torch's scaled-dot-product attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_decode_cpu import paged_decode_kernel, supports
from kernels.layer_math import rotated

DECODE_BLOCK = 64  # the paged decode kernel's largest block size
DECODE_MAX_TOKENS = 16  # steps of at most this many tokens read the buffer with the decode kernel


@dataclass(frozen=True)
class DecodeRows:
    """The paged decode kernel's view of a step: each token a row over the buffer's first blocks."""

    block_tables: torch.Tensor  # [T, blocks] int64: 0, 1, 2, ... (block b holds rows b*DECODE_BLOCK ..)
    context_lens: torch.Tensor  # [T] int64: position + 1


@dataclass(frozen=True)
class DenseAttentionStep:
    """``shared.model.llama.AttentionStep`` over a dense buffer (see the module docstring).
    Built directly it always takes scaled-dot-product attention; ``over`` picks the kernel
    where it applies."""

    positions: torch.Tensor  # [T] int64, consecutive
    end: int  # positions[-1] + 1 (the context the queries see)
    decode_rows: DecodeRows | None = None

    @staticmethod
    def over(positions: torch.Tensor, end: int, k_cache: torch.Tensor) -> "DenseAttentionStep":
        """The step for ``positions`` over buffers shaped like ``k_cache`` [rows, kv_heads,
        head_dim]: on the decode kernel when it is built for them, the step is short, and the
        buffer is whole blocks on the CPU."""
        rows, _, head_dim = k_cache.shape
        usable = (len(positions) <= DECODE_MAX_TOKENS and rows % DECODE_BLOCK == 0
                  and k_cache.device.type == "cpu" and supports(head_dim, k_cache.dtype))
        if not usable:
            return DenseAttentionStep(positions, end)
        blocks = -(-end // DECODE_BLOCK)
        tables = torch.arange(blocks).expand(len(positions), blocks).contiguous()
        return DenseAttentionStep(positions, end, DecodeRows(tables, positions + 1))

    def attend(self, layer, q, k, v, kv_cache, scale: float, rope=None) -> torch.Tensor:
        q, k = rotated(q, k, rope)
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, self.positions, k)
        v_cache.index_copy_(0, self.positions, v)
        if self.decode_rows is not None:
            blocked = (-1, DECODE_BLOCK, *k_cache.shape[1:])
            out, _ = paged_decode_kernel()(q.contiguous(), k_cache.view(blocked), v_cache.view(blocked),
                                           self.decode_rows.block_tables, self.decode_rows.context_lens,
                                           scale, False, None)
            return out
        t, heads, dim = q.shape
        kvh = k_cache.shape[1]
        length = self.end
        keys = k_cache[:length].transpose(0, 1)  # [kvh, L, D]
        values = v_cache[:length].transpose(0, 1)
        # GQA: each KV head's query group folds into the query length, rows (j, t).
        qg = q.view(t, kvh, heads // kvh, dim).permute(1, 2, 0, 3).reshape(kvh, -1, dim)
        key_pos = torch.arange(length, device=q.device)
        visible = key_pos[None, :] <= self.positions[:, None]  # [T, L]
        mask = visible.repeat(heads // kvh, 1)  # rows (j, t)
        out = torch.nn.functional.scaled_dot_product_attention(
            qg[None], keys[None], values[None], attn_mask=mask, scale=scale)
        return out[0].view(kvh, heads // kvh, t, dim).permute(2, 0, 1, 3).reshape(t, heads, dim)
