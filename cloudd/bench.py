"""`cloudd bench`: replay a fleet trace through the engine in-process (offline: the whole trace
is submitted at once, in order), greedy with a fixed output length, one run per variant.

Variants are prefix indexes (``--index radix,hashed``) or response formats
(``--response-format none,plan-schema``). ``plan-schema`` constrains every request to the
fleet plan schema (the bundled traces' skills); its plans end when complete (at most
``PLAN_MAX_TOKENS``), so its ``none`` run then generates, for each request, exactly as many
tokens as that request's plan had (EOS ignored): both runs produce the same tokens per request
and their tokens/s compare the grammar's cost alone. The constrained run also reports
``decode_steps_saved_frac``: tokens that jump-forward appended without a decode step of their
own, over all output tokens.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cloudd.bench_report import RequestTiming, format_run, run_report
from cloudd.trace import TraceRequest, load_trace
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.grammar.response_format import fleet_plan_format
from shared.engine.sampling_params import SamplingParams
from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.llama import build_model


@dataclass(frozen=True)
class BenchOptions:
    trace: Path
    model: Path
    engine: EngineConfig  # the base config; each variant replaces prefix_index
    indexes: tuple[str, ...] = ("radix",)
    response_formats: tuple[str, ...] = ("none",)  # "none" | "plan-schema"
    baseline: str | None = None  # "hf" or None
    baseline_batch_size: int = 16
    output_len: int = 96
    limit: int | None = None


PLAN_MAX_TOKENS = 256
RESPONSE_FORMATS = {
    "none": None,
    "plan-schema": fleet_plan_format(),
}


def replay_offline(engine: Engine, requests: list[TraceRequest], output_lens: list[int],
                   response_format: dict | None = None) -> tuple[list[RequestTiming], float]:
    """Submit every request at t0, step until all finish; timings are from t0. Unconstrained
    requests generate exactly their ``output_lens`` (EOS ignored); constrained ones stop when
    their grammar completes, at most ``output_lens``."""
    t0 = time.perf_counter()
    rids = [engine.submit(list(r.messages), SamplingParams(max_tokens=n, ignore_eos=True), buffered=False,
                          response_format=response_format)
            for r, n in zip(requests, output_lens, strict=True)]
    reqs = [engine.get_request(rid) for rid in rids]
    while engine.has_unfinished:
        engine.step()
    wall = time.perf_counter() - t0
    timings = [
        RequestTiming(
            priority=tr.priority,
            prompt_tokens=req.num_prompt_tokens,
            output_tokens=req.num_output_tokens,
            ttft_s=req.first_token_time - t0,
            e2e_s=req.finish_time - t0,
        )
        for tr, req in zip(requests, reqs, strict=True)
    ]
    return timings, wall


def run_bench(opts: BenchOptions, log=lambda msg: print(msg, file=sys.stderr)) -> dict:
    """Every variant (and the baseline) on the same requests; returns the §6 JSON object."""
    requests = load_trace(opts.trace, opts.limit)
    ckpt = load_checkpoint(opts.model)
    model = build_model(ckpt.config, ckpt.weights, dtype=opts.engine.torch_dtype)
    runs = {}
    for index in opts.indexes:
        lengths = [opts.output_len] * len(requests)
        # NOTE: the constrained run goes first: it sets the lengths the unconstrained one matches.
        for fmt in sorted(opts.response_formats, key=lambda f: f == "none"):
            engine = Engine(model, ckpt.tokenizer, dataclasses.replace(opts.engine, prefix_index=index))
            constrained = RESPONSE_FORMATS[fmt] is not None
            timings, wall = replay_offline(engine, requests, [PLAN_MAX_TOKENS] * len(requests) if constrained
                                           else lengths, RESPONSE_FORMATS[fmt])
            stats = engine.stats()
            name = _variant_name(index, fmt, opts)
            runs[name] = run_report(str(opts.trace), timings, wall, stats.prefix_hit_rate)
            runs[name]["preemptions"] = stats.preemptions
            if constrained:
                lengths = [t.output_tokens for t in timings]
                runs[name]["decode_steps_saved_frac"] = stats.forced_tokens / max(runs[name]["output_tokens"], 1)
                runs[name]["grammar"] = {"compiles": stats.grammar_compiles, "cache_hits": stats.grammar_cache_hits,
                                         "compile_s": stats.grammar_compile_s, "mask_s": stats.mask_s}
            log(format_run(f"engine, {name}", runs[name]))
            del engine
    runs = {name: runs[name] for name in (_variant_name(i, f, opts) for i in opts.indexes
                                          for f in opts.response_formats)}
    _compare_formats(runs, opts, log)
    result: dict = runs[opts.indexes[0]] if len(runs) == 1 else {"runs": runs}
    if opts.baseline == "hf":
        result["baseline"] = _hf_baseline(ckpt, requests, opts, log)
        for run in runs.values():
            run["ratio"] = run["output_tok_s"] / result["baseline"]["output_tok_s"]
            log(f"   {run['ratio']:.2f}x HF transformers output tok/s")
    return result


def _variant_name(index: str, fmt: str, opts: BenchOptions) -> str:
    if len(opts.response_formats) == 1:
        return index
    return fmt if len(opts.indexes) == 1 else f"{index}/{fmt}"


def _compare_formats(runs: dict, opts: BenchOptions, log) -> None:
    """With both formats: the constrained run's tokens/s over the unconstrained one's."""
    if set(opts.response_formats) != {"none", "plan-schema"}:
        return
    for index in opts.indexes:
        free, plan = runs[_variant_name(index, "none", opts)], runs[_variant_name(index, "plan-schema", opts)]
        plan["vs_unconstrained"] = plan["output_tok_s"] / free["output_tok_s"]
        log(f"   plan-schema: {plan['vs_unconstrained']:.2f}x the unconstrained output tok/s, "
            f"{100 * plan['decode_steps_saved_frac']:.0f}% of decode steps saved by jump-forward")


def _hf_baseline(ckpt: Checkpoint, requests: list[TraceRequest], opts: BenchOptions, log) -> dict:
    from cloudd.hf_baseline import run_hf_generate

    prompts = [ckpt.tokenizer.encode_chat(list(r.messages)) for r in requests]
    timings, wall = run_hf_generate(
        ckpt, prompts, [r.priority for r in requests], opts.output_len, opts.baseline_batch_size,
        opts.engine.torch_dtype,
    )
    report = run_report(str(opts.trace), timings, wall, prefix_hit_rate=0.0)
    log(format_run(f"HF transformers generate(), static batches of {opts.baseline_batch_size}", report))
    return report
