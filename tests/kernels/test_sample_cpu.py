"""The CPU sampling kernel against its contract and the plain-torch reference: greedy rows take
the first of their largest values, sampled rows the token whose slice of the CDF holds ``u``,
never a masked one, in every dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.cpu_extension import cpu_kernels
from kernels.sample_cpu import sample_rows, sample_rows_reference

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler: the torch reference runs instead")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def greedy(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows), torch.zeros(rows)


# NOTE: few distinct values make ties common; lengths around multiples of 64 take the masked tails
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9), n=st.integers(1, 140), levels=st.sampled_from([3, 1000]),
       dtype=st.sampled_from(DTYPES))
def test_a_greedy_row_takes_the_first_of_its_largest_values(seed, rows, n, levels, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, levels, (rows, n), generator=g) - levels // 2).to(dtype)
    x[torch.rand(rows, n, generator=g) < 0.1] = float("-inf")  # grammar-masked logits
    want = torch.tensor([int((row == row.max()).nonzero()[0]) for row in x.float()])
    assert torch.equal(sample_rows(x, *greedy(rows)), want)
    assert torch.equal(sample_rows_reference(x, *greedy(rows)), want)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), n=st.integers(1, 300),
       temperature=st.sampled_from([0.3, 1.0, 2.5]), dtype=st.sampled_from(DTYPES))
def test_a_sampled_row_draws_the_token_whose_cdf_slice_holds_u(seed, rows, n, temperature, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    masked = torch.rand(rows, n, generator=g) < 0.3
    masked[:, 0] = False  # every row keeps a token
    x[masked] = float("-inf")
    u = torch.rand(rows, generator=g)
    picks = sample_rows(x, torch.full((rows,), temperature), u)
    probs = torch.softmax(x.double() / temperature, -1)
    cdf = probs.cumsum(-1)
    for r, j in enumerate(picks.tolist()):
        assert not masked[r, j]
        below = cdf[r, j - 1].item() if j else 0.0
        assert below - 1e-4 <= u[r].item() <= cdf[r, j].item() + 1e-4  # u's slice, up to float32 sums
    agree = picks == sample_rows_reference(x, torch.full((rows,), temperature), u)
    assert agree.float().mean() >= 0.5  # the reference differs only within rounding of a boundary


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_ends_of_the_cdf_give_the_first_and_last_tokens_with_weight(dtype):
    x = torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf"), 0.5, float("-inf")]] * 2).to(dtype)
    u = torch.tensor([0.0, 1.0 - 2**-24])
    assert sample_rows(x, torch.ones(2), u).tolist() == [1, 4]


def test_greedy_and_sampled_rows_share_one_call():
    x = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0], [3.0, 3.0, -1.0]])
    picks = sample_rows(x, torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.9, 0.5, 0.9]))
    assert picks.tolist() == [1, 1, 0]  # u = 0.5 of three equal weights lands in the second


def test_a_tiny_temperature_draws_the_top_token_without_nan():
    x = torch.tensor([[0.0, 2.0, 1.99, -5.0]]).bfloat16()
    for u in (0.0, 0.5, 0.999):
        assert sample_rows(x, torch.tensor([1e-5]), torch.tensor([u])).tolist() == [1]


def test_a_row_with_no_finite_value_gives_token_zero():
    x = torch.full((2, 5), float("-inf"))
    temps = torch.tensor([0.0, 1.0])
    assert sample_rows(x, temps, torch.tensor([0.3, 0.3])).tolist() == [0, 0]
    assert sample_rows_reference(x, temps, torch.tensor([0.3, 0.3])).tolist() == [0, 0]


@pytest.mark.parametrize(
    "x, temps, uniforms, match",
    [
        (torch.zeros(3), torch.zeros(3), torch.zeros(3), r"\[rows, n\]"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2), torch.zeros(2), "dtype"),
        (torch.zeros(2, 3), torch.zeros(3), torch.zeros(2), "float32 \\[rows\\]"),
        (torch.zeros(1, 3), torch.tensor([-1.0]), torch.zeros(1), "temperature"),
        (torch.zeros(1, 3), torch.tensor([1e-45]), torch.zeros(1), "temperature"),
        (torch.zeros(1, 3), torch.ones(1), torch.ones(1), "uniform"),
    ],
    ids=["1-d", "int32", "rows", "negative-temperature", "no-finite-inverse", "u=1"],
)
def test_bad_input_is_refused(x, temps, uniforms, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_kernels().sample_rows(x, temps, uniforms)
