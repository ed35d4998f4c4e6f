"""Where engine steps spend their time, and how much of the machine's matmul peak the model reaches.

An ``Engine`` with a ``StepProfile`` (``Engine.enable_profile``) times each phase of every step
with the wall clock (CPU ops are synchronous; on a GPU the phases that launch kernels are
timed up to the logits' copy back, which waits for them):

    | schedule | metadata | model (minus attention) | attention | logits | sampling | update | detokenize |

``metadata`` is the runner's host work turning the scheduler's plain ints into tensors; with
``schedule``, ``sampling``, ``update`` and ``detokenize`` it is the step's host time. The model's
work is counted as FLOPs: 2 x (non-embedding parameters) per computed token, 4 x heads x
head_dim x context per query token for attention, 2 x hidden x vocab per logits row.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from shared.model.llama import AttentionStep

PHASES = ("schedule", "metadata", "model", "attention", "logits", "sampling", "update", "detokenize")
HOST_PHASES = ("schedule", "metadata", "sampling", "update", "detokenize")


@dataclass
class StepProfile:
    """Seconds per phase and model FLOPs, summed over the profiled steps."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    flops: float = 0.0
    computed_tokens: int = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def report(self, peak_flops: float | None = None) -> dict:
        """Plain data: per-phase seconds per step and shares, host ms per step, achieved GFLOP/s
        (over the step time) and, given the machine's matmul peak, the fraction of it."""
        total = sum(self.seconds.values())
        steps = max(self.steps, 1)
        out = {
            "steps": self.steps,
            "computed_tokens": self.computed_tokens,
            "ms_per_step": {k: 1000 * v / steps for k, v in self.seconds.items()},
            "share": {k: v / total if total else 0.0 for k, v in self.seconds.items()},
            "host_ms_per_step": 1000 * sum(self.seconds[k] for k in HOST_PHASES) / steps,
            "model_gflops": self.flops / 1e9,
            "achieved_gflop_s": self.flops / total / 1e9 if total else 0.0,
        }
        if peak_flops:
            out["peak_gflop_s"] = peak_flops / 1e9
            out["peak_frac"] = out["achieved_gflop_s"] / out["peak_gflop_s"]
        return out


def maybe_phase(profile: StepProfile | None, name: str) -> contextlib.AbstractContextManager:
    """``profile.phase(name)``, or a no-op when not profiling."""
    return profile.phase(name) if profile is not None else contextlib.nullcontext()


def timed_phase(name: str) -> Callable[[Callable], Callable]:
    """Decorate a method of an object with a ``profile: StepProfile | None`` (the engine, its
    sampling and delivery): while it is profiling, each call's time counts into phase ``name``."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            if self.profile is None:  # NOTE: not profiling: no context manager on the step's path
                return method(self, *args, **kwargs)
            with self.profile.phase(name):
                return method(self, *args, **kwargs)

        return timed

    return decorate


@dataclass(frozen=True)
class TimedAttentionStep:
    """An ``AttentionStep`` whose every layer's attention counts into ``profile``'s attention phase."""

    step: AttentionStep
    profile: StepProfile

    def attend(self, layer, q, k, v, kv_cache, scale: float, rope=None) -> torch.Tensor:
        with self.profile.phase("attention"):
            return self.step.attend(layer, q, k, v, kv_cache, scale, rope)


def matmul_peak_flops(dtype: torch.dtype, device: torch.device | str = "cpu", n: int = 2048, reps: int = 5) -> float:
    """This machine's matmul rate in ``dtype``: the best of ``reps`` timed ``n x n`` products."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up: oneDNN primitive creation, page faults
    best = float("inf")
    for _ in range(reps):
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        start = time.perf_counter()
        torch.mm(a, b)
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
