"""Turns a SchedulerOutput into tensors, runs the model over the paged KV pool, returns logits."""

from __future__ import annotations

import torch

from kernels.attention import PagedAttentionStep
from kernels.attention_metadata import AttentionMetadata, GatherWorkspace
from shared.engine.kv.block_pool import NULL_BLOCK, slot_ids
from shared.engine.kv.manager import SlotCopy
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.model.llama import KVCache, LlamaModel


MAX_DECODE_ROWS_CHUNK = 48  # longer chunks (prompts) run as prefill segments


def _as_decode_rows(chunk: ScheduledChunk) -> bool:
    return chunk.start > 0 and len(chunk.token_ids) <= MAX_DECODE_ROWS_CHUNK


class ModelRunner:
    """Holds the model and its KV pool: one (K, V) pair of tensors per layer. The pool and every
    per-step tensor live on the model's device (``self.device``), wherever the caller put it."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        cfg = model.config
        self.dtype = dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: one buffer per layer, not one [L, ...] tensor: in-place writes into slices of a
        # single buffer get functionalized into whole-buffer copies under torch.compile.
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype, device=self.device),
             torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.workspace = GatherWorkspace(block_size * cfg.num_kv_heads * cfg.head_dim, dtype, self.device)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns logits [rows, vocab] float32 on the CPU: ``chunk.num_logits``
        rows per chunk (its last positions), in ``out.chunks`` order.

        The logits come back to the CPU (a no-op there): sampling and grammar masks run on the
        CPU whatever the device, so the sampler's per-request ``torch.Generator``s (CPU ones)
        give a seeded request the same random stream on every device, and only the sampled
        rows cross to the host.

        A short chunk that extends a cached context (a decode, or a decode with jump-forward
        drafts) runs as decode rows, one per token, each seeing the context up to itself: the
        cascade decode attention then reads the shared context once for all of them, which is
        far cheaper than a prefill segment per request.
        """
        if out.copies:  # a copy may read a block a tier load is still filling
            for fence in out.fences:
                fence.wait_all()
        self._copy_slots(out.copies)
        row_chunks = out.decodes + [c for c in out.prefills if _as_decode_rows(c)]
        segment_chunks = [c for c in out.prefills if not _as_decode_rows(c)]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offset: dict[int, int] = {}
        for chunk in row_chunks + segment_chunks:
            offset[id(chunk)] = len(input_ids)
            input_ids += chunk.token_ids
            positions += range(chunk.start, chunk.end)
            slots += slot_ids(chunk.block_table, chunk.start, chunk.end, self.block_size)
        bs = self.block_size
        meta = AttentionMetadata.build(
            decode_block_tables=[c.block_table[: -(-(p + 1) // bs)] for c in row_chunks for p in range(c.start, c.end)],
            decode_context_lens=[p + 1 for c in row_chunks for p in range(c.start, c.end)],
            prefills=[(c.block_table[: -(-c.end // bs)], c.start, len(c.token_ids)) for c in segment_chunks],
            slot_mapping=slots,
            block_size=bs,
            null_block=NULL_BLOCK,
            workspace=self.workspace,
            query_group=self.model.config.num_heads // self.model.config.num_kv_heads,
            device=self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_caches,
            PagedAttentionStep(meta, out.fences),
        )
        sample_rows = [row for c in out.chunks
                       for row in range(offset[id(c)] + len(c.token_ids) - c.num_logits, offset[id(c)] + len(c.token_ids))]
        return self.model.logits(hidden[sample_rows]).cpu()

    def _copy_slots(self, copies: list[SlotCopy]) -> None:
        """Copy-on-write of partially matched prefix blocks, all layers at once per tensor."""
        if not copies:
            return
        src = torch.tensor([s for c in copies for s in c.src], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for c in copies for d in c.dst], dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst] = flat[src]
