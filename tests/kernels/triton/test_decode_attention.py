"""Paged decode attention (kernels.triton_decode_attention) against its plain-torch reference:
plain per-row decode with split-KV, the shared-prefix cascade, GQA groups, partial blocks."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_metadata import decode_problems
from kernels.triton_decode_attention import (DecodePlan, decode_partials, paged_decode_attention,
                                             reference_decode_attention, splits_for)
from tests.kernels.triton.conftest import tolerance

BS, DIM, NUM_BLOCKS = 16, 16, 48
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def pools(kv_heads: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BS, kv_heads, DIM)
    return (torch.randn(shape, generator=g).to(dtype).to(device), torch.randn(shape, generator=g).to(dtype).to(device))


def tables_with_shared_prefix(rng: random.Random, lens: list[int]) -> list[list[int]]:
    """Block tables where most rows start with the same few blocks (a shared system prompt)."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(rng.randrange(0, 4))]
    tables = []
    for n in lens:
        head = shared[: min(len(shared), (n - 1) // BS)] if rng.random() < 0.75 else []
        tables.append(head + [free.pop() for _ in range(-(-n // BS) - len(head))])
    return tables


def padded(tables: list[list[int]], device: str) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 4), group=st.sampled_from([1, 2, 3]),
       kv_heads=st.sampled_from([1, 2]), splits=st.integers(1, 4), dtype=DTYPES)
def test_per_row_decode_with_splits_equals_reference(device, seed, rows, group, kv_heads, splits, dtype):
    rng = random.Random(seed)
    lens = [rng.randrange(1, 70) for _ in range(rows)]
    tables = tables_with_shared_prefix(rng, lens)
    k, v = pools(kv_heads, dtype, device, seed)
    q = torch.randn(rows, kv_heads * group, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    plan = DecodePlan.per_row(padded(tables, device), torch.tensor(lens, device=device), splits=splits)
    out = paged_decode_attention(q, k, v, plan, scale=DIM**-0.5)
    torch.testing.assert_close(out.float().cpu(), reference_decode_attention(q, k, v, tables, lens, DIM**-0.5).float().cpu(),
                               **tolerance(dtype))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(2, 5), group=st.sampled_from([1, 3]),
       target_programs=st.sampled_from([1, 8, 64]), dtype=DTYPES)
def test_cascade_over_shared_prefixes_equals_reference(device, seed, rows, group, target_programs, dtype):
    """Shared segments read once for all their rows (problems of several rows), own blocks
    after, merged by log-sum-exp: the same attention as each row over its whole table."""
    rng = random.Random(seed)
    lens = [rng.randrange(BS + 2, 70) for _ in range(rows)]
    tables = tables_with_shared_prefix(rng, lens)
    kv_heads = 2
    k, v = pools(kv_heads, dtype, device, seed)
    q = torch.randn(rows, kv_heads * group, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    problems, parts = decode_problems(tables, lens, BS, min_saved_tokens=1)
    plan = DecodePlan.from_problems(problems, rows, parts, kv_heads, device, target_programs=target_programs)
    out = paged_decode_attention(q, k, v, plan, scale=DIM**-0.5)
    torch.testing.assert_close(out.float().cpu(), reference_decode_attention(q, k, v, tables, lens, DIM**-0.5).float().cpu(),
                               **tolerance(dtype))


def test_a_cascade_problem_serves_every_row_that_shares_it(device):
    """Three rows over one two-block prefix: one problem of three rows reads it, so the
    partial slot of each row's prefix part is filled by a single program per KV head."""
    tables = [[1, 2, 10 + r] for r in range(3)]
    lens = [40, 41, 42]
    problems, parts = decode_problems(tables, lens, BS, min_saved_tokens=1)
    shared = [p for p in problems if len(p.rows) > 1]
    assert len(shared) == 1 and shared[0].rows == [0, 1, 2] and shared[0].blocks == [1, 2]
    k, v = pools(1, torch.float32, device, 0)
    q = torch.randn(3, 2, DIM, device=device)
    plan = DecodePlan.from_problems(problems, 3, parts, 1, device, target_programs=1)
    out, lse = decode_partials(q, k, v, plan, DIM**-0.5)
    assert torch.isfinite(lse).all()  # every row: its own part and the shared part
    torch.testing.assert_close(paged_decode_attention(q, k, v, plan, DIM**-0.5).cpu(),
                               reference_decode_attention(q, k, v, tables, lens, DIM**-0.5).cpu(), atol=2e-5, rtol=1e-4)


def test_splits_past_a_short_context_weigh_nothing(device):
    """A row of one key among rows of many blocks: its later splits are empty (lse -inf)."""
    tables, lens = [[1], [2, 3, 4, 5]], [1, 64]
    k, v = pools(1, torch.float32, device, 1)
    q = torch.randn(2, 1, DIM, device=device)
    plan = DecodePlan.per_row(padded(tables, device), torch.tensor(lens, device=device), splits=4)
    _, lse = decode_partials(q, k, v, plan, 1.0)
    assert torch.isinf(lse[0, 1:]).all() and torch.isfinite(lse[1]).all()
    # one key: the output is its value
    torch.testing.assert_close(paged_decode_attention(q, k, v, plan, 1.0)[0, 0].cpu(), v[1, 0, 0].cpu())


def test_splits_for_fills_the_target_and_never_exceeds_the_blocks():
    assert splits_for(num_problems=2, kv_heads=2, max_blocks=100, target_programs=64) == 16
    assert splits_for(num_problems=2, kv_heads=2, max_blocks=3, target_programs=64) == 3
    assert splits_for(num_problems=500, kv_heads=4, max_blocks=100, target_programs=64) == 1


def test_tiles_too_small_for_the_kernel_are_refused(device):
    k = torch.zeros(4, 8, 1, DIM, device=device)
    plan = DecodePlan.per_row(torch.zeros(1, 1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="block_size a power of two >= 16"):
        paged_decode_attention(torch.zeros(1, 1, DIM, device=device), k, k, plan, 1.0)
