"""dtype "auto": bf16 where the hardware computes it natively, float32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from shared.engine import dtype_choice
from shared.engine.dtype_choice import cpu_bf16_flags, resolve_dtype
from shared.engine.engine_config import EngineConfig

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n"


@pytest.mark.parametrize("cpuinfo, flags", [(AVX2_ONLY, ()), (AVX512_BF16, ("avx512_bf16",)), (AMX, ("amx_bf16",))])
def test_cpu_flags_read_from_cpuinfo(tmp_path, cpuinfo, flags):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert cpu_bf16_flags(path) == flags


def test_unreadable_cpuinfo_means_no_native_bf16(tmp_path):
    assert cpu_bf16_flags(tmp_path / "missing") == ()


@pytest.mark.parametrize("flags, expected", [((), torch.float32), (("avx512_bf16",), torch.bfloat16)])
def test_auto_on_cpu_follows_the_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(dtype_choice, "cpu_bf16_flags", lambda: flags)
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == expected and choice.reason.startswith("auto")


def test_auto_on_cuda_is_bf16_and_a_name_is_taken_as_configured(monkeypatch):
    monkeypatch.setattr(dtype_choice, "cpu_bf16_flags", lambda: ())
    assert resolve_dtype("auto", "cuda:1").dtype == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == dtype_choice.DtypeChoice(torch.bfloat16, "configured")
    assert resolve_dtype("float32", "cpu").name == "float32"


def test_engine_config_defaults_to_auto_and_rejects_unknown_names():
    assert EngineConfig().dtype == "auto"
    assert EngineConfig(dtype="float32").torch_dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
