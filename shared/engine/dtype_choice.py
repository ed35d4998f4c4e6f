"""Which floating-point type the engine computes in: a name from the config, "auto" resolved for
the device it runs on.

``auto`` picks bfloat16 where the hardware computes it natively (a CUDA device; a CPU with
AVX-512 BF16 or AMX, where oneDNN's bf16 GEMMs run about 4x the fp32 rate) and float32
elsewhere: on a CPU without them bf16 is emulated and slower than fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # why, in words: "configured" or what "auto" saw

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_dtype(name: str, device: str) -> DtypeChoice:
    """``name`` ("auto" or a key of ``DTYPES``, checked by the caller) as a torch dtype for
    ``device`` ("cpu", "cuda", "cuda:N")."""
    if name != "auto":
        return DtypeChoice(DTYPES[name], "configured")
    if device.startswith("cuda"):
        return DtypeChoice(torch.bfloat16, "auto: CUDA device")
    flags = cpu_bf16_flags()
    if flags:
        return DtypeChoice(torch.bfloat16, f"auto: CPU has {', '.join(flags)}")
    return DtypeChoice(torch.float32, "auto: CPU has no AVX-512 BF16 or AMX (bf16 would be emulated)")


@dataclass(frozen=True)
class CpuInfo:
    """What ``/proc/cpuinfo`` says of the first CPU: its model name and instruction-set flags
    (empty where the file is unreadable, e.g. not Linux)."""

    model_name: str
    flags: frozenset[str]


@cache
def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return CpuInfo("", frozenset())

    def field(name: str) -> str:
        return next((line.partition(":")[2] for line in lines if line.startswith(name)), "")

    return CpuInfo(field("model name").strip(), frozenset(field("flags").split()))


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The native-bf16 instruction sets this CPU reports (empty where it reports none or the
    file is unreadable, e.g. not Linux)."""
    flags = cpu_info(cpuinfo).flags
    return tuple(f for f in _BF16_CPU_FLAGS if f in flags)
