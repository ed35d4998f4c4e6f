"""Paged decode attention in Triton (the GPU path; the CPU runs it under ``TRITON_INTERPRET=1``),
with its plain-torch reference (``reference_decode_attention``).

One query token per decode row, read over the paged pools ``k_cache, v_cache: [num_blocks,
block_size, kv_heads, head_dim]`` through block tables. The work is a list of *problems*
(``DecodePlan``): each is some rows and blocks they all read, so the same kernel runs

- plain decode: one problem per row, over its whole block table (``DecodePlan.per_row``);
- the shared-prefix cascade of the CPU path (``DecodePlan.from_problems`` over
  ``kernels.attention_metadata.DecodeProblem``s): a prefix segment is one problem for every
  row that shares its blocks, read once for all of them; each row's own blocks are another.

One program per (problem, KV head, split): the problem's rows times the KV head's query group
(GQA) are the program's query rows, so every K/V tile read serves all of them. A long context
is cut into splits (split-KV, flash-decoding style), each writing a partial output and its
log-sum-exp into slot ``part * splits + split`` of its row; ``merge_partials``
(``kernels.triton_merge_partials``) weights the slots by a softmax of their log-sum-exps into
the exact attention over the row's whole context.

Contract: ``block_size`` and ``head_dim`` are powers of two, at least 16 (``tl.dot`` tiles);
every row has at least one key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import DecodeProblem, padded_rows
from kernels.triton_merge_partials import merge_partials
from kernels.triton_support import INTERPRETED, MIN_TILE, cast, check_tiles, dot_precision, mma



@triton.jit
def _decode_partials_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,
    rows_ptr, parts_ptr, blocks_ptr, num_keys_ptr,
    out_ptr, lse_ptr,
    scale, blocks_per_split, num_slots,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_rows, stride_blocks,
    stride_ot, stride_oh, stride_lse,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    problem = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)  # query row m: the problem's row m // GROUP, query head m % GROUP of the group
    member = m // GROUP
    head = kv_head * GROUP + m % GROUP
    in_problem = member < ROWS
    row = tl.load(rows_ptr + problem * stride_rows + member, mask=in_problem, other=-1)
    part = tl.load(parts_ptr + problem * stride_rows + member, mask=in_problem, other=0)
    live = row >= 0  # padding rows (-1) read zeros and write nothing
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=live[:, None], other=0.0)

    num_keys = tl.load(num_keys_ptr + problem)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(num_keys, BLOCK_SIZE))
    t = tl.arange(0, BLOCK_SIZE)
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for index in range(first, last):
        block = tl.load(blocks_ptr + problem * stride_blocks + index)
        offsets = block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + offsets)  # [BLOCK_SIZE, HEAD_DIM]
        v = tl.load(v_cache_ptr + offsets)
        scores = mma(q, tl.trans(k), PRECISION, INTERPRETED) * scale  # [BLOCK_M, BLOCK_SIZE]
        scores = tl.where((index * BLOCK_SIZE + t)[None, :] < num_keys, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        correction = tl.exp(run_max - new_max)  # 0 at the first block (exp(-inf))
        probs = tl.exp(scores - new_max[:, None])
        run_sum = run_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + mma(cast(probs, v.dtype, INTERPRETED), v, PRECISION, INTERPRETED)
        run_max = new_max

    # An empty split (past a short context) leaves run_sum 0: output 0, log-sum-exp -inf (weight 0).
    found = run_sum > 0
    out = acc / tl.where(found, run_sum, 1.0)[:, None]
    lse = tl.where(found, run_max + tl.log(tl.where(found, run_sum, 1.0)), float("-inf"))
    slot = row * num_slots + part * SPLITS + split
    tl.store(out_ptr + slot[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out, mask=live[:, None])
    tl.store(lse_ptr + slot * stride_lse + head, lse, mask=live)


@dataclass(frozen=True)
class DecodePlan:
    """A step's decode work as problems (see the module docstring), on the pools' device.

    Padding: a problem's unused row slots hold -1; its block list is padded with block ids
    never read (``num_keys`` bounds every read).
    """

    rows: torch.Tensor  # [P, R] int64 decode rows (-1: padding)
    parts: torch.Tensor  # [P, R] int64 the partial-result slot each row's answer goes to
    blocks: torch.Tensor  # [P, B] int64 block ids each problem reads, in order
    num_keys: torch.Tensor  # [P] int64 valid tokens in those blocks
    num_rows: int  # decode rows of the step
    num_parts: int  # partial results per row before splitting (1: no cascade)
    splits: int  # each problem's blocks cut into this many ranges
    blocks_per_split: int

    @property
    def num_slots(self) -> int:
        return self.num_parts * self.splits

    @staticmethod
    def per_row(block_tables: torch.Tensor, context_lens: torch.Tensor, splits: int = 1) -> "DecodePlan":
        """Plain decode: row ``r`` reads ``block_tables[r]`` up to ``context_lens[r]`` keys. The
        tensors are used as given (not copied), so a captured CUDA graph can refill them."""
        num_rows, max_blocks = block_tables.shape
        rows = torch.arange(num_rows, device=block_tables.device)[:, None]
        return DecodePlan(rows=rows, parts=torch.zeros_like(rows), blocks=block_tables, num_keys=context_lens,
                          num_rows=num_rows, num_parts=1, **_ranges(max_blocks, splits))

    @staticmethod
    def from_problems(problems: Sequence[DecodeProblem], num_rows: int, num_parts: int, kv_heads: int,
                      device: torch.device | str, target_programs: int) -> "DecodePlan":
        """The cascade's problems (``kernels.attention_metadata.decode_problems``), split so the
        launch has about ``target_programs`` programs (``launch_programs``)."""
        max_blocks = max((len(p.blocks) for p in problems), default=1)
        return DecodePlan(
            rows=padded_rows([p.rows for p in problems], -1, device),
            parts=padded_rows([p.parts for p in problems], 0, device),
            blocks=padded_rows([p.blocks for p in problems], 0, device),
            num_keys=torch.tensor([p.num_keys for p in problems], dtype=torch.int64, device=device),
            num_rows=num_rows, num_parts=num_parts,
            **_ranges(max_blocks, splits_for(len(problems), kv_heads, max_blocks, target_programs)),
        )


def _ranges(max_blocks: int, splits: int) -> dict[str, int]:
    """``splits`` and ``blocks_per_split`` for cutting ``max_blocks`` into at most ``splits``
    equal ranges (fewer when the last ones would be empty)."""
    per_split = max(1, -(-max_blocks // max(1, splits)))
    return {"splits": max(1, -(-max_blocks // per_split)), "blocks_per_split": per_split}


def launch_programs(device: torch.device) -> int:
    """How many programs a decode launch should have: two per streaming multiprocessor on a
    GPU; one per core interpreted on a CPU (it runs them one after another there)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def splits_for(num_problems: int, kv_heads: int, max_blocks: int, target_programs: int) -> int:
    """How many ranges to cut the longest problem's blocks into so that about ``target_programs``
    programs run (never more ranges than blocks)."""
    wanted = -(-target_programs // max(1, num_problems * kv_heads))
    return max(1, min(max_blocks, wanted))


def paged_decode_attention(
    q: torch.Tensor,  # [num_rows, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [num_rows, heads, head_dim] in q's dtype
    """Every decode row's attention over its context as ``plan`` describes it."""
    out, lse = decode_partials(q, k_cache, v_cache, plan, scale)
    return merge_partials(out, lse, q.dtype)


def decode_partials(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_rows, slots, heads, D] float32, lse [num_rows, slots, heads]
    """The kernel alone: each row's partial results, one per (part, split) slot; slots a row does
    not use keep log-sum-exp -inf (their outputs are undefined and weigh nothing)."""
    num_rows, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_tiles(block_size=block_size, head_dim=dim)
    group = heads // kv_heads
    problems, width = plan.rows.shape
    slots = plan.num_slots
    out = torch.empty(num_rows * slots, heads, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_rows * slots, heads), float("-inf"), dtype=torch.float32, device=q.device)
    if problems:
        _decode_partials_kernel[(problems, kv_heads, plan.splits)](
            q, k_cache, v_cache, plan.rows, plan.parts, plan.blocks, plan.num_keys, out, lse,
            scale, plan.blocks_per_split, slots,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            plan.rows.stride(0), plan.blocks.stride(0), out.stride(0), out.stride(1), lse.stride(0),
            GROUP=group, ROWS=width, BLOCK_M=max(MIN_TILE, triton.next_power_of_2(width * group)),
            BLOCK_SIZE=block_size, HEAD_DIM=dim, SPLITS=plan.splits, PRECISION=dot_precision(q.dtype), INTERPRETED=INTERPRETED,
        )
    return out.view(num_rows, slots, heads, dim), lse.view(num_rows, slots, heads)


def reference_decode_attention(
    q: torch.Tensor,  # [num_rows, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: Sequence[Sequence[int]],  # each row's whole block table
    context_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:  # [num_rows, heads, head_dim] in q's dtype
    """Plain torch, one row at a time, in float32: each row's query over its gathered context."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for r, (table, n) in enumerate(zip(block_tables, context_lens, strict=True)):
        k = k_cache[list(table)].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        v = v_cache[list(table)].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * scale, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out
