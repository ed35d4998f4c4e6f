"""Paged attention, plain torch (the CPU path and the reference twin of any GPU kernel).

KV lives in per-layer pools ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``.
The token at position ``p`` of a sequence sits at slot
``block_table[p // block_size] * block_size + p % block_size``.

A step's tokens are laid out flat: first one token for each *decode* sequence, then the new
tokens of each *prefill* segment (a chunk of a prompt, after any cached prefix)::

    | decode 0 | decode 1 | ... | prefill A (n_A tokens) | prefill B (n_B tokens) | ...

Decode attention is a two-level cascade. Robots of one type share a long system prompt, and
the radix cache makes their requests share its *physical* blocks; those blocks are read once
for all the decode rows that share them (all their queries against one K/V), each row's own
suffix is gathered per row, and the two partial softmaxes are merged by log-sum-exp::

    row r:  | shared prefix blocks (read once per group) | own suffix blocks (gathered) |

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
class SharedPrefix:
    """Decode rows whose block tables start with the same physical blocks."""

    rows: torch.Tensor  # [n] int64, decode rows (n >= 2)
    block_ids: torch.Tensor  # [p] int64, the shared leading blocks


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
    shared_prefixes: tuple[SharedPrefix, ...]
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
        """
        groups = _shared_prefix_groups(decode_block_tables, decode_context_lens, block_size)
        skip = [0] * len(decode_block_tables)  # shared blocks each decode row skips
        for rows, num_blocks in groups:
            for r in rows:
                skip[r] = num_blocks
        suffixes = [t[s:] for t, s in zip(decode_block_tables, skip, strict=True)]
        suffix_lens = [n - s * block_size for n, s in zip(decode_context_lens, skip, strict=True)]
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
            shared_prefixes=tuple(
                SharedPrefix(
                    rows=torch.tensor(rows, dtype=torch.int64, device=device),
                    block_ids=torch.tensor(decode_block_tables[rows[0]][:n], dtype=torch.int64, device=device),
                )
                for rows, n in groups
            ),
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


def _shared_prefix_groups(
    tables: list[list[int]], context_lens: list[int], block_size: int
) -> list[tuple[list[int], int]]:
    """(rows, number of shared leading blocks) for each set of >= 2 rows with a common first
    block. Only blocks wholly before each row's newest token are shared (that block is private)."""
    by_first: dict[int, list[int]] = defaultdict(list)
    for row, table in enumerate(tables):
        by_first[table[0]].append(row)
    groups = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        n = min((context_lens[r] - 1) // block_size for r in rows)
        first = tables[rows[0]]
        for r in rows[1:]:
            n = min(n, _common_len(first, tables[r], n))
        if n > 0:
            groups.append((rows, n))
    return groups


def _common_len(a: list[int], b: list[int], limit: int) -> int:
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i


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
    """One query per row; GQA by folding each KV head's query group into the query length."""
    nd, heads, dim = q.shape
    kvh = k_cache.shape[2]
    qg = q.view(nd, kvh, heads // kvh, dim)  # [nd, kvh, g, D]: kv head i serves query heads i*g..
    out = torch.empty_like(qg)
    lse = torch.empty(qg.shape[:3], dtype=torch.float32, device=q.device)  # [nd, kvh, g]
    for bucket in meta.suffix_buckets:
        k_buf, v_buf = meta.decode_gather_buffer[:, : bucket.block_tables.numel()]
        k = _gather(k_cache, bucket.block_tables, out=k_buf).transpose(1, 2)  # [n, kvh, S, D]
        v = _gather(v_cache, bucket.block_tables, out=v_buf).transpose(1, 2)
        out[bucket.rows], lse[bucket.rows] = _flash_with_lse(
            qg[bucket.rows], k, v, attn_mask=bucket.mask, scale=scale
        )
    for shared in meta.shared_prefixes:
        _merge_shared_prefix(out, lse, qg, k_cache, v_cache, shared, scale)
    return out.reshape(nd, heads, dim)


def _merge_shared_prefix(out, lse, qg, k_cache, v_cache, shared: SharedPrefix, scale: float) -> None:
    """Attend ``shared.rows`` to their common blocks in one call; fold into ``out``/``lse``."""
    n, (_, kvh, g, dim) = len(shared.rows), qg.shape
    k = _gather(k_cache, shared.block_ids).transpose(0, 1)[None]  # [1, kvh, P, D]
    v = _gather(v_cache, shared.block_ids).transpose(0, 1)[None]
    q = qg[shared.rows].transpose(0, 1).reshape(1, kvh, n * g, dim)  # every row's queries at once
    out_p, lse_p = _flash_with_lse(q, k, v, scale=scale)
    out_p = out_p.view(kvh, n, g, dim).transpose(0, 1)  # [n, kvh, g, D]
    lse_p = lse_p.view(kvh, n, g).transpose(0, 1)  # [n, kvh, g]
    lse_s = lse[shared.rows]
    lse_new = torch.logaddexp(lse_s, lse_p)
    merged = out[shared.rows] * (lse_s - lse_new).exp()[..., None] + out_p * (lse_p - lse_new).exp()[..., None]
    out[shared.rows] = merged
    lse[shared.rows] = lse_new
