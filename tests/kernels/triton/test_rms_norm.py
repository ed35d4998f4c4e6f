"""RMSNorm with the fused residual add (kernels.triton_rms_norm) against the model's own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.triton_rms_norm import add_rms_norm, reference_add_rms_norm
from tests.kernels.triton.conftest import tolerance


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), hidden=st.sampled_from([16, 48, 96]),
       with_residual=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_add_rms_norm_equals_the_models(device, seed, rows, hidden, with_residual, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(device)
    weight = torch.randn(hidden, generator=g).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=g).to(dtype).to(device) if with_residual else None
    normed, total = add_rms_norm(x, weight, 1e-5, residual)
    ref_normed, ref_total = reference_add_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(total.cpu(), ref_total.cpu())  # the add rounds as the model's does
    torch.testing.assert_close(normed.float().cpu(), ref_normed.float().cpu(), **tolerance(dtype))
    if dtype != torch.float32:  # HF's roundings: bit for bit but for a rare last-bit rsqrt difference on a GPU
        assert (normed != ref_normed).float().mean() <= 0.01


def test_without_a_residual_the_input_is_the_sum(device):
    x = torch.randn(2, 16, device=device)
    _, total = add_rms_norm(x, torch.ones(16, device=device), 1e-6)
    assert total is x


@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_the_norm_is_scale_free(device, scale):
    x = torch.randn(3, 48, device=device)
    a, _ = add_rms_norm(x, torch.ones(48, device=device), 0.0)
    b, _ = add_rms_norm(x * scale, torch.ones(48, device=device), 0.0)
    torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-5, rtol=1e-4)
