"""Turns a SchedulerOutput into tensors, runs the model over the paged KV pool, returns logits."""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata, GatherWorkspace
from shared.engine.kv.block_pool import NULL_BLOCK, slot_ids
from shared.engine.kv.manager import SlotCopy
from shared.engine.scheduler_output import SchedulerOutput
from shared.model.llama import KVCache, LlamaModel


class ModelRunner:
    """Holds the model and its KV pool: one (K, V) pair of tensors per layer."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: one buffer per layer, not one [L, ...] tensor: in-place writes into slices of a
        # single buffer get functionalized into whole-buffer copies under torch.compile.
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(cfg.num_layers)
        ]
        self.workspace = GatherWorkspace(block_size * cfg.num_kv_heads * cfg.head_dim, dtype)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns logits [rows, vocab] float32: ``chunk.num_logits`` rows per
        chunk (its last positions), in ``out.chunks`` order."""
        self._copy_slots(out.copies)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for chunk in out.chunks:
            input_ids += chunk.token_ids
            positions += range(chunk.start, chunk.end)
            slots += slot_ids(chunk.block_table, chunk.start, chunk.end, self.block_size)
            sample_rows += range(len(input_ids) - chunk.num_logits, len(input_ids))
        bs = self.block_size
        meta = AttentionMetadata.build(
            decode_block_tables=[c.block_table[: -(-c.end // bs)] for c in out.decodes],
            decode_context_lens=[c.end for c in out.decodes],
            prefills=[(c.block_table[: -(-c.end // bs)], c.start, len(c.token_ids)) for c in out.prefills],
            slot_mapping=slots,
            block_size=bs,
            null_block=NULL_BLOCK,
            workspace=self.workspace,
            query_group=self.model.config.num_heads // self.model.config.num_kv_heads,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            self.kv_caches,
            meta,
        )
        return self.model.logits(hidden[sample_rows])

    def _copy_slots(self, copies: list[SlotCopy]) -> None:
        """Copy-on-write of partially matched prefix blocks, all layers at once per tensor."""
        if not copies:
            return
        src = torch.tensor([s for c in copies for s in c.src], dtype=torch.int64)
        dst = torch.tensor([d for c in copies for d in c.dst], dtype=torch.int64)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst] = flat[src]
