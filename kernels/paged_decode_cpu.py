"""The CPU paged decode kernel (``csrc/paged_decode_cpu.cpp``, built with the other CPU kernels
by ``kernels.cpu_extension``): each decode row's attention read in place from the paged KV
pools, one call per layer for every row. Where the extension cannot be built,
``paged_decode_kernel()`` returns None and the engine uses the plain-torch cascade path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu_extension import cpu_kernels

SUPPORTED_HEAD_DIMS = frozenset({8, 16, 32, 64, 80, 96, 128})  # compiled instantiations
SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

# (q [R, H, D], k_cache, v_cache (either layout of kernels.kv_layout), block_tables [R, M] int64, context_lens [R] int64 (each >= 1),
#  scale, with_lse, row_order [R] int64 permutation or None) -> (out [R, H, D] in q's dtype, lse [R, H] float32,
#  or None when not asked)
PagedDecode = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def paged_decode_kernel() -> PagedDecode | None:
    """The compiled kernel, or None where the CPU extension cannot be built here."""
    module = cpu_kernels()
    return None if module is None else module.paged_decode


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel is built here and compiled for this head size and dtype."""
    return head_dim in SUPPORTED_HEAD_DIMS and dtype in SUPPORTED_DTYPES and paged_decode_kernel() is not None


def supports_paired(head_dim: int, dtype: torch.dtype, block_size: int) -> bool:
    """Whether the kernel reads the paired KV layout here: bfloat16 on a CPU with AVX-512 BF16
    (what the build found), 16-key tiles within a block, 32-dimension chunks of a head."""
    module = cpu_kernels()
    return (module is not None and module.paired_kv_layout_built() and dtype == torch.bfloat16
            and block_size % 16 == 0 and block_size <= 64 and head_dim % 32 == 0 and head_dim <= 128)


def paged_decode_tiles_kernel() -> PagedDecode | None:
    """The kernel on the AMX tiles (the paired layout only; same arguments and results), or None
    where this build or CPU has no tiles (or the OS did not grant them)."""
    module = cpu_kernels()
    return module.paged_decode_tiles if module is not None and module.amx_tiles_usable() else None


def supports_tiles(head_dim: int, dtype: torch.dtype, block_size: int) -> bool:
    """Whether the kernel runs on the AMX tiles here: the paired layout (``supports_paired``) on
    a CPU with AMX, whose tile state the OS granted."""
    return supports_paired(head_dim, dtype, block_size) and paged_decode_tiles_kernel() is not None
