"""Per-step attention metadata, built once from plain ints and shared by every layer:
where new K/V go, which blocks each decode row reads on its own, which shared block segments
are read once for several rows (see ``kernels.attention``), and each prefill segment's mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSegment:
    """New tokens of one sequence that attend causally to its cached context and to each other."""

    start: int  # first row of the segment in the flat token batch
    num_new: int  # tokens computed this step
    block_table: torch.Tensor  # [num_blocks_for_context] int64
    # Causal mask with the cached context in front, float 0 / -inf, one row per (query-group
    # member j, new token t) at row j * num_new + t: GQA folds each KV head's group of query
    # heads into the query length.
    mask: torch.Tensor  # [query_group * num_new, context_len]

    @property
    def context_len(self) -> int:
        return self.mask.shape[1]


@dataclass(frozen=True)
class SharedSegment:
    """Physical blocks that several decode rows' tables hold at the same positions."""

    rows: torch.Tensor  # [n] int64, decode rows (n >= 2)
    parts: torch.Tensor  # [n] int64, the partial-result slot (>= 1) this segment fills per row
    block_ids: torch.Tensor  # [p] int64, consecutive logical blocks of each of those rows


@dataclass(frozen=True)
class SuffixBucket:
    """Decode rows whose own (unshared) context is of similar length, padded to the longest."""

    rows: torch.Tensor  # [n] int64 decode rows
    block_tables: torch.Tensor  # [n, max_blocks] int64; padded with the null block
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] float: 0 visible, -inf padding

    @staticmethod
    def build(
        rows: list[int], tables: list[list[int]], lens: list[int], block_size: int, null_block: int,
        device: torch.device | str,
    ) -> "SuffixBucket":
        max_blocks = max(len(t) for t in tables)
        padded = torch.full((len(rows), max_blocks), null_block, dtype=torch.int64)
        for i, table in enumerate(tables):
            padded[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
        visible = torch.arange(max_blocks * block_size)[None, :] < torch.tensor(lens)[:, None]
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]
        return SuffixBucket(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            block_tables=padded.to(device),
            mask=mask.to(device),
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's K/V go and what each query may see."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    num_decodes: int  # the first num_decodes rows are decode queries, one per sequence
    suffix_buckets: tuple[SuffixBucket, ...]  # every decode row is in exactly one
    # Reused by every layer and bucket for the gathered suffix K and V: a fresh multi-MB tensor
    # per layer costs page faults that dwarf the copy itself.
    decode_gather_buffer: torch.Tensor  # [2, blocks of the largest bucket, block numel]
    shared_segments: tuple[SharedSegment, ...]
    num_decode_parts: int  # 1 + the most shared segments any decode row is in
    prefills: tuple[PrefillSegment, ...]

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
        """
        segments = _shared_segments(decode_block_tables, decode_context_lens, block_size, min_saved_tokens)
        covered: list[set[int]] = [set() for _ in decode_block_tables]  # block indices per row
        parts = []  # per segment, the partial-result slot of each of its rows
        num_parts = [1] * len(decode_block_tables)
        for rows, first, blocks in segments:
            parts.append([num_parts[r] for r in rows])
            for r in rows:
                covered[r].update(range(first, first + len(blocks)))
                num_parts[r] += 1
        # NOTE: a row's own blocks keep their order, so its partial newest block stays last.
        suffixes = [[b for i, b in enumerate(t) if i not in c] for t, c in zip(decode_block_tables, covered)]
        suffix_lens = [n - len(c) * block_size for n, c in zip(decode_context_lens, covered, strict=True)]
        buckets = tuple(
            SuffixBucket.build(rows, [suffixes[r] for r in rows], [suffix_lens[r] for r in rows],
                               block_size, null_block, device)
            for rows in _length_buckets(suffix_lens)
        )
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_decodes=len(decode_block_tables),
            suffix_buckets=buckets,
            decode_gather_buffer=workspace.take(max((b.block_tables.numel() for b in buckets), default=0)),
            shared_segments=tuple(
                SharedSegment(
                    rows=torch.tensor(rows, dtype=torch.int64, device=device),
                    parts=torch.tensor(row_parts, dtype=torch.int64, device=device),
                    block_ids=torch.tensor(blocks, dtype=torch.int64, device=device),
                )
                for (rows, _, blocks), row_parts in zip(segments, parts, strict=True)
            ),
            num_decode_parts=max(num_parts, default=1),
            prefills=tuple(_prefill_segments(prefills, len(decode_block_tables), query_group, device)),
        )


class GatherWorkspace:
    """A reusable buffer for gathered K/V blocks, grown on demand, never shrunk."""

    def __init__(self, block_numel: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self._buffer = torch.empty(2, 0, block_numel, dtype=dtype, device=device)

    def take(self, num_blocks: int) -> torch.Tensor:  # [2 (K, V), num_blocks, block_numel]
        if self._buffer.shape[1] < num_blocks:
            grown = max(num_blocks, self._buffer.shape[1] * 5 // 4)
            self._buffer = self._buffer.new_empty(2, grown, self._buffer.shape[2])
        return self._buffer[:, :num_blocks]


def _length_buckets(lens: list[int], max_buckets: int = 4, min_fill: float = 0.6) -> list[list[int]]:
    """Rows split by length, longest first, so padding to a bucket's longest row wastes little:
    a new bucket starts when a row is shorter than ``min_fill`` of the bucket's longest."""
    order = sorted(range(len(lens)), key=lambda r: -lens[r])
    buckets: list[list[int]] = []
    for r in order:
        if not buckets or (len(buckets) < max_buckets and lens[r] < min_fill * lens[buckets[-1][0]]):
            buckets.append([])
        buckets[-1].append(r)
    return buckets


def _shared_segments(
    tables: list[list[int]], context_lens: list[int], block_size: int, min_saved_tokens: int
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
        context_len = num_cached + num_new
        query_pos = torch.arange(num_cached, context_len)
        hidden = torch.arange(context_len)[None, :] > query_pos[:, None]
        mask = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf")).repeat(query_group, 1)
        yield PrefillSegment(
            start=start,
            num_new=num_new,
            block_table=torch.tensor(table, dtype=torch.int64, device=device),
            mask=mask.to(device),
        )
        start += num_new
