"""Engine settings: device, KV pool geometry, prefix index, dtype, scheduler limits, KV tiers.

``device`` is where the model, its KV pool and every per-step tensor live: "cpu" (the default)
or "cuda" / "cuda:N" (the ``[engine] device`` key of a daemon's TOML). Sampling and grammar
masks always run on the CPU (see ``ModelRunner.execute``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from kernels.kv_layout import LAYOUTS
from shared.engine.dtype_choice import DTYPE_NAMES, DtypeChoice, resolve_dtype
from shared.engine.kernel_choice import KernelSpec, resolve_kernels
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 2048  # KV pool size in blocks, including the reserved null block
    prefix_index: str = "radix"  # "radix" (token-exact) | "hashed" (vLLM-style full blocks)
    dtype: str = "auto"  # weights, activations and KV: "auto" (see dtype_choice) | DTYPE_NAMES
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N": model, KV pool and step tensors
    jump_forward: bool = True  # draft the tokens a grammar forces and verify them in one step
    # The layers' dense halves through torch.compile at start-up (LlamaModel.compile_layers):
    # cloudd's config and command line turn it on; off here, so a library user or a test pays
    # no compile.
    compile: bool = False
    # "auto" | "triton" | "torch", then any operation=implementation items that force one
    # (shared.engine.kernel_choice): auto is Triton on CUDA; "auto,dense=packed"
    kernels: str = "auto"
    # On a CPU, time each operation's implementations on the model at start-up and keep the
    # fastest (cached per CPU and model): cloudd's config and command line turn it on; off here,
    # so a library user's or a test's kernels never depend on timings (each unforced operation
    # then runs its first implementation, shared.engine.kernel_choice.OPERATIONS)
    time_kernels: bool = False
    # Decode-only steps replay CUDA graphs, one per batch-size bucket (shared.engine.decode_graphs);
    # only with the Triton kernels on CUDA, ignored elsewhere
    cuda_graphs: bool = True
    # KV pool layout (kernels.kv_layout): "auto" (paired where the CPU decode kernel reads it in
    # bf16: no transposes on its reads) | "tokens" | "paired"
    kv_layout: str = "auto"
    # Grammar compiles run in this many worker processes (shared.engine.grammar.compile_pool);
    # at the lowest CPU priority; one past grammar_compile_timeout_s of CPU time (or ten times it in
    # wall time) is killed and its request ends with an error naming it
    grammar_compile_workers: int = 2
    grammar_compile_timeout_s: float = 60.0
    # A request whose own grammar and detokenizer work in one step passes this ends alone with
    # an error naming the budget (shared.engine.request_budget)
    request_step_budget_s: float = 0.25
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)  # host/disk KV tiers

    def __post_init__(self) -> None:
        _check_device(self.device)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.prefix_index not in ("radix", "hashed"):
            raise ValueError(f"prefix_index must be 'radix' or 'hashed', got {self.prefix_index!r}")
        KernelSpec.parse(self.kernels)  # ValueError naming the problem
        if self.kv_layout not in LAYOUTS:
            raise ValueError(f"kv_layout must be one of {list(LAYOUTS)}, got {self.kv_layout!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.grammar_compile_workers < 1:
            raise ValueError(f"grammar_compile_workers must be >= 1, got {self.grammar_compile_workers}")
        for name in ("grammar_compile_timeout_s", "request_step_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hicache.enabled and self.prefix_index != "radix":
            raise ValueError(f"hicache needs prefix_index 'radix', got {self.prefix_index!r}")

    @property
    def dtype_choice(self) -> DtypeChoice:
        """``dtype`` resolved for ``device`` ("auto": bf16 where the hardware has it natively)."""
        return resolve_dtype(self.dtype, self.device)

    @property
    def kernel_choice(self) -> str:
        """``kernels`` resolved for ``device``: "triton" or "torch" (ValueError where Triton cannot run)."""
        return resolve_kernels(self.kernels, self.device)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.cuda_graphs and self.device.startswith("cuda") and self.kernel_choice == "triton"

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype_choice.dtype


def _check_device(device: str) -> None:
    """Raise ValueError unless ``device`` is "cpu", or "cuda" / "cuda:N" naming a CUDA device
    this process can use."""
    if device == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch finds no CUDA device "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} asked for, but there are {torch.cuda.device_count()} CUDA devices")
