"""Attention over one sequence's dense KV buffer: edged's batch-1 path.

Each layer's cache is ``k_cache, v_cache: [max_len, kv_heads, head_dim]``, position ``p`` at row
``p``. A step computes tokens at ``positions`` (consecutive); they attend causally to every
position before them. (On a GPU, edged runs the Triton kernels over the same buffer instead:
``edged.backends.torch_backend``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model.llama import rotated


@dataclass(frozen=True)
class DenseAttentionStep:
    """``shared.model.llama.AttentionStep`` over a dense buffer (see the module docstring)."""

    positions: torch.Tensor  # [T] int64, consecutive
    end: int  # positions[-1] + 1 (the context the queries see)

    def attend(self, layer, q, k, v, kv_cache, scale: float, rope=None) -> torch.Tensor:
        q, k = rotated(q, k, rope)
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, self.positions, k)
        v_cache.index_copy_(0, self.positions, v)
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
