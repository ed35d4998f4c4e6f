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
from collections.abc import Callable

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


def capture(run: Callable[[], torch.Tensor], device: torch.device,
            pool: tuple | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``run`` captured as a CUDA graph (and the tensor its replays overwrite): run twice first
    on a side stream (Triton's compiles, the allocator), then captured, in ``pool`` if given."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


class DecodeGraphs:
    """One captured decode forward per bucket, over static input buffers (see the module docstring)."""

    def __init__(self, model: LlamaModel, kv_caches: list[KVCache], max_rows: int, max_blocks: int,
                 block_size: int, null_block: int, target_programs: int):
        device = model.embed_tokens.weight.device
        kv_heads = model.config.num_kv_heads
        self.max_rows = max_rows
        self.null_slot = null_block * block_size
        self.null_block = null_block
        # ids, positions, slots, lens: one static buffer, filled by one host-to-device copy a step
        self.inputs = torch.zeros(4, max_rows, dtype=torch.int64, device=device)
        ids, positions, slots, lens = self.inputs
        slots.fill_(self.null_slot)  # until the first step: every row one key in the null block
        lens.fill_(1)
        self.tables = torch.full((max_rows, max_blocks), null_block, dtype=torch.int64, device=device)
        self.buckets = buckets_up_to(max_rows)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, hidden)
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):  # largest first: the pool fits the rest
            plan = DecodePlan.per_row(self.tables[:bucket], lens[:bucket],
                                      splits=splits_for(bucket, kv_heads, max_blocks, target_programs))
            step = TritonAttentionStep(TritonAttentionMetadata(slots[:bucket], bucket, plan, None))
            self._graphs[bucket] = capture(
                lambda b=bucket, s=step: model(ids[:b], positions[:b], kv_caches, s), device, pool)
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
        """One decode step of ``len(input_ids)`` rows (``takes`` it) through its bucket's graph.
        Padding rows write and read one slot of the null block."""
        n = len(input_ids)
        bucket = next(b for b in self.buckets if b >= n)
        pad = bucket - n
        rows = [input_ids + [0] * pad, positions + [0] * pad, slots + [self.null_slot] * pad, context_lens + [1] * pad]
        self.inputs[:, :bucket].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        tables = padded_rows(block_tables + [[self.null_block]] * pad, self.null_block, "cpu")
        if tables.shape[1] > self.tables.shape[1]:
            raise ValueError(f"a block table of {tables.shape[1]} blocks exceeds the captured {self.tables.shape[1]}")
        self.tables[:bucket, : tables.shape[1]].copy_(tables, non_blocking=True)
        graph, hidden = self._graphs[bucket]
        graph.replay()
        return hidden[:n]  # valid until the next replay
