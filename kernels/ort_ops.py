"""fleetserve's ONNX Runtime custom ops: ``fleetserve.BlockMatMul``, the CPU block kernel
(``csrc/block_matmul_cpu.cpp``) inside an ONNX graph.

ONNX Runtime's own 4-bit kernel (``MatMulNBits``) has no fast path for float activations on
x86 and costs nearly a forward per token when several tokens come at once (speculation's
verifications); it also takes a Q4_1 GGUF's minimums only through an offset term beside it.
``BlockMatMul`` multiplies by a GGUF's blocks as they are, ``w = scale * code + minimum``,
with the kernel edged's torch backend runs:

    inputs   A [..., K] float32; B uint8, MatMulNBits' packed blocks ([N, K / 32, 32 * bits / 8]:
             4-bit codes in consecutive pairs, low nibble first; 8-bit codes one per byte);
             scales and minimums float32, N * K / 32 each (row-major [N, K / 32])
    attrs    K, N, bits (4 or 8), bf16_products (0 or 1: the block kernel's products in
             bfloat16, ``kernels.block_matmul_cpu``; 1 fails the session on a CPU without
             AVX-512 BF16)
    output   Y [..., N] float32 = A @ W^T; up to 32 rows (a decode token and its drafts) by the
             block kernel, a row's result the same bit for bit whatever rows come with it; more
             (a prefill chunk) by the weight dequantized once and torch's float32 GEMM

Inputs that do not match (types, element counts, A's last dimension) fail the run with an
error naming them; nothing crashes. The ops live in a plain shared library (no Python module)
that ORT loads per session (``SessionOptions.register_custom_ops_library``), built by torch's
extension tooling like the other CPU kernels (and with them by ``make kernels``); it runs its
products on torch's intra-op threads. ``csrc/ort_abi.h`` says how it talks to ORT without its
headers.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from kernels.cpu_extension import build_from_csrc

DOMAIN = "fleetserve"
BLOCK_MATMUL = "BlockMatMul"
SOURCES = ("block_matmul_cpu.cpp", "ort_block_matmul.cpp")


@functools.cache
def ort_ops_library() -> Path | None:
    """The built library's path, or None where it cannot be built here (logged once)."""
    path = build_from_csrc("fleetserve_ort_ops", SOURCES, "fleetserve's ONNX Runtime ops",
                           "ONNX graphs keep MatMulNBits", python_module=False)
    return None if path is None else Path(path)


if __name__ == "__main__":
    began = time.perf_counter()
    library = ort_ops_library()
    print(f"ONNX Runtime ops: {library or 'UNAVAILABLE'} ({time.perf_counter() - began:.1f} s)")
    raise SystemExit(0 if library else 1)
