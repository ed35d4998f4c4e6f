"""The CPU paged decode kernel (``csrc/paged_decode_cpu.cpp``): each decode row's attention read
in place from the paged KV pools, one call per layer for every row.

It is C++ built on first use by torch's extension tooling (g++ and ninja, ``-O3 -march=native``)
into torch's extension cache, rebuilt when the source or flags change; ``python -m
kernels.paged_decode_cpu`` builds it ahead (``make`` does, so no request waits on a compiler).
Where it cannot be built, ``paged_decode_kernel()`` returns None (the reason logged once) and
the engine uses the plain-torch cascade path instead.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
SUPPORTED_HEAD_DIMS = frozenset({8, 16, 32, 64, 80, 96, 128})  # compiled instantiations
SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

# (q [R, H, D], k_cache, v_cache [N, B, KVH, D], block_tables [R, M] int64, context_lens [R] int64 (each >= 1),
#  scale, with_lse, row_order [R] int64 permutation or None) -> (out [R, H, D] in q's dtype, lse [R, H] float32,
#  or None when not asked)
PagedDecode = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@functools.cache
def paged_decode_kernel() -> PagedDecode | None:
    """The compiled kernel, or None where it cannot be built here (logged once)."""
    from torch.utils import cpp_extension

    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name="fleetserve_paged_decode_cpu",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        log.warning("CPU paged decode kernel unavailable, using the plain-torch path: %s", e)
        return None
    log.info("CPU paged decode kernel ready in %.1f s", time.perf_counter() - start)
    return module.paged_decode


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel is built here and compiled for this head size and dtype."""
    return head_dim in SUPPORTED_HEAD_DIMS and dtype in SUPPORTED_DTYPES and paged_decode_kernel() is not None


if __name__ == "__main__":
    began = time.perf_counter()
    kernel = paged_decode_kernel()
    print(f"CPU paged decode kernel: {'ready' if kernel else 'UNAVAILABLE'} ({time.perf_counter() - began:.1f} s)")
    raise SystemExit(0 if kernel else 1)
