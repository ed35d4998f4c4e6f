"""Turns a SchedulerOutput into tensors, runs the model over the paged KV pool, returns logits."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.attention import PagedAttentionStep
from kernels.attention_metadata import AttentionMetadata, GatherWorkspace, KernelRows, expand_runs
from kernels.greedy_head import greedy_head
from kernels.kv_layout import LAYOUTS, allocate_kv, copy_slots
from kernels.onednn_linear import PackedHead
from kernels.paged_decode_cpu import supports as supports_in_place_decode
from kernels.paged_decode_cpu import supports_paired
from kernels.tile_quant_linear import TILE_QUANT_LAYERS, TileQuantProjection
from kernels.tile_quant_matmul_cpu import max_rows as max_small_step_rows
from kernels.tile_quant_matmul_cpu import tile_quant_matmul_usable
from kernels.triton_attention import TritonAttentionMetadata, TritonAttentionStep
from kernels.triton_decode_attention import launch_programs
from kernels.triton_layers import TRITON_LAYERS
from kernels.triton_support import check_tiles
from kernels.weight_forms import FORM_LAYERS
from shared.engine.block_table_rows import BlockTableRows
from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.kernel_choice import KernelPlan
from shared.engine.kv.block_pool import NULL_BLOCK, slot_ids
from shared.engine.kv.manager import SlotCopy
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.engine.step_profile import StepProfile, TimedAttentionStep, maybe_phase
from shared.model.kquant_projections import attach_projections, has_kquant_projections, kquant_projections
from shared.model.llama import AttentionStep, KVCache, LlamaModel
from shared.model.projection_forms import DENSE_FORMS, convert_layer_linears, pack_head


MAX_DECODE_ROWS_CHUNK = 48  # longer chunks (prompts) run as prefill segments


def _as_decode_rows(chunk: ScheduledChunk) -> bool:
    """For the cascade, whether a prefill chunk's tokens go in as decode rows, one per token,
    instead of as a segment: a short chunk extending a cached context. (The in-place kernel's
    steps take every token as a row: ``ModelRunner._rows_batch``.)"""
    return chunk.start > 0 and len(chunk.token_ids) <= MAX_DECODE_ROWS_CHUNK


@dataclass
class StepInputs:
    """A step's flat tokens (decode rows first, then prefill segments) as plain ints, for the
    cascade, the Triton kernels and the CUDA graphs."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slot of each token
    decode_tables: list[list[int]] = field(default_factory=list)  # per decode row: blocks up to its position
    decode_lens: list[int] = field(default_factory=list)  # per decode row: its context, itself included
    prefills: list[tuple[list[int], int, int]] = field(default_factory=list)  # (block table, cached, new)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits the step samples


@dataclass(frozen=True)
class StepBatch:
    """What the eager forward pass takes: the step's tokens as tensors on the runner's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    sample_rows: torch.Tensor  # [rows] int64: the rows whose logits the step samples
    meta: AttentionMetadata | TritonAttentionMetadata


class ModelRunner:
    """Holds the model and its KV pool: one (K, V) pair of tensors per layer. The pool and every
    per-step tensor live on the model's device (``self.device``), wherever the caller put it.

    ``kernels`` ("torch" or "triton", ``shared.engine.kernel_choice``) picks the attention and
    the layers' fused ops; ``kv_layout`` the pools' layout (``kernels.kv_layout``): "auto" is
    the paired one where the CPU decode kernel reads it, else tokens; with "triton" on a CUDA
    device and ``cuda_graphs``, decode-only steps of up to ``max_decode_rows`` rows replay CUDA
    graphs (``shared.engine.decode_graphs``) captured here for contexts up to ``max_model_len``."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kernels: str = "torch",
                 cuda_graphs: bool = False, max_decode_rows: int = 256, max_model_len: int = 8192,
                 kv_layout: str = "auto"):
        cfg = model.config
        self.dtype = dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device
        self.model = model
        self.block_size = block_size
        # On a CPU the compiled kernel reads every decode row's blocks in place (where it builds):
        # faster there than the cascade of batched GEMMs over gathered copies, which remains
        # the path of other devices (until their kernels) and the reference.
        self.kernels = kernels
        self.decode_in_place = kernels == "torch" and self.device.type == "cpu" and supports_in_place_decode(
            cfg.head_dim, dtype)
        self.kv_layout = _resolve_layout(kv_layout, self.decode_in_place and supports_paired(cfg.head_dim, dtype,
                                                                                             block_size))
        # NOTE: one buffer per layer, not one [L, ...] tensor: in-place writes into slices of a
        # single buffer get functionalized into whole-buffer copies under torch.compile.
        self.kv_caches: list[KVCache] = [
            allocate_kv(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, self.device,
                        paired=self.kv_layout == "paired")
            for _ in range(cfg.num_layers)
        ]
        self.workspace = GatherWorkspace(block_size * cfg.num_kv_heads * cfg.head_dim, dtype, self.device)
        # the in-place kernel's steps keep their block tables across steps (``_rows_batch``)
        self._table_rows = BlockTableRows(NULL_BLOCK) if self.decode_in_place else None
        self.profile: StepProfile | None = None  # set by Engine.enable_profile
        if kernels == "triton":
            check_tiles(block_size=block_size, head_dim=cfg.head_dim)
            model.layer_functions = TRITON_LAYERS
        elif kernels != "torch":
            raise ValueError(f"kernels must be 'torch' or 'triton', got {kernels!r}")
        # how prompt chunks and decode rows attend (apply_plan): rows of the in-place kernel, or
        # GEMM segments and the cascade
        self.prefill_attention = "rows" if self.decode_in_place else "gemm"
        self.decode_attention = "rows" if self.decode_in_place else "cascade"
        self.kernel_plan = KernelPlan({}, {})  # what apply_plan chose (empty: the defaults above)
        self._kquant: dict[str, TileQuantProjection] | None = None  # kquant_projections(), once built
        self._flops = _FlopCounter(model)
        self._decode_programs = launch_programs(self.device)  # the Triton decode launch's target
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and kernels == "triton" and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.kv_caches, max_decode_rows, -(-max_model_len // block_size),
                                       block_size, NULL_BLOCK, self._decode_programs)

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
        far cheaper than a prefill segment per request. (With the in-place CPU kernel every
        token is such a row: ``kernels.attention_metadata.KernelRows``.)
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
            small = self.model.small_step_logits(hidden)
            if small is not None:  # first maxima, as greedy_head takes them
                return small.argmax(dim=-1).tolist()
            head = self.model.lm_head
            return (head.greedy(hidden) if isinstance(head, PackedHead) else greedy_head(hidden, head.weight)).tolist()

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The step's forward pass: the final hidden states of the rows whose logits it samples
        [rows, hidden] (the model's final norm applied)."""
        if out.copies:  # a copy may read a block a tier load is still filling
            for fence in out.fences:
                fence.wait_all()
        profile = self.profile
        graphed = False
        with maybe_phase(profile, "metadata"):
            self._copy_slots(out.copies)
            if self.graphs is not None:
                inputs = self._prepare(out)
                graphed = not inputs.prefills and not out.fences and self.graphs.takes(len(inputs.input_ids))
                batch = None if graphed else self._segments_batch(inputs)
            else:
                batch = self.step_batch(out)
        attention_before = profile.seconds["attention"] if profile is not None else 0.0
        with maybe_phase(profile, "model"):
            if graphed:
                hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.decode_tables,
                                         inputs.decode_lens)
                sample_rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=self.device)
            else:
                hidden = self._eager_forward(batch, out.fences)
                sample_rows = batch.sample_rows
            hidden = hidden.index_select(0, sample_rows)
        if profile is not None:  # attention ran inside the model's phase: count it once
            profile.seconds["model"] -= profile.seconds["attention"] - attention_before
            profile.flops += self._flops.step(out, len(sample_rows))
            profile.computed_tokens += out.num_tokens
        return hidden

    def _eager_forward(self, batch: StepBatch, fences: tuple) -> torch.Tensor:  # [T, hidden]
        step = self._step(batch.meta, fences)
        return self.model(batch.input_ids, batch.positions, self.kv_caches,
                          step if self.profile is None else TimedAttentionStep(step, self.profile))

    def _step(self, meta, fences: tuple = ()) -> AttentionStep:
        if self.kernels == "triton":
            return TritonAttentionStep(meta, fences)
        return PagedAttentionStep(meta, fences)

    def warm_up(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` dummy prompt tokens, so the first request does not pay
        for first-use work (the allocator's growth, the GEMM library's kernel setup for these
        shapes). It reads and writes only the null block, whose K/V is zeroed again after."""
        bs = self.block_size
        table = [NULL_BLOCK] * -(-num_tokens // bs)
        meta = self._metadata([], [], [(table, 0, num_tokens)], [NULL_BLOCK * bs + i % bs for i in range(num_tokens)],
                              in_place=self.decode_in_place and self.prefill_attention != "gemm",
                              tiles=self.prefill_attention == "tiles")
        tokens = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(tokens, torch.arange(num_tokens, device=self.device), self.kv_caches, self._step(meta))
        self.model.logits(hidden[-1:], dtype=None)
        for k_cache, v_cache in self.kv_caches:
            k_cache[NULL_BLOCK].zero_()
            v_cache[NULL_BLOCK].zero_()

    def _prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's flat tokens, their KV slots, what each attends to, and the logits rows."""
        bs = self.block_size
        row_chunks = out.decodes + [c for c in out.prefills if _as_decode_rows(c)]
        segment_chunks = [c for c in out.prefills if not _as_decode_rows(c)]
        step = StepInputs()
        offset: dict[int, int] = {}  # id(chunk) -> its first row
        for chunk in row_chunks:
            offset[id(chunk)] = len(step.input_ids)
            step.input_ids += chunk.token_ids
            table = chunk.block_table
            for p in range(chunk.start, chunk.start + len(chunk.token_ids)):
                step.positions.append(p)
                step.slots.append(table[p // bs] * bs + p % bs)
                step.decode_tables.append(table[: p // bs + 1])
                step.decode_lens.append(p + 1)
        for chunk in segment_chunks:
            offset[id(chunk)] = len(step.input_ids)
            step.input_ids += chunk.token_ids
            step.positions += range(chunk.start, chunk.end)
            step.slots += slot_ids(chunk.block_table, chunk.start, chunk.end, bs)
            step.prefills.append((chunk.block_table[: -(-chunk.end // bs)], chunk.start, len(chunk.token_ids)))
        for c in out.chunks:
            end = offset[id(c)] + len(c.token_ids)
            step.sample_rows += range(end - c.num_logits, end)
        return step

    def step_batch(self, out: SchedulerOutput, prefill_attention: str | None = None,
                   decode_attention: str | None = None) -> StepBatch:
        """The step's tensors and attention metadata for its attention implementations (default:
        this runner's, ``apply_plan``). A step with prompt chunks follows ``prefill_attention``:
        "rows" makes every token of the step, decode rows included, a row of one call of the
        in-place kernel (``_rows_batch``), "tiles" the same call on the AMX tiles (the prompt
        rows are most of such a step's attention, so its decode rows take their task); "gemm"
        runs the chunks as GEMM segments (``_segments_batch``) and the decode rows as below. A
        step's decode rows otherwise follow ``decode_attention``: "rows" in the in-place kernel,
        "tiles" the same on the AMX tiles, "cascade" as batched GEMMs over gathered blocks."""
        prefill = prefill_attention or self.prefill_attention
        decode = decode_attention or self.decode_attention
        chunks = any(not _as_decode_rows(c) for c in out.prefills)
        if self._table_rows is not None and (prefill != "gemm" if chunks else decode != "cascade"):
            return self._rows_batch(out, tiles=(prefill if chunks else decode) == "tiles")
        return self._segments_batch(self._prepare(out), in_place_decodes=decode != "cascade", tiles=decode == "tiles")

    def has_kquant_codes(self) -> bool:
        """Whether small steps can run on the model's GGUF K-quant codes here: a bf16 model read
        from a GGUF with Q4_K/Q6_K layer weights, on a CPU whose kernels have the AMX tiles or
        AVX-512 BF16 (``kernels.tile_quant_matmul_cpu``)."""
        source = self.model.gguf_source
        return (self.kernels == "torch" and self.device.type == "cpu" and self.dtype == torch.bfloat16
                and source is not None and tile_quant_matmul_usable() and has_kquant_projections(source))

    def kquant_projections(self) -> dict[str, TileQuantProjection]:
        """The model's layer projections as its GGUF's K-quant codes (built once: ~1 GB and a few
        seconds for a 1.5B model)."""
        if self._kquant is None:
            self._kquant = kquant_projections(self.model.gguf_source)
        return self._kquant

    def apply_plan(self, plan: KernelPlan) -> None:
        """Run the implementations ``plan`` chose (``shared.engine.kernel_choice``): packed or
        int8 projections (the model's dense weights replaced, ``kernels.onednn_linear``,
        ``kernels.int8_linear``; before ``LlamaModel.compile_layers``), a packed LM head, how
        prompt chunks and decode rows attend, and small steps on the K-quant codes (attached to
        the weights in their form)."""
        form = DENSE_FORMS.get(plan.chosen.get("dense"))
        if form is not None:
            convert_layer_linears(self.model, form)
            self.model.use_layer_functions(FORM_LAYERS)
        if plan.chosen.get("small_steps") == "kquant":
            projections = self.kquant_projections()
            attach_projections(self.model, {m: p for m, p in projections.items() if m != "lm_head"})
            self.model.use_small_step_functions(TILE_QUANT_LAYERS, max_small_step_rows(), projections.get("lm_head"))
        self._kquant = None  # attached (the weights hold them) or not chosen: not kept here
        if plan.chosen.get("head") == "packed":
            pack_head(self.model)
        prefill = plan.chosen.get("prefill_attention", self.prefill_attention)
        decode = plan.chosen.get("decode_attention", self.decode_attention)
        if (prefill != "gemm" or decode != "cascade") and self._table_rows is None:
            raise ValueError("attention 'rows' or 'tiles' needs the in-place CPU kernel, which this runner lacks")
        self.prefill_attention, self.decode_attention = prefill, decode
        self.kernel_plan = plan

    def _segments_batch(self, inputs: StepInputs, in_place_decodes: bool = False, tiles: bool = False) -> StepBatch:
        """``_prepare``'s plain ints as tensors and metadata (``_metadata``): the prefills as
        segments, the decode rows in the in-place kernel or (default) as the cascade."""
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=self.device)
        meta = self._metadata(inputs.decode_tables, inputs.decode_lens, inputs.prefills, inputs.slots,
                              in_place_decodes=in_place_decodes, tiles=tiles)
        return StepBatch(as_tensor(inputs.input_ids), as_tensor(inputs.positions), as_tensor(inputs.sample_rows),
                         meta)

    def _rows_batch(self, out: SchedulerOutput, tiles: bool = False) -> StepBatch:
        """The step for the in-place kernel, built with numpy: every chunk is a run of rows (one
        decode row, or a prompt chunk's tokens) whose table is a row of ``_table_rows``, kept
        across steps. Rows in ``out.chunks`` order (decodes first).

            chunk    c0 (decode)   c1 (3 prompt tokens after 5 cached)
            row      0             1  2  3
            run      0             1  1  1
            position c0.start      5  6  7      context length = position + 1
        """
        chunks = out.chunks
        bs = self.block_size
        tables = self._table_rows.update(chunks)  # [runs]: each chunk's row of the array
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))  # [runs]
        counts = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=len(chunks))  # [runs]
        run_tables = self._table_rows.array[tables, : -(-int((starts + counts).max()) // bs)]  # [runs, W]
        run_of_row, positions = expand_runs(starts, counts)  # [rows] each
        slots = run_tables[run_of_row, positions // bs] * bs + positions % bs  # [rows]
        num_logits = np.fromiter((c.num_logits for c in chunks), dtype=np.int64, count=len(chunks))  # [runs]
        _, sample_rows = expand_runs(np.cumsum(counts) - num_logits, num_logits)  # each run's last rows
        ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                          count=len(run_of_row))
        device = self.device
        rows = KernelRows.from_runs(run_tables, run_of_row, positions + 1, device, tiles)
        meta = AttentionMetadata.for_kernel_rows(torch.from_numpy(slots).to(device), len(out.decodes), rows,
                                                 self.workspace)
        return StepBatch(torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device),
                         torch.from_numpy(sample_rows).to(device), meta)

    def _metadata(self, decode_block_tables: list[list[int]], decode_context_lens: list[int],
                  prefills: list[tuple[list[int], int, int]], slot_mapping: list[int], in_place: bool = False,
                  in_place_decodes: bool = False, tiles: bool = False):
        """A step's attention metadata in this runner's pool, on its device, for its kernels
        (``AttentionMetadata``, with ``in_place`` every token as a row of the in-place kernel,
        with ``in_place_decodes`` the decode rows; or ``TritonAttentionMetadata`` with the
        Triton kernels)."""
        if self.kernels == "triton":
            return TritonAttentionMetadata.build(decode_block_tables, decode_context_lens, prefills, slot_mapping,
                                                 self.block_size, self.model.config.num_kv_heads, self.device,
                                                 self._decode_programs)
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
            in_place=in_place,
            in_place_decodes=in_place_decodes,
            tiles=tiles,
        )

    def _copy_slots(self, copies: list[SlotCopy]) -> None:
        """Copy-on-write of partially matched prefix blocks, all layers at once per tensor."""
        if not copies:
            return
        src = torch.tensor([s for c in copies for s in c.src], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for c in copies for d in c.dst], dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            copy_slots(k_cache, True, src, dst)
            copy_slots(v_cache, False, src, dst)


def _resolve_layout(requested: str, paired_supported: bool) -> str:
    """"tokens" or "paired" for ``requested`` (``kernels.kv_layout.LAYOUTS``); ValueError for a
    paired layout no kernel here reads."""
    if requested not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {list(LAYOUTS)}, got {requested!r}")
    if requested == "paired" and not paired_supported:
        raise ValueError("kv_layout 'paired' needs the CPU decode kernel in bfloat16 on a CPU with AVX-512 BF16 "
                         "(block_size a multiple of 16, head_dim of 32)")
    if requested == "auto":
        return "paired" if paired_supported else "tokens"
    return requested


class _FlopCounter:
    """The model's FLOPs for a step (see ``shared.engine.step_profile``)."""

    def __init__(self, model: LlamaModel):
        cfg = model.config
        # NOTE: shapes, not parameters: packed projections hold their weights outside the module
        self.dense = 2 * sum(m.weight.shape.numel() for name, m in model.layers.named_modules() if name.endswith("proj"))
        self.attention = 4 * cfg.num_heads * cfg.head_dim  # per query token and context token
        self.logits = 2 * cfg.hidden_size * cfg.vocab_size

    def step(self, out: SchedulerOutput, logits_rows: int) -> float:
        # a chunk's tokens at positions [start, end) see contexts start+1 .. end
        contexts = sum((c.end * (c.end + 1) - c.start * (c.start + 1)) // 2 for c in out.chunks)
        return self.dense * out.num_tokens + self.attention * contexts + self.logits * logits_rows
