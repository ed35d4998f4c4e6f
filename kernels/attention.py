"""Paged attention, plain torch (the CPU path and the reference twin of any GPU kernel).

KV lives in per-layer pools ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``.
The token at position ``p`` of a sequence sits at slot
``block_table[p // block_size] * block_size + p % block_size``.

A step's tokens are laid out flat: first one token for each *decode* sequence, then the new
tokens of each *prefill* segment (a chunk of a prompt, after any cached prefix)::

    | decode 0 | decode 1 | ... | prefill A (n_A tokens) | prefill B (n_B tokens) | ...

Decode attention is a cascade over shared blocks. Robots of one type share a long system
prompt, a robot's requests share its scene, and a replan shares its whole conversation; the
radix cache makes all of them share *physical* blocks. The decode rows' block tables form a
trie; each trie segment that enough rows pass through is read once for all of them (all
their queries against one K/V), each row gathers only the blocks no segment covers, and the
partial softmaxes are merged by log-sum-exp (keys are position-encoded, so their order does
not matter)::

    row r:  | system prompt (128 rows) | scene (8 rows) | history (2 rows) | own blocks |

All index tensors and masks are built once per step (``AttentionMetadata``), not per layer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

# Returns (output, logsumexp); the public SDPA does not expose the logsumexp a merge needs.
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


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
    def build(rows, tables, lens, block_size, null_block, device) -> "SuffixBucket":
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


def _prefill_segments(prefills: list[tuple[list[int], int, int]], start: int, query_group: int, device):
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


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store the new tokens' K/V at their slots (in place)."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., nb] block ids -> [..., nb * block_size, kv_heads, head_dim] contiguous K or V."""
    # NOTE: index_select over 2-D rows (one block each) is a parallel memcpy; over the 4-D
    # tensor it is several times slower on CPU.
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, block_table.flatten(), out=out)
    return rows.view(*block_table.shape[:-1], -1, *cache.shape[2:])


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Attention of every query over its sequence's paged context (new K/V already written)."""
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta, scale)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_new)
        out[rows] = _prefill_attention(q[rows], k_cache, v_cache, seg, scale)
    return out


def _prefill_attention(q, k_cache, v_cache, seg: PrefillSegment, scale: float) -> torch.Tensor:
    """A segment's new tokens over its whole context, one flash call for all heads."""
    n, heads, dim = q.shape
    kvh = k_cache.shape[2]
    k = _gather(k_cache, seg.block_table)[: seg.context_len].transpose(0, 1)[None]  # [1, kvh, L, D]
    v = _gather(v_cache, seg.block_table)[: seg.context_len].transpose(0, 1)[None]
    qg = q.view(n, kvh, heads // kvh, dim).permute(1, 2, 0, 3).reshape(1, kvh, -1, dim)  # rows (j, t)
    o, _ = _flash_with_lse(qg, k, v, attn_mask=seg.mask, scale=scale)
    return o.view(kvh, heads // kvh, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per row; GQA by folding each KV head's query group into the query length.

    Every row gets one partial result (output + log-sum-exp) from its own blocks (part 0) and
    one from each shared segment it is in (parts 1..); a softmax over the parts' log-sum-exps
    weights them into the exact attention over the row's whole context.
    """
    nd, heads, dim = q.shape
    kvh = k_cache.shape[2]
    qg = q.view(nd, kvh, heads // kvh, dim)  # [nd, kvh, g, D]: kv head i serves query heads i*g..
    parts_out = q.new_zeros(nd, meta.num_decode_parts, *qg.shape[1:])  # [nd, parts, kvh, g, D]
    parts_lse = torch.full(parts_out.shape[:4], float("-inf"), device=q.device)  # [nd, parts, kvh, g]
    for bucket in meta.suffix_buckets:
        k_buf, v_buf = meta.decode_gather_buffer[:, : bucket.block_tables.numel()]
        k = _gather(k_cache, bucket.block_tables, out=k_buf).transpose(1, 2)  # [n, kvh, S, D]
        v = _gather(v_cache, bucket.block_tables, out=v_buf).transpose(1, 2)
        parts_out[bucket.rows, 0], parts_lse[bucket.rows, 0] = _flash_with_lse(
            qg[bucket.rows], k, v, attn_mask=bucket.mask, scale=scale
        )
    for segment in meta.shared_segments:
        out, lse = _segment_attention(qg, k_cache, v_cache, segment, scale)
        parts_out[segment.rows, segment.parts] = out
        parts_lse[segment.rows, segment.parts] = lse
    weights = parts_lse.softmax(dim=1).to(q.dtype)[..., None]  # [nd, parts, kvh, g, 1]
    return (weights * parts_out).sum(dim=1).reshape(nd, heads, dim)


def _segment_attention(qg, k_cache, v_cache, segment: SharedSegment, scale: float):
    """All of ``segment.rows``' queries against the segment's blocks in one call.
    Returns output [n, kvh, g, D] and log-sum-exp [n, kvh, g]."""
    n, (_, kvh, g, dim) = len(segment.rows), qg.shape
    k = _gather(k_cache, segment.block_ids).transpose(0, 1)[None]  # [1, kvh, P, D]
    v = _gather(v_cache, segment.block_ids).transpose(0, 1)[None]
    q = qg[segment.rows].transpose(0, 1).reshape(1, kvh, n * g, dim)
    out, lse = _flash_with_lse(q, k, v, scale=scale)
    return out.view(kvh, n, g, dim).transpose(0, 1), lse.view(kvh, n, g).transpose(0, 1)
