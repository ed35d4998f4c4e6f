"""Paged attention (cascade decode over shared prefix blocks, chunked prefill) vs dense attention."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import attention
from kernels.attention import attention_with_lse, paged_attention
from kernels.attention_metadata import AttentionMetadata, GatherWorkspace
from kernels.paged_decode_cpu import paged_decode_kernel

BS, KVH, HEADS, DIM, NUM_BLOCKS = 4, 2, 6, 8, 64


def dense(q, k, v, num_cached):
    """q: [n, H, D] at positions num_cached..; k, v: [L, KVH, D] for positions 0..L-1."""
    n, L = q.shape[0], k.shape[0]
    mask = torch.arange(L)[None, :] <= torch.arange(num_cached, num_cached + n)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), num_decodes=st.integers(0, 5), num_prefills=st.integers(0, 3))
def test_paged_attention_equals_dense(seed, num_decodes, num_prefills):
    assert_paged_equals_dense(seed, num_decodes, num_prefills)


def test_paged_attention_through_the_non_cpu_kernel_equals_dense(monkeypatch):
    """What a CUDA device runs (`attention_with_lse` in every call), here on the CPU."""
    monkeypatch.setattr(attention, "_flash_with_lse", attention_with_lse)
    monkeypatch.setattr(attention, "softmax_lse_kernel", lambda: None)
    for seed in range(6):
        assert_paged_equals_dense(seed, num_decodes=5, num_prefills=2)


@pytest.mark.skipif(paged_decode_kernel() is None, reason="the CPU decode kernel could not be built here")
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), num_decodes=st.integers(1, 5), num_prefills=st.integers(0, 2))
def test_paged_attention_with_the_in_place_cpu_kernel_equals_dense(seed, num_decodes, num_prefills):
    assert_paged_equals_dense(seed, num_decodes, num_prefills, in_place=True)


@pytest.mark.skipif(paged_decode_kernel() is None, reason="the CPU decode kernel could not be built here")
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), num_decodes=st.integers(0, 5), num_prefills=st.integers(0, 3))
def test_decode_rows_in_place_beside_gemm_prefill_segments_equal_dense(seed, num_decodes, num_prefills):
    assert_paged_equals_dense(seed, num_decodes, num_prefills, in_place_decodes=True)


def assert_paged_equals_dense(seed: int, num_decodes: int, num_prefills: int, in_place: bool = False,
                              in_place_decodes: bool = False) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BS, KVH, DIM)
    v_cache = torch.randn(NUM_BLOCKS, BS, KVH, DIM)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(rng.randrange(0, 5))]  # a "system prompt" some rows share

    def table_for(context_len: int) -> list[int]:
        own = -(-context_len // BS)
        head = shared[: min(len(shared), (context_len - 1) // BS)] if rng.random() < 0.7 else []
        return head + [free.pop() for _ in range(own - len(head))]

    decodes = [(table_for(n), n) for n in (rng.randrange(1, 30) for _ in range(num_decodes))]
    prefills = []
    for _ in range(num_prefills):
        total = rng.randrange(1, 30)
        cached = rng.randrange(0, total)
        prefills.append((table_for(total), cached, total - cached))
    rows = num_decodes + sum(p[2] for p in prefills)
    q = torch.randn(rows, HEADS, DIM)
    meta = AttentionMetadata.build(
        [t for t, _ in decodes], [n for _, n in decodes], prefills, slot_mapping=[0] * rows,
        block_size=BS, null_block=0, workspace=GatherWorkspace(BS * KVH * DIM, torch.float32),
        query_group=HEADS // KVH, min_saved_tokens=1, in_place=in_place, in_place_decodes=in_place_decodes,
    )
    assert (meta.kernel_rows is not None) == (in_place or (in_place_decodes and num_decodes > 0))
    assert not in_place or not (meta.decode_batches or meta.prefills)  # the kernel takes every row
    if in_place_decodes:  # the kernel takes the decode rows, the prefills are segments
        assert not meta.decode_batches and len(meta.prefills) == num_prefills
        assert meta.kernel_rows is None or len(meta.kernel_rows.context_lens) == num_decodes
    out = paged_attention(q, k_cache, v_cache, meta, scale=DIM**-0.5)

    def context(table, length):
        flat_k = k_cache[torch.tensor(table)].reshape(-1, KVH, DIM)[:length]
        flat_v = v_cache[torch.tensor(table)].reshape(-1, KVH, DIM)[:length]
        return flat_k, flat_v

    for row, (table, n) in enumerate(decodes):
        k, v = context(table, n)
        torch.testing.assert_close(out[row : row + 1], dense(q[row : row + 1], k, v, n - 1), atol=1e-5, rtol=1e-5)
    row = num_decodes
    for table, cached, new in prefills:
        k, v = context(table, cached + new)
        torch.testing.assert_close(out[row : row + new], dense(q[row : row + new], k, v, cached), atol=1e-5, rtol=1e-5)
        row += new


def problems_of(meta: AttentionMetadata) -> dict[tuple[int, ...], tuple[list[int], int]]:
    """rows -> (blocks, visible keys) of every problem in the step's decode batches."""
    found = {}
    scratch = meta.num_decode_parts
    for batch in meta.decode_batches:
        for rows, parts, table, mask in zip(batch.rows.tolist(), batch.parts.tolist(),
                                            batch.block_tables.tolist(), batch.mask):
            real = tuple(r for r, p in zip(rows, parts) if p != scratch)
            visible = int((mask == 0).sum())
            found[real] = (table[: -(-visible // BS)], visible)
    return found


def test_rows_read_each_shared_segment_once_and_gather_only_their_own_blocks():
    # rows 0-2 share blocks 7, 8 (a system prompt); rows 0-1 also share 20 (a conversation)
    tables = [[7, 8, 20, 30], [7, 8, 20, 31, 32], [7, 8, 40], [50, 51]]
    meta = AttentionMetadata.build(
        decode_block_tables=tables, decode_context_lens=[14, 17, 10, 6], prefills=[],
        slot_mapping=[0] * 4, block_size=BS, null_block=0,
        workspace=GatherWorkspace(BS * KVH * DIM, torch.float32), min_saved_tokens=1,
    )
    assert problems_of(meta) == {
        (0, 1, 2): ([7, 8], 8),
        (0, 1): ([20], 4),
        (0,): ([30], 2),
        (1,): ([31, 32], 5),
        (2,): ([40], 2),
        (3,): ([50, 51], 6),
    }
    assert meta.num_decode_parts == 3  # rows 0 and 1: own blocks + two segments


def test_small_segments_stay_in_each_rows_own_gather():
    meta = AttentionMetadata.build(
        decode_block_tables=[[7, 8, 1], [7, 8, 2]], decode_context_lens=[10, 10], prefills=[],
        slot_mapping=[0, 0], block_size=BS, null_block=0,
        workspace=GatherWorkspace(BS * KVH * DIM, torch.float32), min_saved_tokens=9,  # saves 8
    )
    assert problems_of(meta) == {(0,): ([7, 8, 1], 10), (1,): ([7, 8, 2], 10)}


def cpu_flash(q, k, v, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_shape", [(3, 1, 1, 20), (12, 20)])  # a decode batch's, a prefill's
def test_attention_with_lse_matches_the_cpu_flash_kernel(dtype, mask_shape):
    torch.manual_seed(0)
    q = torch.randn(3, 2, 12, DIM, dtype=dtype)
    k, v = torch.randn(2, 3, 2, 20, DIM, dtype=dtype)
    hidden = torch.rand(mask_shape) < 0.5
    hidden[..., 0] = False  # every row sees a key, as the metadata guarantees
    mask = torch.zeros(mask_shape).masked_fill(hidden, float("-inf"))
    out, lse = attention_with_lse(q, k, v, mask, scale=0.3)
    want_out, want_lse = cpu_flash(q, k, v, mask, scale=0.3)
    assert (out.shape, out.dtype, out.is_contiguous()) == (want_out.shape, want_out.dtype, True)
    assert (lse.shape, lse.dtype, lse.is_contiguous()) == (want_lse.shape, want_lse.dtype, True)
    out_tol, lse_tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-4)  # bf16 out: 1 ulp at 1.5
    torch.testing.assert_close(out, want_out, atol=out_tol, rtol=out_tol)
    torch.testing.assert_close(lse, want_lse, atol=lse_tol, rtol=lse_tol)


def test_metadata_tensors_live_on_the_given_device():
    meta = AttentionMetadata.build(
        decode_block_tables=[[7, 8, 20], [7, 8, 21]], decode_context_lens=[10, 11], prefills=[([5, 6], 2, 5)],
        slot_mapping=list(range(7)), block_size=BS, null_block=0,
        workspace=GatherWorkspace(BS * KVH * DIM, torch.float32, "meta"), query_group=3, min_saved_tokens=1,
        device="meta",
    )
    tensors = [meta.slot_mapping, meta.decode_gather_buffer]
    tensors += [getattr(part, f.name) for part in meta.decode_batches + meta.prefills
                for f in dataclasses.fields(part) if isinstance(getattr(part, f.name), torch.Tensor)]
    tensors += [t for seg in meta.prefills for t in (seg.visible, seg.mask)]
    assert len(tensors) == 2 + 4 * len(meta.decode_batches) + 3 * len(meta.prefills)
    assert all(t.is_meta for t in tensors)


def test_in_place_rows_are_every_token_seeing_its_context_up_to_itself_sorted_by_table():
    meta = AttentionMetadata.build(
        decode_block_tables=[[9, 3], [7, 8, 20]], decode_context_lens=[6, 11],
        prefills=[([7, 8], 5, 3), ([4], 0, 2)],  # 3 tokens after 5 cached; a prompt's first 2
        slot_mapping=[0] * 7, block_size=BS, null_block=0,
        workspace=GatherWorkspace(BS * KVH * DIM, torch.float32), in_place=True,
    )
    rows = meta.kernel_rows
    assert rows.context_lens.tolist() == [6, 11, 6, 7, 8, 1, 2]
    assert rows.block_tables.tolist() == [[9, 3, 0], [7, 8, 20], [7, 8, 0], [7, 8, 0], [7, 8, 0], [4, 0, 0], [4, 0, 0]]
    assert rows.order.tolist() == [5, 6, 2, 3, 4, 1, 0]  # by table: [4], [7, 8], [7, 8, 20], [9, 3]


def test_in_place_rows_live_on_the_given_device():
    meta = AttentionMetadata.build(
        decode_block_tables=[[7, 8, 20]], decode_context_lens=[10], prefills=[([5, 6], 2, 5)],
        slot_mapping=list(range(6)), block_size=BS, null_block=0,
        workspace=GatherWorkspace(BS * KVH * DIM, torch.float32, "meta"), device="meta", in_place=True,
    )
    rows = meta.kernel_rows
    assert all(t.is_meta for t in (meta.slot_mapping, rows.block_tables, rows.context_lens, rows.order))
