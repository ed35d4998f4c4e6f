"""The Triton kernels' tests: on a CUDA device where there is one, else on the CPU under the
interpreter (``TRITON_INTERPRET=1``, set by the root conftest before any kernel is defined),
at tiny shapes: the interpreter runs each program in Python."""

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Kernel vs reference: float32 differs by summation order, bfloat16 by a rounding or two."""
    return {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
