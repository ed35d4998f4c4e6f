"""`cloudd bench`: replay a fleet trace through the engine in-process (offline: the whole trace
is submitted at once, in order), greedy with a fixed output length, one run per variant."""

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
from shared.engine.sampling_params import SamplingParams
from shared.model.checkpoint import Checkpoint, load_checkpoint
from shared.model.llama import build_model


@dataclass(frozen=True)
class BenchOptions:
    trace: Path
    model: Path
    engine: EngineConfig  # the base config; each variant replaces prefix_index
    indexes: tuple[str, ...] = ("radix",)
    baseline: str | None = None  # "hf" or None
    baseline_batch_size: int = 16
    output_len: int = 96
    limit: int | None = None


def replay_offline(engine: Engine, requests: list[TraceRequest], output_len: int) -> tuple[list[RequestTiming], float]:
    """Submit every request at t0, step until all finish; timings are from t0."""
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [engine.submit(list(r.messages), sampling, buffered=False) for r in requests]
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
        engine = Engine(model, ckpt.tokenizer, dataclasses.replace(opts.engine, prefix_index=index))
        timings, wall = replay_offline(engine, requests, opts.output_len)
        runs[index] = run_report(str(opts.trace), timings, wall, engine.stats().prefix_hit_rate)
        runs[index]["preemptions"] = engine.stats().preemptions
        log(format_run(f"engine, {index} index", runs[index]))
        del engine
    result: dict = runs[opts.indexes[0]] if len(runs) == 1 else {"runs": runs}
    if opts.baseline == "hf":
        result["baseline"] = _hf_baseline(ckpt, requests, opts, log)
        for run in runs.values():
            run["ratio"] = run["output_tok_s"] / result["baseline"]["output_tok_s"]
            log(f"   {run['ratio']:.2f}x HF transformers output tok/s")
    return result


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
