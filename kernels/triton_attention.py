"""The engine's attention on the Triton kernels (a GPU; the CPU under ``TRITON_INTERPRET=1``):
``TritonAttentionStep`` is ``shared.model.llama.AttentionStep`` over the paged pools, built
from ``TritonAttentionMetadata``.

Per layer: rotary fused with the KV write (``kernels.triton_rotary_kv``; the layer functions of
``kernels.triton_layers`` leave q and k unrotated), then the decode rows through
``kernels.triton_decode_attention`` (the shared-prefix cascade as problems, split-KV) and the
prefill segments through ``kernels.triton_extend_attention``. The step's layout is
``kernels.attention``'s: decode rows first, then each prefill segment's new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention_metadata import decode_problems
from kernels.kv_layout import write_kv
from kernels.layer_wait import LayerWait
from kernels.triton_decode_attention import DecodePlan, paged_decode_attention
from kernels.triton_extend_attention import ExtendPlan, extend_attention
from kernels.triton_rotary_kv import rotary_kv


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """Where this step's K/V go and what each query reads, as the Triton kernels take it."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode: DecodePlan | None  # None: no decode rows
    extend: ExtendPlan | None  # None: no prefill segments

    @staticmethod
    def build(
        decode_block_tables: Sequence[Sequence[int]],
        decode_context_lens: Sequence[int],
        prefills: Sequence[tuple[Sequence[int], int, int]],
        slot_mapping: Sequence[int],
        block_size: int,
        kv_heads: int,
        device: torch.device | str,
        target_programs: int,
        min_saved_tokens: int = 512,
    ) -> "TritonAttentionMetadata":
        """``kernels.attention_metadata.AttentionMetadata.build``'s inputs; shared segments that
        save at least ``min_saved_tokens`` token reads become cascade problems, and long
        contexts are split until the decode launch has about ``target_programs`` programs."""
        num_decodes = len(decode_block_tables)
        decode = None
        if num_decodes:
            problems, parts = decode_problems(decode_block_tables, decode_context_lens, block_size, min_saved_tokens)
            decode = DecodePlan.from_problems(problems, num_decodes, parts, kv_heads, device, target_programs)
        return TritonAttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_decodes=num_decodes,
            decode=decode,
            extend=ExtendPlan.build(prefills, num_decodes, device) if prefills else None,
        )


@dataclass(frozen=True)
class TritonAttentionStep:
    """One step's attention on the Triton kernels. Before a layer reads anything it waits on
    ``fences`` (KV tier loads landing in blocks this step reads, as ``PagedAttentionStep``)."""

    meta: TritonAttentionMetadata
    fences: tuple[LayerWait, ...] = ()

    def attend(self, layer, q, k, v, kv_cache, scale: float, rope=None) -> torch.Tensor:
        for fence in self.fences:
            fence.wait(layer)
        k_cache, v_cache = kv_cache
        meta = self.meta
        if rope is not None:
            q = rotary_kv(q, k, v, rope, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode is not None:
            out[: meta.num_decodes] = paged_decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta.decode, scale)
        if meta.extend is not None:
            extend_attention(q, k_cache, v_cache, meta.extend, out, scale)
        return out
