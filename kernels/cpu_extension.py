"""The CPU kernels (``csrc/*.cpp``), one C++ extension module: paged decode attention
(``kernels.paged_decode_cpu``) and its paired KV layout's writes and gathers (``kernels.kv_layout``),
the softmax with log-sum-exp of the GEMM attention
(``kernels.softmax_lse_cpu``), each row's next token, greedy or drawn (``kernels.sample_cpu``), and
the block-quantized weights' matmul of edged's batch-1 forwards (``kernels.block_matmul_cpu``), and
the K-quant weights' few-row products on the AMX tiles or in AVX-512 BF16 vectors
(``kernels.tile_quant_matmul_cpu``), and the passes around the int8 products (``kernels.int8_linear``).

Built on first use by torch's extension tooling (g++ and ninja, ``-O3 -march=native``) into
torch's extension cache, rebuilt when a source or the flags change; ``python -m
kernels.cpu_extension`` builds it ahead (``make`` does, so no request waits on a compiler).
Where it cannot be built, ``cpu_kernels()`` returns None (the reason logged once) and every
caller takes its plain-torch path.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode_cpu.cpp", "kv_layout_cpu.cpp", "softmax_lse_cpu.cpp", "sample_cpu.cpp", "token_bitmask_cpu.cpp",
           "block_matmul_cpu.cpp", "block_layer_cpu.cpp", "tile_quant_matmul_cpu.cpp", "int8_rows_cpu.cpp",
           "bindings.cpp")


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None where it cannot be built here (logged once)."""
    return build_from_csrc("fleetserve_cpu_kernels", SOURCES, "CPU kernels", "using the plain-torch paths")


def build_from_csrc(name: str, sources: tuple[str, ...], what: str, fallback: str,
                    python_module: bool = True) -> Any | None:
    """``csrc/<sources>`` built by torch's extension tooling into its cache (rebuilt when a
    source or the flags change): the loaded module, or with ``python_module`` false the path of
    a plain shared library (loaded into this process too). None where it cannot be built here;
    the reason is logged as ``what`` unavailable, ``fallback``."""
    from torch.utils import cpp_extension

    start = time.perf_counter()
    try:
        # -fno-trapping-math: no kernel reads floating-point exception flags, and with them in
        # play GCC leaves the clamped exp loops scalar (the float32 softmax_lse_ 3-4x slower)
        built = cpp_extension.load(
            name=name,
            sources=[str(CSRC / source) for source in sources],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            is_python_module=python_module,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the callers' other paths still work
        log.warning("%s unavailable, %s: %s", what, fallback, e)
        return None
    log.info("%s ready in %.1f s", what, time.perf_counter() - start)
    return built


if __name__ == "__main__":
    began = time.perf_counter()
    module = cpu_kernels()
    print(f"CPU kernels: {'ready' if module else 'UNAVAILABLE'} ({time.perf_counter() - began:.1f} s)")
    raise SystemExit(0 if module else 1)
