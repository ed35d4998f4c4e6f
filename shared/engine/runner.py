"""Turns a SchedulerOutput into tensors, runs the model over the paged KV pool, returns logits."""

from __future__ import annotations

import torch

from kernels.attention import PagedAttentionStep
from kernels.attention_metadata import AttentionMetadata, GatherWorkspace
from kernels.greedy_head import greedy_head
from kernels.paged_decode_cpu import supports as supports_in_place_decode
from shared.engine.kv.block_pool import NULL_BLOCK, slot_ids
from shared.engine.kv.manager import SlotCopy
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.engine.step_profile import StepProfile, TimedAttentionStep, maybe_phase
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
        self.profile: StepProfile | None = None  # set by Engine.enable_profile
        # On a CPU the compiled kernel reads every decode row's blocks in place (where it builds):
        # faster there than the cascade of batched GEMMs over gathered copies, which remains
        # the path of other devices (until their kernels) and the reference.
        self.decode_in_place = self.device.type == "cpu" and supports_in_place_decode(cfg.head_dim, dtype)
        self._flops = _FlopCounter(model)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns logits [rows, vocab] in the model's dtype on the CPU:
        ``chunk.num_logits`` rows per chunk (its last positions), in ``out.chunks`` order (the
        sampler widens only the rows it samples from: a greedy row's argmax needs no copy).

        The logits come back to the CPU (a no-op there): sampling and grammar masks run on the
        CPU whatever the device, so the sampler's per-request ``torch.Generator``s (CPU ones)
        give a seeded request the same random stream on every device, and only the sampled
        rows cross to the host.

        A short chunk that extends a cached context (a decode, or a decode with jump-forward
        drafts) runs as decode rows, one per token, each seeing the context up to itself: the
        cascade decode attention then reads the shared context once for all of them, which is
        far cheaper than a prefill segment per request.
        """
        hidden = self._forward(out)
        with maybe_phase(self.profile, "logits"):
            return self.model.logits(hidden, dtype=None).cpu()

    def execute_greedy(self, out: SchedulerOutput) -> list[int]:
        """``execute`` for a step whose sampled rows are all greedy (no grammar, no logprobs,
        no drafts): each row's token of largest logit (the first of equals), exactly the argmax
        of ``execute``'s logits, without those logits (``kernels.greedy_head``)."""
        hidden = self._forward(out)
        with maybe_phase(self.profile, "logits"):
            return greedy_head(hidden, self.model.lm_head.weight).tolist()

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The step's forward pass: the final hidden states of the rows whose logits it samples
        [rows, hidden] (the model's final norm applied)."""
        if out.copies:  # a copy may read a block a tier load is still filling
            for fence in out.fences:
                fence.wait_all()
        profile = self.profile
        with maybe_phase(profile, "metadata"):
            self._copy_slots(out.copies)
            input_ids, positions, meta, sample_rows = self._prepare(out)
        attention_before = profile.seconds["attention"] if profile is not None else 0.0
        with maybe_phase(profile, "model"):
            step = PagedAttentionStep(meta, out.fences)
            hidden = self.model(input_ids, positions, self.kv_caches,
                                step if profile is None else TimedAttentionStep(step, profile))
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            hidden = hidden.index_select(0, rows)
        if profile is not None:  # attention ran inside the model's phase: count it once
            profile.seconds["model"] -= profile.seconds["attention"] - attention_before
            profile.flops += self._flops.step(out, len(sample_rows))
            profile.computed_tokens += len(input_ids)
        return hidden

    def warm_up(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` dummy prompt tokens, so the first request does not pay
        for first-use work (the allocator's growth, the GEMM library's kernel setup for these
        shapes). It reads and writes only the null block, whose K/V is zeroed again after."""
        bs = self.block_size
        table = [NULL_BLOCK] * -(-num_tokens // bs)
        meta = self._metadata([], [], [(table, 0, num_tokens)], [NULL_BLOCK * bs + i % bs for i in range(num_tokens)])
        tokens = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(tokens, torch.arange(num_tokens, device=self.device), self.kv_caches,
                            PagedAttentionStep(meta))
        self.model.logits(hidden[-1:], dtype=None)
        for k_cache, v_cache in self.kv_caches:
            k_cache[NULL_BLOCK].zero_()
            v_cache[NULL_BLOCK].zero_()

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's flat token ids [T], positions [T], attention metadata and logits rows."""
        bs = self.block_size
        row_chunks = out.decodes + [c for c in out.prefills if _as_decode_rows(c)]
        segment_chunks = [c for c in out.prefills if not _as_decode_rows(c)]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []  # per decode row: the blocks up to its position
        decode_lens: list[int] = []
        offset: dict[int, int] = {}  # id(chunk) -> its first row
        for chunk in row_chunks:
            offset[id(chunk)] = len(input_ids)
            input_ids += chunk.token_ids
            table = chunk.block_table
            for p in range(chunk.start, chunk.start + len(chunk.token_ids)):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                decode_tables.append(table[: p // bs + 1])
                decode_lens.append(p + 1)
        for chunk in segment_chunks:
            offset[id(chunk)] = len(input_ids)
            input_ids += chunk.token_ids
            positions += range(chunk.start, chunk.end)
            slots += slot_ids(chunk.block_table, chunk.start, chunk.end, bs)
        meta = self._metadata(
            decode_tables, decode_lens,
            [(c.block_table[: -(-c.end // bs)], c.start, len(c.token_ids)) for c in segment_chunks],
            slots,
        )
        sample_rows = []
        for c in out.chunks:
            end = offset[id(c)] + len(c.token_ids)
            sample_rows += range(end - c.num_logits, end)
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device), meta, sample_rows)

    def _metadata(self, decode_block_tables: list[list[int]], decode_context_lens: list[int],
                  prefills: list[tuple[list[int], int, int]], slot_mapping: list[int]) -> AttentionMetadata:
        """A step's attention metadata in this runner's pool, on its device, for its kernels."""
        return AttentionMetadata.build(
            decode_block_tables=decode_block_tables,
            decode_context_lens=decode_context_lens,
            prefills=prefills,
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            null_block=NULL_BLOCK,
            workspace=self.workspace,
            query_group=self.model.config.num_heads // self.model.config.num_kv_heads,
            device=self.device,
            in_place=self.decode_in_place,
        )

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


class _FlopCounter:
    """The model's FLOPs for a step (see ``shared.engine.step_profile``)."""

    def __init__(self, model: LlamaModel):
        cfg = model.config
        self.dense = 2 * sum(p.numel() for name, p in model.layers.named_parameters() if name.endswith("proj.weight"))
        self.attention = 4 * cfg.num_heads * cfg.head_dim  # per query token and context token
        self.logits = 2 * cfg.hidden_size * cfg.vocab_size

    def step(self, out: SchedulerOutput, logits_rows: int) -> float:
        # a chunk's tokens at positions [start, end) see contexts start+1 .. end
        contexts = sum((c.end * (c.end + 1) - c.start * (c.start + 1)) // 2 for c in out.chunks)
        return self.dense * out.num_tokens + self.attention * contexts + self.logits * logits_rows
