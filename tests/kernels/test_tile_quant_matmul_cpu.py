"""The K-quant codes' kernel (``kernels.tile_quant_matmul_cpu``) against plain torch over the
dequantized weight, at random shapes, on each path this CPU runs (the AMX tiles, AVX-512 BF16
vectors); a row's result whatever rows come with it; bad weights refused. A path this CPU or
build lacks is skipped, with the reason."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.tile_quant_matmul_cpu import (CODE_LIMITS, PATHS, GroupScales, TileQuantWeight, max_rows,
                                          tile_quant_matmul, tile_quant_paths)

NEEDS = {"tiles": "a CPU with AMX (amx_bf16)", "vectors": "a CPU with AVX-512 BF16 (avx512_bf16)"}
each_path = pytest.mark.parametrize("path", [
    pytest.param(path, marks=pytest.mark.skipif(path not in tile_quant_paths(), reason=f"this path needs {NEEDS[path]}"))
    for path in PATHS])


def random_weight(n: int, k: int, bits: int, group: int, generator: torch.Generator) -> TileQuantWeight:
    codes = torch.randint(0, CODE_LIMITS[bits], (n, k), generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.02
    minimums = -torch.rand(n, k // group, generator=generator) * 0.1
    return TileQuantWeight.from_codes(codes, scales, minimums, bits, group)


@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([16, 32]), blocks=st.integers(1, 4),
       col_tiles=st.integers(1, 5), seed=st.integers(0, 99))
def test_the_weight_is_its_codes_times_scales_plus_minimums(bits, group, blocks, col_tiles, seed):
    generator = torch.Generator().manual_seed(seed)
    n, k = 16 * blocks, 32 * col_tiles
    codes = torch.randint(0, CODE_LIMITS[bits], (n, k), generator=generator)
    scales, minimums = torch.rand(n, k // group, generator=generator), torch.randn(n, k // group, generator=generator)
    weight = TileQuantWeight.from_codes(codes, scales, minimums, bits, group)
    want = codes.double() * scales.double().repeat_interleave(group, 1) + minimums.double().repeat_interleave(group, 1)
    assert weight.shape == (n, k)
    torch.testing.assert_close(weight.dequantize().double(), want, rtol=1e-6, atol=1e-6)


@each_path
@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([16, 32]), rows=st.integers(1, 40), blocks=st.integers(1, 5),
       col_tiles=st.integers(1, 5), bias=st.booleans(), seed=st.integers(0, 99))
def test_the_product_is_the_dequantized_weights(path, bits, group, rows, blocks, col_tiles, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = random_weight(16 * blocks, 32 * col_tiles, bits, group, generator)
    x = torch.randn(rows, 32 * col_tiles, generator=generator).bfloat16()
    b = torch.randn(16 * blocks, generator=generator).bfloat16() if bias else None
    got = tile_quant_matmul(x, weight, b, path)
    want = x.double() @ weight.dequantize().double().t() + (0 if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # the output rounded to bf16, float32 sums of exact bf16 x times the exact weights
    assert (got.double() - want).abs().max() <= 2 ** -8 * want.abs().max().item() + 1e-3


@each_path
@settings(max_examples=20, deadline=None)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([16, 32]), per_super=st.sampled_from([1, 2, 8]),
       rows=st.integers(1, 20), seed=st.integers(0, 99))
def test_factored_scales_are_their_products(path, bits, group, per_super, rows, seed):
    """K-quants' form: an int8 factor per group times a float32 per super-group of columns."""
    generator = torch.Generator().manual_seed(seed)
    n, supers = 32, 2
    k = group * per_super * supers
    if k % 32:
        return
    codes = torch.randint(0, CODE_LIMITS[bits], (n, k), generator=generator)
    factors = [torch.randint(-64, 64, (n, k // group), generator=generator).to(torch.int8) for _ in range(2)]
    supers_ = [torch.rand(n, supers, generator=generator) * 1e-3 for _ in range(2)]
    scales = GroupScales(*factors, *supers_, super_columns=group * per_super)
    weight = TileQuantWeight.from_codes(codes, scales, None, bits, group)
    floats = TileQuantWeight.from_codes(codes, *scales.values(group), bits, group)
    torch.testing.assert_close(weight.dequantize(), floats.dequantize(), rtol=1e-6, atol=1e-9)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    want = x.double() @ floats.dequantize().double().t()
    assert (tile_quant_matmul(x, weight, path=path).double() - want).abs().max() <= 2 ** -8 * want.abs().max().item() + 1e-4


@each_path
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(path):
    generator = torch.Generator().manual_seed(5)
    weight = random_weight(64, 160, 4, 32, generator)
    x = torch.randn(21, 160, generator=generator).bfloat16()
    together = tile_quant_matmul(x, weight, path=path)
    for row in (0, 7, 8, 16, 20):
        assert torch.equal(tile_quant_matmul(x[row:row + 1], weight, path=path)[0], together[row])


def test_a_path_that_does_not_run_here_is_refused():
    weight = random_weight(16, 32, 4, 32, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="does not run here"):
        tile_quant_matmul(torch.zeros(1, 32, dtype=torch.bfloat16), weight, path="registers")


def test_the_row_limit_is_the_default_paths():
    paths = tile_quant_paths()
    assert max_rows() == (0 if not paths else 16 if paths[0] == "tiles" else 8)


@pytest.mark.parametrize("codes, scales, bits, group, problem", [
    (torch.zeros(8, 32, dtype=torch.int64), torch.zeros(8, 1), 4, 32, "N % 16"),  # too few rows
    (torch.zeros(16, 48, dtype=torch.int64), torch.zeros(16, 3), 4, 16, "K % 32"),
    (torch.full((16, 32), 16), torch.zeros(16, 1), 4, 32, "4-bit codes"),
    (torch.full((16, 32), 128), torch.zeros(16, 2), 8, 16, "8-bit codes"),  # 128 + 128 is no exact bf16
    (torch.zeros(16, 32, dtype=torch.int64), torch.zeros(16, 1), 6, 32, "bits"),
    (torch.zeros(16, 32, dtype=torch.int64), torch.zeros(16, 2), 4, 32, "scales/minimums"),
])
def test_a_weight_the_kernel_cannot_read_is_refused(codes, scales, bits, group, problem):
    with pytest.raises(ValueError, match=problem.split("/")[0].split(" %")[0]):
        TileQuantWeight.from_codes(codes, scales, scales, bits, group)
