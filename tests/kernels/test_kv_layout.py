"""Both KV pool layouts against a naive model of a pool (a dict from slot to its K and V rows):
writes at slots, slot copies and gathers of block tables read back what was written, in the
tokens layout's order, through the CPU extension and through the plain-torch twins; the paired
layout's bytes sit where its decode kernel reads them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import kv_layout
from kernels.cpu_extension import cpu_kernels
from kernels.kv_layout import allocate_kv, copy_slots, gather, is_paired, kv_heads_of, write_kv

PATHS = ["extension", "torch"] if cpu_kernels() is not None else ["torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The paired layout's writes and gathers through the CPU extension or the plain-torch twins."""
    if request.param == "torch":
        monkeypatch.setattr(kv_layout, "_native", lambda cache: None)
    return request.param


# the fixture's choice holds for every example of a test
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), paired=st.booleans(), block_size=st.sampled_from([2, 4, 16]),
       kv_heads=st.sampled_from([1, 3]), dim=st.sampled_from([2, 8, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_writes_copies_and_gathers_match_a_dict_of_slots(path, data, paired, block_size, kv_heads, dim, dtype):
    num_blocks = 6
    k_cache, v_cache = allocate_kv(num_blocks, block_size, kv_heads, dim, dtype, "cpu", paired)
    assert is_paired(k_cache) == paired and kv_heads_of(k_cache) == kv_heads == kv_heads_of(v_cache)
    model = {s: (torch.zeros(kv_heads, dim, dtype=dtype),) * 2 for s in range(num_blocks * block_size)}
    for _ in range(data.draw(st.integers(1, 3))):  # steps: writes, then a copy-on-write
        slots = data.draw(st.lists(st.integers(0, num_blocks * block_size - 1), min_size=1, max_size=12, unique=True))
        k, v = (torch.randn(len(slots), kv_heads, dim).to(dtype) for _ in range(2))
        write_kv(k_cache, v_cache, k, v, torch.tensor(slots))
        model.update({s: (k[i], v[i]) for i, s in enumerate(slots)})
        src = data.draw(st.lists(st.integers(0, num_blocks * block_size - 1), max_size=4))
        dst = data.draw(st.lists(st.integers(0, num_blocks * block_size - 1), min_size=len(src), max_size=len(src),
                                 unique=True))
        if src:
            copy_slots(k_cache, True, torch.tensor(src), torch.tensor(dst))
            copy_slots(v_cache, False, torch.tensor(src), torch.tensor(dst))
            model.update({d: model[s] for s, d in zip(src, dst)})  # all read before any is written
    table = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, num_blocks - 1), min_size=3, max_size=3),
                                            min_size=1, max_size=3)))
    keys, values = gather(k_cache, True, table), gather(v_cache, False, table)
    assert keys.shape == values.shape == (len(table), 3 * block_size, kv_heads, dim) and keys.is_contiguous()
    for r, blocks in enumerate(table.tolist()):
        for p in range(3 * block_size):
            slot = blocks[p // block_size] * block_size + p % block_size
            assert torch.equal(keys[r, p], model[slot][0]) and torch.equal(values[r, p], model[slot][1])


def test_paired_slabs_hold_the_decode_kernels_operands(path):
    """Block 1, KV head 0: K's row i is dimension pair i of the block's keys in key order, V's
    row j the values of keys 2j and 2j + 1 interleaved by dimension (kernels/csrc/paged_decode_cpu.cpp)."""
    k_cache, v_cache = allocate_kv(2, 4, 1, 4, torch.float32, "cpu", paired=True)
    k = torch.arange(16.0).view(4, 1, 4)  # key t's dimension d: 4 t + d
    write_kv(k_cache, v_cache, k, -k, torch.tensor([4, 5, 6, 7]))
    assert k_cache[1, 0].tolist() == [[[0, 1], [4, 5], [8, 9], [12, 13]], [[2, 3], [6, 7], [10, 11], [14, 15]]]
    assert v_cache[1, 0].tolist() == [[[0, -4], [-1, -5], [-2, -6], [-3, -7]], [[-8, -12], [-9, -13], [-10, -14],
                                                                                [-11, -15]]]
    assert not k_cache[0].any() and not v_cache[0].any()


def test_an_odd_paired_geometry_is_refused():
    with pytest.raises(ValueError, match="even block_size and head_dim"):
        allocate_kv(2, 3, 1, 4, torch.float32, "cpu", paired=True)


@pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the torch twins run")
def test_the_extension_refuses_slots_and_blocks_outside_the_pool():
    k_cache, v_cache = allocate_kv(2, 4, 1, 4, torch.bfloat16, "cpu", paired=True)
    k = torch.ones(1, 1, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 8 is outside the pool"):
        write_kv(k_cache, v_cache, k, k, torch.tensor([8]))
    with pytest.raises(RuntimeError, match="block 2 is outside the pool"):
        gather(k_cache, True, torch.tensor([[0, 2]]))
    assert not k_cache.any() and not v_cache.any()
