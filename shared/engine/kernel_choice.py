"""Which kernels a step runs on (``[engine] kernels``), resolved for the device.

- ``triton``: the Triton kernels (``kernels.triton_attention``, ``kernels.triton_layers``): paged
  decode and extend attention, rotary fused with the KV write, RMSNorm fused with the residual
  add. A GPU's path; on a CPU only under ``TRITON_INTERPRET=1`` (the interpreter: for tests,
  about a thousand times slower than a GPU).
- ``torch``: plain torch (``kernels.attention``: the shared-prefix cascade of batched GEMMs),
  calling the C++ CPU kernels where they build on a CPU. The reference the Triton path is
  checked against, and the CPU's fast path.
- ``auto`` (the default): ``triton`` on CUDA, ``torch`` on a CPU.
"""

from __future__ import annotations

import os

KERNEL_NAMES = ("auto", "triton", "torch")


def resolve_kernels(name: str, device: str) -> str:
    """"triton" or "torch" for ``name`` on ``device`` ("cpu", "cuda", "cuda:N"). ValueError for an
    unknown name, or "triton" on a CPU without the interpreter."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"kernels must be one of {list(KERNEL_NAMES)}, got {name!r}")
    on_gpu = device.startswith("cuda")
    if name == "auto":
        return "triton" if on_gpu else "torch"
    if name == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels = 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to interpret them on "
                         "the CPU, for tests: about a thousand times slower)")
    return name
