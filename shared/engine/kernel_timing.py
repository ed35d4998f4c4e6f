"""Times each candidate implementation of the CPU's hot operations on one model's real shapes, for
``shared.engine.kernel_choice.plan_kernels``; ``choose_plan`` gives a ``ModelRunner`` its plan
(which ``ModelRunner.apply_plan`` then runs).

Each candidate is timed in a few shape buckets that stand for the steps a fleet runs (a batched
decode step's rows, a prefill step's chunks), the median of a few calls after one warm-up call;
the whole measurement takes well under a second for SmolLM2-135M and a few seconds for a 1.5B
model. Timings read nothing but the model's first layer (small steps: every layer, whose
weights' bytes are their cost) and scratch inputs: the KV pools are read, never written.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import onednn_linear
from kernels.attention import paged_attention
from kernels.greedy_head import greedy_head
from kernels.int8_linear import int8_products_usable
from kernels.paged_decode_cpu import supports_tiles
from kernels.weight_forms import form_linear, weight_linear
from shared.engine.kernel_choice import (BUCKET_ROWS, ChoiceCache, KernelPlan, KernelSpec, Measure, cpu_signature,
                                         plan_kernels)
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.model.projection_forms import dense_form

REPEATS = 5


def candidates(runner) -> dict[str, tuple[str, ...]]:
    """The implementations each operation has on this runner's device, dtype and model. A
    model whose projections an earlier engine already put in a form (packed, int8) keeps them
    so."""
    if runner.device.type != "cpu" or runner.kernels != "torch":
        return {}
    model = runner.model
    form = dense_form(model)
    if form is not None:
        dense = (form,)
    else:
        dense = ("linear",) + (("packed",) if onednn_linear.supported(runner.dtype) else ()) + (
            ("int8",) if int8_products_usable() else ())
    head = ("packed",) if isinstance(model.lm_head, onednn_linear.PackedHead) else (
        ("linear", "packed") if onednn_linear.supported(runner.dtype) else ("linear",))
    kernel = runner.decode_in_place  # the in-place C++ kernel builds here
    cfg = model.config
    tiles = kernel and runner.kv_layout == "paired" and supports_tiles(cfg.head_dim, runner.dtype, runner.block_size)
    in_place = ("rows", "tiles") if tiles else ("rows",) if kernel else ()
    available = {"dense": dense, "head": head, "decode_attention": in_place + ("cascade",),
                 "prefill_attention": in_place + ("gemm",)}
    if runner.has_kquant_codes():
        available["small_steps"] = ("dense", "kquant")
    return available


def measurer(runner) -> Measure:
    """(``op``, its candidates) -> shape bucket -> candidate -> milliseconds, on ``runner``'s
    model and pools."""
    def measure(op: str, impls: tuple[str, ...]) -> dict[str, dict[str, float]]:
        if op == "dense":
            return time_dense(runner.model.layers[0])
        if op == "head":
            return time_head(runner.model.lm_head)
        if op in ATTENTION_STEPS:
            return time_attention(runner, op, impls)
        if op == "small_steps":
            return time_small_steps(runner)
        raise ValueError(f"no timing for operation {op!r}")
    return measure


def median_ms(call: Callable[[], object], repeats: int = REPEATS) -> float:
    """The median wall time of ``call`` in milliseconds, after one untimed call."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def time_dense(layer) -> dict[str, dict[str, float]]:
    """One layer's four projections (q/k/v with its bias, o, gate/up, down) per bucket of rows:
    torch's ``linear`` on the dense weights and ``form_linear`` on copies packed here (int8
    products are never timed: ``kernel_choice.OPT_IN``)."""
    weights = [(layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias), (layer.self_attn.o_proj.weight, None),
               (layer.mlp.gate_up_proj.weight, None), (layer.mlp.down_proj.weight, None)]
    packed = [(onednn_linear.PackedLinear(w), b) for w, b in weights]
    timings = {}
    with torch.inference_mode():
        for bucket, rows in BUCKET_ROWS.items():
            inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w, _ in weights]
            timings[bucket] = {
                "linear": median_ms(lambda: [F.linear(x, w, b) for x, (w, b) in zip(inputs, weights)]),
                "packed": median_ms(lambda: [form_linear(x, p.weight, b)
                                             for x, (p, b) in zip(inputs, packed)]),
            }
    return timings


SMALL_STEP_ROWS = 8  # a plan's token with a few grammar drafts


def time_small_steps(runner) -> dict[str, dict[str, float]]:
    """Every projection with K-quant codes (the layers', the LM head's) at ``SMALL_STEP_ROWS``
    rows: torch's ``linear`` on the dense weights as loaded, and the codes' kernel (its default path
    here: the AMX tiles, else AVX-512 BF16 vectors). All
    layers, not the first: a small step's time is its weights' bytes streamed from memory, which
    one layer's would not show (they stay in cache). Packed dense weights run about 1.4x faster
    than ``linear`` at these rows; the codes still win by 1.3-1.6x on the 1.5B on a Xeon's tiles,
    2x in an EPYC's vectors."""
    model, projections = runner.model, runner.kquant_projections()
    modules = {name: model.get_submodule(name) for name in projections}
    with torch.inference_mode():
        inputs = {name: torch.randn(SMALL_STEP_ROWS, m.weight.shape[1], dtype=runner.dtype)
                  for name, m in modules.items()}
        return {"small": {
            # an earlier engine may have packed the weights: each multiplies in the form it is in
            "dense": median_ms(lambda: [weight_linear(inputs[n], m.weight, getattr(m, "bias", None))
                                        for n, m in modules.items()]),
            "kquant": median_ms(lambda: [projections[n](inputs[n], getattr(m, "bias", None))
                                         for n, m in modules.items()]),
        }}


def time_head(head) -> dict[str, dict[str, float]]:
    """The greedy LM head over a batched decode step's rows: ``greedy_head`` on the dense weight,
    and a ``PackedHead`` built here."""
    packed = onednn_linear.PackedHead(head)
    rows = BUCKET_ROWS["decode"]
    with torch.inference_mode():
        hidden = torch.randn(rows, head.weight.shape[1], dtype=head.weight.dtype)
        return {"decode": {"linear": median_ms(lambda: greedy_head(hidden, head.weight)),
                           "packed": median_ms(lambda: packed.greedy(hidden))}}


def time_attention(runner, op: str, impls: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """One layer's attention for ``op``'s step (``ATTENTION_STEPS``) through each of ``impls``,
    over distinct blocks of the layer's pool (read, never written)."""
    cfg = runner.model.config
    k_cache, v_cache = runner.kv_caches[0]
    out = ATTENTION_STEPS[op](runner.block_size, len(k_cache) - 1)
    q = torch.randn(out.num_tokens, cfg.num_heads, cfg.head_dim, dtype=runner.dtype, device=runner.device)
    scale = cfg.head_dim**-0.5
    timings = {}
    with torch.inference_mode():
        for impl in impls:
            meta = runner.step_batch(out, **{op: impl}).meta
            timings[impl] = median_ms(lambda: paged_attention(q, k_cache, v_cache, meta, scale))
    return {op.removesuffix("_attention"): timings}


def prefill_step(block_size: int, free_blocks: int, chunks: int = 4, cached: int = 384,
                 new: int = BUCKET_ROWS["prefill"] // 4) -> SchedulerOutput:
    """A fleet trace's prefill step: ``chunks`` prompt chunks of ``new`` tokens after ``cached``
    ones (a system prompt and scene the radix cache holds), each over its own blocks 1, 2, ...
    of the pool (fewer or shorter where ``free_blocks`` are fewer)."""
    per_chunk = -(-(cached + new) // block_size)
    while chunks * per_chunk > free_blocks and (cached > block_size or chunks > 1):
        chunks, cached = (chunks, cached // 2) if cached > block_size else (chunks - 1, cached)
        per_chunk = -(-(cached + new) // block_size)
    prefills = []
    for c in range(chunks):
        table = list(range(1 + c * per_chunk, 1 + (c + 1) * per_chunk))
        prefills.append(ScheduledChunk(f"kernel-timing-{c}", [0] * new, cached, table, sample=True))
    return SchedulerOutput(prefills=prefills)


def decode_step(block_size: int, free_blocks: int, rows: int = BUCKET_ROWS["decode"], prompts: int = 4,
                shared: int = 384, own: int = 64) -> SchedulerOutput:
    """A fleet trace's batched decode step: ``rows`` decode rows, each of ``prompts`` system
    prompts of ``shared`` tokens shared by a group of them, then ``own`` tokens of the row's
    own (fewer rows where ``free_blocks`` are fewer)."""
    shared_blocks, own_blocks = shared // block_size, -(-own // block_size)
    while prompts * shared_blocks + rows * own_blocks > free_blocks and rows > 1:
        rows, prompts = rows // 2, max(1, prompts // 2)
    prompt_tables = [list(range(1 + p * shared_blocks, 1 + (p + 1) * shared_blocks)) for p in range(prompts)]
    next_block = 1 + prompts * shared_blocks
    decodes = []
    for r in range(rows):
        table = prompt_tables[r % prompts] + list(range(next_block, next_block + own_blocks))
        next_block += own_blocks
        decodes.append(ScheduledChunk(f"kernel-timing-{r}", [0], shared_blocks * block_size + own - 1, table, sample=True))
    return SchedulerOutput(decodes=decodes)


# attention operation -> its step's shape (block size, free blocks -> the step)
ATTENTION_STEPS = {"prefill_attention": prefill_step, "decode_attention": decode_step}


def choose_plan(runner, spec: KernelSpec, measure: bool, cache: ChoiceCache | None) -> KernelPlan:
    """The plan for ``runner``: ``spec``'s forced operations; with ``measure`` the others timed
    here (or read from ``cache``, keyed by CPU signature, model shape, dtype and block size, and
    stored there); without it each takes its first candidate here ("default": the path before
    choices were measured, which keeps a test's results independent of timings). On a runner
    that is not the CPU's torch backend (``auto`` on CUDA runs Triton) nothing is chosen and
    ``spec``'s forced items, which name CPU implementations, do not apply: one config serves
    both."""
    available = candidates(runner)
    if not available:
        return KernelPlan({}, {})
    if not measure:
        return plan_kernels(available, spec.forced, None)
    key = f"{cpu_signature()}|{_model_key(runner)}"
    plan = plan_kernels(available, spec.forced, measurer(runner), cache.get(key) if cache is not None else None)
    if cache is not None:
        cache.put(key, plan)
    return plan


def _model_key(runner) -> str:
    cfg = runner.model.config
    return (f"hidden {cfg.hidden_size} intermediate {cfg.intermediate_size} heads {cfg.num_heads}/{cfg.num_kv_heads}"
            f" head_dim {cfg.head_dim} {str(runner.dtype).removeprefix('torch.')} block {runner.block_size}")
