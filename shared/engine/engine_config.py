"""Engine settings: KV pool geometry, prefix index, dtype, scheduler limits, KV tiers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.scheduler import SchedulerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 2048  # KV pool size in blocks, including the reserved null block
    prefix_index: str = "radix"  # "radix" (token-exact) | "hashed" (vLLM-style full blocks)
    dtype: str = "float32"  # weights, activations and KV
    jump_forward: bool = True  # draft the tokens a grammar forces and verify them in one step
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)  # host/disk KV tiers

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.prefix_index not in ("radix", "hashed"):
            raise ValueError(f"prefix_index must be 'radix' or 'hashed', got {self.prefix_index!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.hicache.enabled and self.prefix_index != "radix":
            raise ValueError(f"hicache needs prefix_index 'radix', got {self.prefix_index!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
