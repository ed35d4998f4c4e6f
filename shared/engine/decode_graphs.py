"""Decode steps as CUDA graphs: cloudd's steps with only decode rows, captured once per
batch-size bucket and replayed (``[engine] cuda_graphs``).

A decode step's launches (30 layers of small kernels) cost more CPU time than its GPU work at
small batches; a graph replays them all in one call. Buckets are 1, 2, 4, ... up to the
engine's ``max_num_seqs`` (the last bucket is ``max_num_seqs`` itself); a step of ``n`` rows
runs in the smallest bucket that holds it, padded. Each graph reads static buffers the step
fills in place: token ids, positions, KV slots, block tables and context lengths. Padding rows
write their K/V into a slot of the null block and read only that slot. The captured attention
is the per-row Triton decode (split-KV, no cascade: a cascade's problem list changes shape
every step). Steps with prefill segments, more rows than the largest bucket, or KV tier loads
to wait for run eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kernels.attention_metadata import padded_rows
from kernels.triton_attention import TritonAttentionMetadata, TritonAttentionStep
from kernels.triton_decode_attention import DecodePlan, splits_for
from shared.model.llama import KVCache, LlamaModel

log = logging.getLogger(__name__)


def buckets_up_to(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``max_rows``, then ``max_rows``."""
    sizes = []
    size = 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, max_rows)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, hidden]: the graph's output, overwritten by each replay


class DecodeGraphs:
    """One captured decode forward per bucket, over static input buffers (see the module docstring)."""

    def __init__(self, model: LlamaModel, kv_caches: list[KVCache], max_rows: int, max_blocks: int,
                 block_size: int, null_block: int, target_programs: int):
        device = model.embed_tokens.weight.device
        kv_heads = model.config.num_kv_heads
        self.block_size = block_size
        self.null_block = null_block
        self.max_rows = max_rows
        self.ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slots = torch.full((max_rows,), null_block * block_size, dtype=torch.int64, device=device)
        self.tables = torch.full((max_rows, max_blocks), null_block, dtype=torch.int64, device=device)
        self.lens = torch.ones(max_rows, dtype=torch.int64, device=device)
        self.buckets = buckets_up_to(max_rows)
        self._graphs: dict[int, _Captured] = {}
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):  # largest first: the pool fits the rest
            plan = DecodePlan.per_row(self.tables[:bucket], self.lens[:bucket],
                                      splits=splits_for(bucket, kv_heads, max_blocks, target_programs))
            step = TritonAttentionStep(TritonAttentionMetadata(self.slots[:bucket], bucket, plan, None))

            def forward(bucket: int = bucket, step: TritonAttentionStep = step) -> torch.Tensor:
                return model(self.ids[:bucket], self.positions[:bucket], kv_caches, step)

            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: Triton's compiles and the allocator, before capture
                    forward()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward()
            self._graphs[bucket] = _Captured(graph, hidden)
        for k_cache, v_cache in kv_caches:  # the warm-ups wrote into the null block
            k_cache[null_block].zero_()
            v_cache[null_block].zero_()
        self.capture_seconds = time.perf_counter() - started
        log.info("captured %d decode CUDA graphs (1..%d rows) in %.1f s", len(self._graphs), max_rows,
                 self.capture_seconds)

    def takes(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_rows

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:  # [num_rows, hidden]
        """One decode step of ``len(input_ids)`` rows (``takes`` it) through its bucket's graph."""
        n = len(input_ids)
        bucket = next(b for b in self.buckets if b >= n)
        pad = bucket - n
        self.ids[:bucket].copy_(torch.tensor(input_ids + [0] * pad, dtype=torch.int64), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64), non_blocking=True)
        self.slots[:bucket].copy_(torch.tensor(slots + [self.null_block * self.block_size] * pad, dtype=torch.int64),
                                  non_blocking=True)
        self.lens[:bucket].copy_(torch.tensor(context_lens + [1] * pad, dtype=torch.int64), non_blocking=True)
        tables = padded_rows(block_tables + [[self.null_block]] * pad, self.null_block, "cpu")
        if tables.shape[1] > self.tables.shape[1]:
            raise ValueError(f"a block table of {tables.shape[1]} blocks exceeds the captured {self.tables.shape[1]}")
        self.tables[:bucket, : tables.shape[1]].copy_(tables, non_blocking=True)
        captured = self._graphs[bucket]
        captured.graph.replay()
        return captured.hidden[:n]  # valid until the next replay
