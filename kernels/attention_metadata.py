"""Per-step attention metadata, built once from plain ints and shared by every layer:
where new K/V go and, for the cascade, which blocks each decode row reads on its own, which
shared block segments are read once for several rows (see ``kernels.attention``), and each
prefill segment's causal visibility; for a kernel that reads the pools in place, every token
of the step as a row with its whole block table (``KernelRows``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillSegment:
    """New tokens of one sequence that attend causally to its cached context and to each other.

    GQA folds each KV head's group of query heads into the query length: query row
    ``j * num_new + t`` is group member ``j`` at new token ``t`` (position ``num_cached + t``).
    """

    start: int  # first row of the segment in the flat token batch
    num_new: int  # tokens computed this step
    num_cached: int  # context before them, already in the pool
    block_table: torch.Tensor  # [num_blocks_for_context] int64
    query_group: int  # query heads per KV head

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new

    @functools.cached_property
    def visible(self) -> torch.Tensor:  # [query_group * num_new] int64: keys each query row sees
        """The causal mask as counts: row ``j * num_new + t`` sees keys ``[0, num_cached + t]``."""
        counts = torch.arange(self.num_cached + 1, self.context_len + 1, device=self.block_table.device)
        return counts.repeat(self.query_group)

    @functools.cached_property
    def mask(self) -> torch.Tensor:  # [query_group * num_new, context_len] float: 0 visible, -inf hidden
        """``visible`` as an additive mask, for kernels that take one."""
        keys = torch.arange(self.context_len, device=self.block_table.device)
        return torch.zeros(len(self.visible), self.context_len, device=self.block_table.device).masked_fill_(
            keys[None, :] >= self.visible[:, None], float("-inf"))


@dataclass(frozen=True)
class DecodeProblem:
    """Decode rows attending to the same blocks: one row and the blocks only it reads, or
    several rows and a segment they share. Each row writes its result into slot ``parts[i]``."""

    rows: list[int]
    parts: list[int]
    blocks: list[int]
    num_keys: int  # valid tokens in ``blocks`` (all but the last block are full)


@dataclass(frozen=True)
class DecodeBatch:
    """Decode problems of similar shape padded into one kernel call.

    Padding rows repeat a problem's first row and write into the scratch slot ``num_parts``,
    which the final combine ignores; padding blocks are the null block, masked out.
    """

    rows: torch.Tensor  # [p, r] int64 decode rows
    parts: torch.Tensor  # [p, r] int64 partial-result slot of each row
    block_tables: torch.Tensor  # [p, b] int64
    mask: torch.Tensor  # [p, 1, 1, b * block_size] float: 0 visible, -inf padding

    @staticmethod
    def build(
        problems: list[DecodeProblem], scratch_part: int, block_size: int, null_block: int,
        device: torch.device | str,
    ) -> "DecodeBatch":
        width = max(len(p.rows) for p in problems)
        rows = [p.rows + [p.rows[0]] * (width - len(p.rows)) for p in problems]
        block_tables = padded_rows([p.blocks for p in problems], null_block, device)
        visible = torch.arange(block_tables.shape[1] * block_size)[None, :] < torch.tensor(
            [p.num_keys for p in problems])[:, None]
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]
        return DecodeBatch(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            parts=padded_rows([p.parts for p in problems], scratch_part, device),
            block_tables=block_tables,
            mask=mask.to(device),
        )


@dataclass(frozen=True)
class KernelRows:
    """Every query row of a step as a kernel that reads the pools in place takes them: row ``i``
    (the step's token ``i``) attends to keys ``[0, context_lens[i])`` of its sequence, found
    through ``block_tables[i]``. A prefill segment's tokens are rows like decode rows, each
    seeing its context up to itself (the causal mask as lengths)."""

    # [num_tokens, max blocks] int64, padded with the null block or with blocks past the row's
    # context (never read)
    block_tables: torch.Tensor
    context_lens: torch.Tensor  # [num_tokens] int64
    # Rows sorted by block table, the order the kernel runs them in: rows that share blocks (a
    # system prompt, a robot's scene, a prompt's own tokens) run next to each other.
    order: torch.Tensor  # [num_tokens] int64, a permutation
    tiles: bool = False  # run them on the AMX tiles (kernels.paged_decode_cpu.paged_decode_tiles_kernel)

    @staticmethod
    def build(
        decode_block_tables: list[list[int]],
        decode_context_lens: list[int],
        prefills: list[tuple[list[int], int, int]],
        null_block: int,
        device: torch.device | str,
        tiles: bool = False,
    ) -> "KernelRows":
        """From ``AttentionMetadata.build``'s inputs: one run of rows per decode row (one row) and
        per prefill segment (``num_new`` rows sharing its table), expanded with numpy."""
        tables = padded_array(decode_block_tables + [table for table, _, _ in prefills], null_block)
        firsts = np.array([n - 1 for n in decode_context_lens] + [cached for _, cached, _ in prefills], dtype=np.int64)
        counts = np.array([1] * len(decode_block_tables) + [new for _, _, new in prefills], dtype=np.int64)
        run_of_row, positions = expand_runs(firsts, counts)
        return KernelRows.from_runs(tables, run_of_row, positions + 1, device, tiles)

    @staticmethod
    def from_runs(run_tables: np.ndarray, run_of_row: np.ndarray, context_lens: np.ndarray,
                  device: torch.device | str, tiles: bool = False) -> "KernelRows":
        """Rows from their runs: ``run_tables`` [runs, W] int64 (each run's block table, padded
        with the null block, or with blocks past every row's context), ``run_of_row`` [rows]
        the run of each row (a run's rows consecutive, in position order), ``context_lens``
        [rows]."""
        # rows by their run's rank in table order; a stable sort keeps a run's rows in position order
        rank = np.empty(len(run_tables), dtype=np.int64)
        rank[lexicographic_order(run_tables)] = np.arange(len(run_tables))
        order = np.argsort(rank[run_of_row], kind="stable")
        return KernelRows(
            block_tables=torch.from_numpy(run_tables[run_of_row]).to(device),
            context_lens=torch.from_numpy(context_lens).to(device),
            order=torch.from_numpy(order).to(device),
            tiles=tiles,
        )


def expand_runs(firsts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive values as rows: run ``i`` is ``counts[i]`` rows holding ``firsts[i]``,
    ``firsts[i] + 1``, ... Returns each row's run and value ([sum(counts)] int64 each)."""
    run_of_row = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts  # each run's first row
    return run_of_row, firsts[run_of_row] + np.arange(len(run_of_row)) - starts[run_of_row]


def lexicographic_order(rows: np.ndarray) -> np.ndarray:  # [n] int64: a stable argsort
    """The order of ``rows`` ([n, W] non-negative ints) sorted as sequences: one sort of each
    row's big-endian bytes as a single key, ~20x faster than sorting them as lists."""
    if rows.shape[1] == 0:
        return np.arange(len(rows))
    keys = np.ascontiguousarray(rows.astype(">i8"))  # non-negative: bytes compare as the ints do
    return np.argsort(keys.view(np.dtype((np.void, 8 * rows.shape[1]))).ravel(), kind="stable")


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's K/V go and what each query may see."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    num_decodes: int  # the first num_decodes rows are decode queries, one per sequence
    decode_batches: tuple[DecodeBatch, ...]
    num_decode_parts: int  # partial results per decode row: its own blocks + its segments
    # Reused by every layer and batch for the gathered K and V: a fresh multi-MB tensor per
    # layer costs page faults that dwarf the copy itself.
    decode_gather_buffer: torch.Tensor  # [2, blocks of the largest batch, block numel]
    prefills: tuple[PrefillSegment, ...]
    # With ``in_place``: every row of the step (decode rows and prefill tokens alike) for a
    # kernel that reads the pools in place; then ``decode_batches`` and ``prefills`` are empty.
    # With ``in_place_decodes``: the first rows (the decode rows) for that kernel, beside
    # ``prefills`` (and no ``decode_batches``).
    kernel_rows: KernelRows | None = None

    @staticmethod
    def build(
        decode_block_tables: list[list[int]],
        decode_context_lens: list[int],
        prefills: list[tuple[list[int], int, int]],
        slot_mapping: list[int],
        block_size: int,
        null_block: int,
        workspace: "GatherWorkspace",
        query_group: int = 1,
        min_saved_tokens: int = 512,
        device: torch.device | str = "cpu",
        in_place: bool = False,
        in_place_decodes: bool = False,
        tiles: bool = False,
    ) -> "AttentionMetadata":
        """Build metadata from plain ints.

        Args:
            decode_block_tables / decode_context_lens: per decode sequence, its block ids and its
                context length including the token computed this step.
            prefills: per prefill segment ``(block_table, num_cached, num_new)``; the segment's
                rows follow the decode rows in this order.
            workspace: where decode K/V are gathered; the caller keeps it across steps.
            query_group: query heads per KV head (GQA).
            min_saved_tokens: read a shared segment once when that saves at least this many
                token reads (smaller ones are cheaper inside each row's own gather).
            in_place: describe every row of the step, prefill tokens included, for an in-place
                kernel (``kernel_rows``) instead of cascade batches and prefill segments.
            in_place_decodes: the decode rows for an in-place kernel (``kernel_rows``: the
                first rows) and the prefills as segments (GEMM attention), no cascade.
            tiles: the in-place kernel's rows run on the AMX tiles (``KernelRows.tiles``).
        """
        if in_place:
            return AttentionMetadata.for_kernel_rows(
                torch.tensor(slot_mapping, dtype=torch.int64, device=device), len(decode_block_tables),
                KernelRows.build(decode_block_tables, decode_context_lens, prefills, null_block, device, tiles),
                workspace)
        if in_place_decodes:
            return AttentionMetadata(
                slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
                num_decodes=len(decode_block_tables), decode_batches=(), num_decode_parts=1,
                decode_gather_buffer=workspace.take(0),
                prefills=tuple(_prefill_segments(prefills, len(decode_block_tables), query_group, device)),
                kernel_rows=KernelRows.build(decode_block_tables, decode_context_lens, [], null_block, device, tiles)
                if decode_block_tables else None)
        problems, num_parts = decode_problems(decode_block_tables, decode_context_lens, block_size, min_saved_tokens)
        batches = tuple(
            DecodeBatch.build(group, num_parts, block_size, null_block, device) for group in _batch_problems(problems)
        )
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_decodes=len(decode_block_tables),
            decode_batches=batches,
            num_decode_parts=num_parts,
            decode_gather_buffer=workspace.take(max((b.block_tables.numel() for b in batches), default=0)),
            prefills=tuple(_prefill_segments(prefills, len(decode_block_tables), query_group, device)),
        )

    @staticmethod
    def for_kernel_rows(slot_mapping: torch.Tensor, num_decodes: int, rows: KernelRows,
                        workspace: "GatherWorkspace") -> "AttentionMetadata":
        """A step's metadata for an in-place kernel: every row in ``rows``, no cascade batches or
        prefill segments (``build`` with ``in_place``, from rows built elsewhere)."""
        return AttentionMetadata(slot_mapping=slot_mapping, num_decodes=num_decodes, decode_batches=(),
                                 num_decode_parts=1, decode_gather_buffer=workspace.take(0), prefills=(),
                                 kernel_rows=rows)


class GatherWorkspace:
    """A reusable buffer for gathered K/V blocks, grown on demand, never shrunk."""

    def __init__(self, block_numel: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self._buffer = torch.empty(2, 0, block_numel, dtype=dtype, device=device)

    def take(self, num_blocks: int) -> torch.Tensor:  # [2 (K, V), num_blocks, block_numel]
        if self._buffer.shape[1] < num_blocks:
            grown = max(num_blocks, self._buffer.shape[1] * 5 // 4)
            self._buffer = self._buffer.new_empty(2, grown, self._buffer.shape[2])
        return self._buffer[:, :num_blocks]


def padded_rows(rows: list[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:  # [rows, max len]
    """``padded_array`` as a tensor on ``device``."""
    return torch.from_numpy(padded_array(rows, pad)).to(device)


def padded_array(rows: list[Sequence[int]], pad: int) -> np.ndarray:  # [len(rows), max len] int64
    """Rows of ints as one array, each padded to the longest with ``pad``. Flattened first: torch
    builds a tensor from nested lists element by element (8x slower at a step's block tables)."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lens.sum()))
    width = int(lens.max(initial=0))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    out[np.arange(width)[None, :] < lens[:, None]] = flat
    return out


def decode_problems(
    tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int, min_saved_tokens: int
) -> tuple[list[DecodeProblem], int]:
    """Every decode row's context as problems: the shared segments it is in, then the blocks
    no segment covers (its own). Returns them and the number of partial slots per row."""
    segments = _shared_segments(tables, context_lens, block_size, min_saved_tokens)
    covered: list[set[int]] = [set() for _ in tables]  # block indices per row
    next_part = [1] * len(tables)  # slot 0: the row's own blocks
    problems = []
    for rows, first, blocks in segments:
        problems.append(DecodeProblem(rows, [next_part[r] for r in rows], blocks, len(blocks) * block_size))
        for r in rows:
            covered[r].update(range(first, first + len(blocks)))
            next_part[r] += 1
    for r, (table, n) in enumerate(zip(tables, context_lens, strict=True)):
        # NOTE: a row's own blocks keep their order, so its partial newest block stays last.
        own = [b for i, b in enumerate(table) if i not in covered[r]]
        problems.append(DecodeProblem([r], [0], own, n - len(covered[r]) * block_size))
    return problems, max(next_part, default=1)


def _batch_problems(problems: list[DecodeProblem], min_fill: float = 0.6) -> list[list[DecodeProblem]]:
    """Problems grouped so padding wastes little: by number of rows (rounded up to a power of
    two), then by length, longest first; a group ends below ``min_fill`` of its longest."""
    by_width: dict[int, list[DecodeProblem]] = {}
    for p in problems:
        by_width.setdefault(1 << (len(p.rows) - 1).bit_length(), []).append(p)
    groups: list[list[DecodeProblem]] = []
    for same_width in by_width.values():
        same_width.sort(key=lambda p: -len(p.blocks))
        first = len(groups)
        for p in same_width:
            if len(groups) == first or len(p.blocks) < min_fill * len(groups[-1][0].blocks):
                groups.append([])
            groups[-1].append(p)
    return groups


def _shared_segments(
    tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int, min_saved_tokens: int
) -> list[tuple[list[int], int, list[int]]]:
    """``(rows, first block index, block ids)`` of each trie segment worth reading once.

    The trie is over each row's shareable blocks: those wholly before its newest token (that
    block is private). A maximal chain of trie nodes that the same rows pass through is one
    segment; it is kept when reading it once instead of once per row saves at least
    ``min_saved_tokens`` token reads, so tiny segments do not cost a kernel call each.
    """
    root: dict[int, tuple[list[int], dict]] = {}
    for row, table in enumerate(tables):
        node = root
        for block in table[: (context_lens[row] - 1) // block_size]:
            rows, node = node.setdefault(block, ([], {}))
            rows.append(row)
    segments = []
    stack = [(block, entry, 0) for block, entry in root.items()]
    while stack:
        block, (rows, children), first = stack.pop()
        blocks = [block]
        while len(children) == 1:
            ((child, (child_rows, grandchildren)),) = children.items()
            if len(child_rows) != len(rows):
                break
            blocks.append(child)
            children = grandchildren
        if (len(rows) - 1) * len(blocks) * block_size >= min_saved_tokens:
            segments.append((rows, first, blocks))
        stack.extend((child, entry, first + len(blocks)) for child, entry in children.items())
    return segments


def _prefill_segments(
    prefills: list[tuple[list[int], int, int]], start: int, query_group: int, device: torch.device | str
) -> Iterator[PrefillSegment]:
    for table, num_cached, num_new in prefills:
        yield PrefillSegment(start=start, num_new=num_new, num_cached=num_cached,
                             block_table=torch.tensor(table, dtype=torch.int64, device=device), query_group=query_group)
        start += num_new
