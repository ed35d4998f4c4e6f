"""The CPU paged decode kernel against plain torch: each row's context gathered from its block
table, its query heads expanded over their KV head, softmax in float32."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.kv_layout import allocate_kv, write_kv
from kernels.paged_decode_cpu import paged_decode_kernel, paged_decode_tiles_kernel, supports_paired, supports_tiles

if paged_decode_kernel() is None and shutil.which("g++") is not None:
    pytest.fail("a C++ compiler is here but the CPU decode kernel did not build (see the log)")
pytestmark = pytest.mark.skipif(paged_decode_kernel() is None, reason="no C++ compiler: the torch path runs instead")


def reference(q, k_cache, v_cache, tables, lens, scale):
    """out [R, H, D] (float32), lse [R, H]: dense attention of each row over its gathered keys."""
    rows, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    outs, lses = [], []
    for r in range(rows):
        k = k_cache[tables[r]].reshape(-1, *k_cache.shape[2:])[: lens[r]].float()  # [L, KVH, D]
        v = v_cache[tables[r]].reshape(-1, *v_cache.shape[2:])[: lens[r]].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[r].float(), k) * scale
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
        lses.append(scores.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


# NOTE: bf16 with head_dim a multiple of 32 runs the vector task where the CPU has AVX-512 BF16:
# 16-key tiles (block_size 32 has two per block, 4 a partial one) and up to 8 heads per pass
# (group 5 and 8 take two passes at head_dim 64, more at 128). float32 runs the AVX2 task where
# the CPU has AVX2 and FMA: 8-key tiles (block_size 1 and 4 are partial ones).
@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 12), kv_heads=st.sampled_from([1, 2, 3]),
       group=st.sampled_from([1, 2, 3, 4, 5, 8]), dim=st.sampled_from([8, 16, 32, 64, 128]),
       block_size=st.sampled_from([1, 4, 16, 32]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_kernel_equals_plain_torch(seed, rows, kv_heads, group, dim, block_size, dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    q = torch.randn(rows, kv_heads * group, dim).to(dtype)
    # prefixes rows share, nested as a fleet's are: a system prompt, then two robots' scenes after it
    ids = rng.sample(range(1, num_blocks), 8)
    system, scene_a, scene_b = ids[:2], ids[2:5], ids[5:]
    prefixes = [[], system, system + scene_a, system + scene_b]
    lens = [rng.randrange(1, 6 * block_size + 1) for _ in range(rows)]  # partial last blocks too
    tables = []
    for n in lens:
        needed = -(-n // block_size)
        head = rng.choice(prefixes)[:needed]
        tables.append(head + rng.sample([b for b in range(1, num_blocks) if b not in head], needed - len(head)))
    width = max(map(len, tables)) + rng.randrange(0, 3)  # padding past a row's blocks is never read
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    scale = dim**-0.5
    # The order rows run in changes nothing: random, or sorted by table as the engine runs them,
    # where rows sharing leading blocks are neighbours and run as one task
    order = torch.tensor(sorted(range(rows), key=lambda r: tables[r]) if rng.random() < 0.5
                         else rng.sample(range(rows), rows))
    out, lse = paged_decode_kernel()(q, k_cache, v_cache, padded, torch.tensor(lens), scale, True, order)
    want_out, want_lse = reference(q, k_cache, v_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_without_lse_the_second_result_is_none_and_bad_input_is_refused():
    kernel = paged_decode_kernel()
    q, cache = torch.randn(2, 4, 32), torch.randn(8, 4, 2, 32)
    tables, lens = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 4])
    out, lse = kernel(q, cache, cache, tables, lens, 0.1, False)
    assert out.shape == q.shape and lse is None
    with pytest.raises(RuntimeError, match="at least one key"):
        kernel(q, cache, cache, tables, torch.tensor([5, 0]), 0.1, False)
    with pytest.raises(RuntimeError, match="permutation"):
        kernel(q, cache, cache, tables, lens, 0.1, False, torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(q.bfloat16(), cache, cache, tables, lens, 0.1, False)
    with pytest.raises(RuntimeError, match="head_dim 24 is not compiled"):
        kernel(torch.randn(2, 4, 24), *[torch.randn(8, 4, 2, 24)] * 2, tables, lens, 0.1, False)


@pytest.mark.skipif(not supports_paired(64, torch.bfloat16, 16), reason="the paired layout needs AVX-512 BF16")
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 12), kv_heads=st.sampled_from([1, 3]),
       group=st.sampled_from([1, 3, 5, 8]), dim=st.sampled_from([32, 64, 128]), block_size=st.sampled_from([16, 32]))
def test_paired_layout_gives_the_tokens_layouts_results_exactly(seed, rows, kv_heads, group, dim, block_size):
    """The same K/V written into both layouts: the same bits out (the same products in the same
    order), with the paired slabs' unwritten slots holding NaN (never read into a result)."""
    step = both_layouts(seed, rows, kv_heads, group, dim, block_size)
    want = paged_decode_kernel()(step.q, *step.tokens, *step.rows, True, step.order)
    got = paged_decode_kernel()(step.q, *step.paired, *step.rows, True, step.order)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@dataclass
class BothLayouts:
    tokens: tuple[torch.Tensor, torch.Tensor]
    paired: tuple[torch.Tensor, torch.Tensor]  # unwritten slots hold NaN
    tables: list[list[int]]
    lens: list[int]
    q: torch.Tensor
    order: torch.Tensor  # rows sorted by table, as the engine runs them
    rows: tuple  # (block tables padded, context lengths, scale): the kernel's next arguments


def both_layouts(seed, rows, kv_heads, group, dim, block_size, context_blocks=4) -> BothLayouts:
    """One decode step's K/V written into pools of both layouts (some rows sharing a prompt),
    each row's context up to ``context_blocks`` blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 32
    tokens = allocate_kv(num_blocks, block_size, kv_heads, dim, torch.bfloat16, "cpu", paired=False)
    paired = [pool.fill_(float("nan")) for pool in
              allocate_kv(num_blocks, block_size, kv_heads, dim, torch.bfloat16, "cpu", paired=True)]
    lens = [rng.randrange(1, context_blocks * block_size + 1) for _ in range(rows)]
    shared = rng.sample(range(num_blocks), 2)  # a prompt some rows share
    tables = []
    for n in lens:
        needed = -(-n // block_size)
        head = shared[:needed] if rng.random() < 0.5 else []
        tables.append(head + rng.sample([b for b in range(num_blocks) if b not in head], needed - len(head)))
    slots = torch.tensor(sorted({t[p // block_size] * block_size + p % block_size
                                 for t, n in zip(tables, lens) for p in range(n)}))
    k, v = (torch.randn(len(slots), kv_heads, dim).bfloat16() for _ in range(2))
    write_kv(*tokens, k, v, slots)
    write_kv(*paired, k, v, slots)
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(rows, kv_heads * group, dim).bfloat16()
    order = torch.tensor(sorted(range(rows), key=lambda r: tables[r]))
    return BothLayouts(tuple(tokens), tuple(paired), tables, lens, q, order, (padded, torch.tensor(lens), dim**-0.5))


@pytest.mark.skipif(not supports_tiles(64, torch.bfloat16, 16), reason="the tiles need a CPU with AMX (amx_bf16)")
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 12), kv_heads=st.sampled_from([1, 3]),
       group=st.sampled_from([1, 3, 5, 8, 16]), dim=st.sampled_from([32, 64, 128]), block_size=st.sampled_from([16, 32]),
       context_blocks=st.sampled_from([4, 20]))
def test_the_tiles_equal_plain_torch_and_never_read_unwritten_slots(seed, rows, kv_heads, group, dim, block_size,
                                                                     context_blocks):
    """The AMX task over paired pools whose unwritten slots hold NaN: plain torch's results (and
    the vector task's, up to the order of float32 sums and the bf16 rounding of probabilities
    scaled by a span's maximum rather than a tile's). Contexts of 20 blocks take several of the
    task's spans."""
    step = both_layouts(seed, rows, kv_heads, group, dim, block_size, context_blocks)
    out, lse = paged_decode_tiles_kernel()(step.q, *step.paired, *step.rows, True, step.order)
    want_out, want_lse = reference(step.q, *step.tokens, step.tables, step.lens, dim**-0.5)
    torch.testing.assert_close(out.float(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    vector, _ = paged_decode_kernel()(step.q, *step.paired, *step.rows, True, step.order)
    torch.testing.assert_close(out.float(), vector.float(), atol=8e-3, rtol=8e-3)


def test_the_paired_layout_is_refused_where_its_task_cannot_read_it():
    k, v = allocate_kv(4, 16, 2, 32, torch.float32, "cpu", paired=True)
    q, tables, lens = torch.randn(1, 4, 32), torch.tensor([[1]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="paired layout needs bfloat16"):
        paged_decode_kernel()(q, k, v, tables, lens, 0.1, False)
    with pytest.raises(RuntimeError, match="caches must be"):
        paged_decode_kernel()(q.bfloat16(), k.bfloat16(), k.bfloat16(), tables, lens, 0.1, False)
