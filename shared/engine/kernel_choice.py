"""Which kernels a step runs on (``[engine] kernels``), resolved for the device, and on a CPU
which implementation of each hot operation, chosen by timing them on the model's shapes.

The backend, the first item of ``kernels``:

- ``triton``: the Triton kernels (``kernels.triton_attention``, ``kernels.triton_layers``): paged
  decode and extend attention, rotary fused with the KV write, RMSNorm fused with the residual
  add. A GPU's path; on a CPU only under ``TRITON_INTERPRET=1`` (the interpreter: for tests,
  about a thousand times slower than a GPU).
- ``torch``: plain torch and the library kernels under it, calling the C++ CPU kernels where they
  build on a CPU. The reference the Triton path is checked against, and the CPU's path.
- ``auto`` (the default): ``triton`` on CUDA, ``torch`` on a CPU.

On a CPU, CPUs disagree about which implementation of an operation is fastest (an AMD EPYC with
AVX-512 BF16 runs our C++ vector kernels well; an Intel Xeon with AMX has its speed in the
matrix tiles that oneDNN's GEMMs use and our vector code does not), so each operation of
``OPERATIONS`` with more than one implementation here is timed at start-up on the model's real
shapes (``shared.engine.kernel_timing``) and the fastest kept. The choice is cached per CPU
signature and model shape (``ChoiceCache``), printed at start-up and reported in ``stats``.
Later items of ``kernels`` force an operation: ``"auto,dense=packed"``, ``"torch,prefill_attention=gemm"``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

KERNEL_NAMES = ("auto", "triton", "torch")

# operation -> its implementations on the CPU torch backend, in the order ties go
OPERATIONS: dict[str, tuple[str, ...]] = {
    # the layers' projections: torch's linear (oneDNN reorders the weight on every call),
    # oneDNN with every weight packed once at start-up (kernels.onednn_linear), or int8 codes
    # with activations quantized per token (kernels.int8_linear; forced only: OPT_IN)
    "dense": ("linear", "packed", "int8"),
    # the LM head: torch's linear over vocabulary slices, or the slices packed once (extra memory:
    # the head's size again; kernels.onednn_linear.PackedHead)
    "head": ("linear", "packed"),
    # decode rows' attention: the C++ in-place paged kernel (kernels.paged_decode_cpu, vector
    # code), the same kernel on the AMX tiles (the paired layout on a Xeon with AMX), or the
    # cascade of batched GEMMs over gathered blocks (kernels.attention)
    "decode_attention": ("rows", "tiles", "cascade"),
    # prefill chunks' attention over their cached context: rows of the C++ in-place paged kernel
    # (kernels.paged_decode_cpu, vector code; the step's decode rows then run in the same call),
    # the same on the AMX tiles, or per-chunk GEMMs on the library's matmul (AMX where the CPU
    # has it) around the C++ softmax (kernels.attention.gemm_attention)
    "prefill_attention": ("rows", "tiles", "gemm"),
    # steps of a few tokens (a plan's token and its grammar drafts; at most 16 on the AMX tiles, 8
    # in AVX-512 BF16 vectors): the same products as every step, or the layers' GGUF K-quant codes
    # (kernels.tile_quant_linear: a quarter to a half of the bf16 weights' bytes, which such a
    # step's time is; extra memory)
    "small_steps": ("dense", "kquant"),
}

# operation -> its implementations that change the numbers, not only the order of their sums
# (int8 activations): never chosen by timing, only where ``kernels`` forces them
OPT_IN: dict[str, tuple[str, ...]] = {"dense": ("int8",)}

# shape bucket -> the token rows of the step it times (every operation's decode and prefill steps)
BUCKET_ROWS = {"decode": 32, "prefill": 512}

# shape bucket -> the rows of that kind one fleet request runs. It decodes about as many tokens as
# it prefills past the prefix cache (fleet-256: up to 96 output tokens; ~600-token prompts, ~87 %
# of them cached): ~80 of each. A candidate's total is its time for one such request, so a
# 32-row decode bucket counts 80/32 times and a 512-row prefill bucket 80/512 (the buckets' raw
# sum weighed a prefill row 16 times less than a decode row, which a fleet's steps do not). A
# bucket not named here counts its time once.
FLEET_ROWS_PER_REQUEST = {"decode": 80, "prefill": 80}

# (operation, its candidates here) -> shape bucket -> candidate -> milliseconds
Measure = Callable[[str, tuple[str, ...]], Mapping[str, Mapping[str, float]]]

# operation -> the step-profile phase its time counts in (shared.engine.step_profile)
OPERATION_PHASES = {"dense": "model", "head": "logits", "decode_attention": "attention",
                    "prefill_attention": "attention", "small_steps": "model"}


def operation_shares(chosen: Mapping[str, str], phase_share: Mapping[str, float]) -> dict[str, dict]:
    """Each chosen operation with the share of the step its phase took (the two attention
    operations share one phase): ``{"dense": {"implementation": "packed", "phase": "model",
    "share": 0.72}, ...}``."""
    return {op: {"implementation": impl, "phase": OPERATION_PHASES[op], "share": phase_share.get(OPERATION_PHASES[op], 0.0)}
            for op, impl in chosen.items()}


@dataclass(frozen=True)
class KernelSpec:
    """``[engine] kernels`` parsed: a backend and the operations it forces."""

    backend: str = "auto"
    forced: Mapping[str, str] = field(default_factory=dict)

    @staticmethod
    def parse(text: str) -> "KernelSpec":
        """``"auto"``, ``"torch,dense=packed"``, ``"dense=linear,prefill_attention=rows"`` (backend
        auto). ValueError naming what is wrong: an unknown backend, operation or implementation."""
        items = [item.strip() for item in text.split(",")]
        backend = "auto"
        if items and "=" not in items[0]:
            backend = items.pop(0)
        if backend not in KERNEL_NAMES:
            raise ValueError(f"kernels must start with one of {list(KERNEL_NAMES)} or an operation=implementation "
                             f"item, got {text!r}")
        forced: dict[str, str] = {}
        for item in items:
            op, sep, impl = (part.strip() for part in item.partition("="))
            if not sep or op not in OPERATIONS:
                raise ValueError(f"kernels item {item!r}: expected operation=implementation, operations "
                                 f"{list(OPERATIONS)}")
            if impl not in OPERATIONS[op]:
                raise ValueError(f"kernels item {item!r}: {op} is one of {list(OPERATIONS[op])}")
            if op in forced:
                raise ValueError(f"kernels names {op} twice: {text!r}")
            forced[op] = impl
        if forced and backend == "triton":
            raise ValueError(f"kernels: {list(forced)} choose among the torch backend's implementations, "
                             f"not triton's: {text!r}")
        return KernelSpec(backend, forced)


def resolve_kernels(name: str, device: str) -> str:
    """"triton" or "torch" for ``kernels`` ``name`` (any ``KernelSpec`` form) on ``device``
    ("cpu", "cuda", "cuda:N"). ValueError for a bad spec, or "triton" on a CPU without the
    interpreter."""
    backend = KernelSpec.parse(name).backend
    on_gpu = device.startswith("cuda")
    if backend == "auto":
        return "triton" if on_gpu else "torch"
    if backend == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels = 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to interpret them on "
                         "the CPU, for tests: about a thousand times slower)")
    return backend


@dataclass(frozen=True)
class KernelPlan:
    """One implementation per operation, and how each was settled: "forced" (the config),
    "only" (one candidate here), "default" (the first candidate, untimed), "measured" or "cached"
    (timed now, or earlier on this CPU and model). ``timings_ms``: per operation, per shape
    bucket, per candidate, as measured."""

    chosen: Mapping[str, str]
    how: Mapping[str, str]
    timings_ms: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: ``dense=packed (measured: 9.90 vs 14.40 ms a request) prefill_attention=rows
        (forced)``, each time the operation's for one fleet request's rows (``request_ms``)."""
        parts = []
        for op, impl in self.chosen.items():
            how = self.how[op]
            totals = request_ms(self.timings_ms.get(op, {}))
            if totals and how in ("measured", "cached"):
                others = " vs ".join(f"{totals[c]:.2f}" for c in totals if c != impl)
                how += f": {totals[impl]:.2f} vs {others} ms a request"
            parts.append(f"{op}={impl} ({how})")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return {"chosen": dict(self.chosen), "how": dict(self.how),
                "timings_ms": {op: {b: dict(c) for b, c in buckets.items()} for op, buckets in self.timings_ms.items()}}


def request_ms(buckets: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Each candidate's milliseconds for one fleet request's rows: its time in each bucket times
    that bucket's ``FLEET_ROWS_PER_REQUEST / BUCKET_ROWS`` (1 for other buckets), summed (only
    candidates timed in every bucket)."""
    if not buckets:
        return {}
    common = set.intersection(*(set(c) for c in buckets.values()))
    weights = {b: FLEET_ROWS_PER_REQUEST[b] / BUCKET_ROWS[b] if b in FLEET_ROWS_PER_REQUEST else 1.0 for b in buckets}
    return {c: sum(weights[b] * t[c] for b, t in buckets.items()) for c in next(iter(buckets.values())) if c in common}


def fastest(op: str, buckets: Mapping[str, Mapping[str, float]]) -> str:
    """The implementation of ``op`` with the least ``request_ms`` over the shape buckets (an
    operation whose implementations cannot differ per bucket, like packed weights, which replace
    the dense ones, takes one for all); ties go to the earlier one in ``OPERATIONS``. ValueError
    when no candidate was timed in every bucket."""
    totals = request_ms(buckets)
    if not totals:
        raise ValueError(f"no {op} implementation was timed in every shape bucket: {dict(buckets)}")
    return min(totals, key=lambda c: (totals[c], OPERATIONS[op].index(c)))


def plan_kernels(candidates: Mapping[str, tuple[str, ...]], forced: Mapping[str, str],
                 measure: Measure | None, cached: KernelPlan | None = None) -> KernelPlan:
    """The plan for operations with ``candidates`` (those available here, per operation): a
    forced one where ``forced`` names it (ValueError if it, or its operation, is not available
    here); else, among the candidates less the ``OPT_IN`` ones (all of them where nothing else is
    available: a model already in that form), the only one where there is one; without
    ``measure`` the first one ("default": the path before choices were timed, which keeps a
    test's results independent of timings); else
    ``fastest`` of the timings ``cached`` holds when it timed exactly these candidates, else of
    ``measure(op, available)`` (shape bucket -> candidate -> ms)."""
    absent = sorted(set(forced) - set(candidates))
    if absent:
        raise ValueError(f"kernels forces {', '.join(f'{op}={forced[op]}' for op in absent)}, which this machine or "
                         f"model lacks (operations with a choice here: {list(candidates)})")
    chosen, how, timings = {}, {}, {}
    for op, available in candidates.items():
        if op in forced:
            if forced[op] not in available:
                raise ValueError(f"kernels forces {op}={forced[op]}, which this machine or model lacks "
                                 f"(available here: {list(available)})")
            chosen[op], how[op] = forced[op], "forced"
            continue
        available = tuple(c for c in available if c not in OPT_IN.get(op, ())) or available
        if len(available) == 1 or measure is None:
            chosen[op], how[op] = available[0], "only" if len(available) == 1 else "default"
        elif cached is not None and _timed(cached, op) == set(available):
            timings[op] = cached.timings_ms[op]  # the rule applied again: a changed rule needs no re-timing
            chosen[op], how[op] = fastest(op, timings[op]), "cached"
        else:
            timings[op] = measure(op, available)
            chosen[op], how[op] = fastest(op, timings[op]), "measured"
    return KernelPlan(chosen, how, timings)


def _timed(plan: KernelPlan, op: str) -> set[str]:
    """The implementations of ``op`` that ``plan`` chose among by timing (empty: not timed). A
    cached choice stands only while they are the ones available: a build that adds one (or a
    machine that lost one) measures again."""
    return set(request_ms(plan.timings_ms.get(op, {}))) if plan.how.get(op) in ("measured", "cached") else set()


@functools.cache
def cpu_signature(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """What makes one CPU's timings another's: model name, the flags kernels branch on, cores
    this process may use, and the torch build (its oneDNN)."""
    import torch

    from shared.engine.dtype_choice import cpu_info

    info = cpu_info(cpuinfo)
    kernel_flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")
                    if f in info.flags]
    name = info.model_name or platform.processor()
    return f"{name}|{','.join(kernel_flags)}|{len(os.sched_getaffinity(0))} cores|torch {torch.__version__}"


class ChoiceCache:
    """Measured plans in one JSON file, keyed by CPU signature and model shape; unreadable or
    stale files are ignored (and rewritten), never fatal."""

    def __init__(self, path: Path):
        self.path = path

    def get(self, key: str) -> KernelPlan | None:
        entry = self._entries().get(key)
        if not isinstance(entry, dict):
            return None
        try:
            return KernelPlan(dict(entry["chosen"]), dict(entry["how"]), entry.get("timings_ms", {}))
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, plan: KernelPlan) -> None:
        """Store ``plan``'s measured operations (forced and only ones are not choices) under
        ``key``, beside the operations stored there before."""
        measured = [op for op, how in plan.how.items() if how in ("measured", "cached")]
        if not measured:
            return
        entries = self._entries()
        old = self.get(key) or KernelPlan({}, {})
        entries[key] = {"chosen": {**old.chosen, **{op: plan.chosen[op] for op in measured}},
                        "how": {**old.how, **{op: "measured" for op in measured}},
                        "timings_ms": {**old.timings_ms, **{op: plan.timings_ms[op] for op in measured
                                                            if op in plan.timings_ms}}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temp = self.path.with_suffix(f".{os.getpid()}.tmp")
            temp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            temp.replace(self.path)
        except OSError as e:
            log.warning("could not cache the kernel choice in %s: %s", self.path, e)

    def _entries(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}
