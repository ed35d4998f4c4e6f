"""What every Triton kernel here shares: tile limits, dot precision, and the interpreter's
workaround.

``TRITON_INTERPRET=1`` runs the kernels on the CPU (the tests do, with tiny shapes). Two of its
bfloat16 operations differ from a GPU's (Triton 3.9), and the kernels work around both when
interpreted: ``tl.dot`` multiplies bf16 operands as their raw 16-bit integers (``mma`` gives it
float32 operands: the same products a GPU forms from bf16, exact in float32, and the same
float32 accumulation), and float32 -> bf16 truncates where a GPU rounds to nearest even
(``cast`` rounds first).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit at import, as here
MIN_TILE = 16  # tl.dot's smallest tile side


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots exact (IEEE), not TF32 as a GPU would default to; others in their own type."""
    return "ieee" if dtype == torch.float32 or INTERPRETED else "tf32"


def check_tiles(**sizes: int) -> None:
    """Raise ValueError unless each size is a power of two of at least ``MIN_TILE``."""
    for name, value in sizes.items():
        if value < MIN_TILE or value & (value - 1):
            raise ValueError(f"the Triton kernels need {name} a power of two >= {MIN_TILE}, got {value}")


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """``tl.dot(a, b)`` accumulated in float32; interpreted, on float32 operands (see the module docstring)."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``x`` in DTYPE, rounded to nearest even as a GPU rounds (also when interpreted)."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # exact in bf16 now: truncation keeps it
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
