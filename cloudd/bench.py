"""`cloudd bench`: replay a fleet trace through the engine in-process (offline: the whole trace
is submitted at once, in order), greedy with a fixed output length, one run per variant.

Variants are prefix indexes (``--index radix,hashed``), response formats
(``--response-format none,plan-schema``) or HiCache tiers (``--tiers off,on``, with the KV
pool sized as ``--device-pool-frac`` of the replayed requests' working set; the run with tiers
on reports ``vs_tiers_off``, its replay speed-up). ``plan-schema`` constrains every request to the
fleet plan schema (the bundled traces' skills); its plans end when complete (at most
``PLAN_MAX_TOKENS``), so its ``none`` run then generates, for each request, exactly as many
tokens as that request's plan had (EOS ignored): both runs produce the same tokens per request
and their tokens/s compare the grammar's cost alone. The constrained run also reports
``decode_steps_saved_frac``: tokens that jump-forward appended without a decode step of their
own, over all output tokens.

Baselines run on the same requests: ``hf`` (HF transformers ``generate()``, the ``"baseline"``
object and each run's ``ratio``) and ``vllm`` (the vLLM CPU peer, cloudd/peer_baseline.py: checked
first, so a peer that is not set up costs no engine run, and run after the engine runs, which
then run as they would alone: measured here, an engine run right after the peer's in one
process was 10-20 % slower than alone, the peer's own process always starts fresh; it becomes
``runs.vllm`` and each engine run gets ``vs_vllm``, its output tokens/s over vLLM's). A progress line on stderr follows each run.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cloudd.bench_report import RequestTiming, format_peer_run, format_profile, format_run, run_report
from cloudd.peer_baseline import VllmPeer, run_vllm_offline
from cloudd.trace import TraceRequest, load_trace
from cloudd.working_set import pool_blocks, pool_tokens, working_set_tokens
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.grammar.response_format import fleet_plan_format
from shared.engine.kernel_choice import cpu_signature, operation_shares
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.sampling_params import SamplingParams
from shared.model.checkpoint import Checkpoint
from shared.model.weight_cache import load_model
from shared.engine.step_profile import matmul_peak_flops
from shared.progress import Progress


@dataclass(frozen=True)
class BenchOptions:
    trace: Path
    model: Path
    engine: EngineConfig  # the base config; each variant replaces prefix_index
    indexes: tuple[str, ...] = ("radix",)
    response_formats: tuple[str, ...] = ("none",)  # "none" | "plan-schema"
    baselines: tuple[str, ...] = ()  # "hf", "vllm"
    baseline_batch_size: int = 16
    output_len: int = 96
    limit: int | None = None
    robots: int | None = None  # replay only the requests of the first N robots (whole histories)
    # HiCache variants: "off" | "on" ([hicache] config, enabled) | "layerwise" (on, and every
    # load of host pages runs layer by layer under its request's forward)
    tiers: tuple[str, ...] = ("off",)
    device_pool_frac: float | None = None  # KV pool = this fraction of the trace's working set
    host_pool_frac: float = 0.5  # with tiers on and no host size configured: of the working set
    peers_dir: Path | None = None  # the peers' scripts (default: shared.config.peer_scripts_dir())
    progress: bool = True  # a progress line on stderr while each run replays
    profile: bool = False  # time each step's phases and report FLOP/s against the matmul peak


PLAN_MAX_TOKENS = 256
RESPONSE_FORMATS = {
    "none": None,
    "plan-schema": fleet_plan_format(),
}


def replay_offline(engine: Engine, requests: list[TraceRequest], output_lens: list[int],
                   response_format: dict | None = None,
                   progress: Progress | None = None) -> tuple[list[RequestTiming], float]:
    """Submit every request at t0, step until all finish; timings are from t0. Unconstrained
    requests generate exactly their ``output_lens`` (EOS ignored); constrained ones stop when
    their grammar completes, at most ``output_lens``. ``progress`` is offered the counts after
    every step (it takes them only when it redraws)."""
    t0 = time.perf_counter()
    rids = [engine.submit(list(r.messages), SamplingParams(max_tokens=n, ignore_eos=True), buffered=False,
                          response_format=response_format)
            for r, n in zip(requests, output_lens, strict=True)]
    reqs = [engine.get_request(rid) for rid in rids]

    def counts() -> tuple[int, int]:
        return sum(r.is_finished for r in reqs), sum(r.num_output_tokens for r in reqs)

    while engine.has_unfinished:
        engine.step()
        if progress is not None:
            progress.update(counts)
    wall = time.perf_counter() - t0
    timings = [
        RequestTiming(
            priority=tr.priority,
            prompt_tokens=req.num_prompt_tokens,
            output_tokens=req.num_output_tokens,
            # NOTE: a request the engine ended unserved (a pool too small for it) has no first token
            ttft_s=(req.first_token_time if req.first_token_time is not None else req.finish_time) - t0,
            e2e_s=req.finish_time - t0,
        )
        for tr, req in zip(requests, reqs, strict=True)
    ]
    return timings, wall


def run_bench(opts: BenchOptions, log=lambda msg: print(msg, file=sys.stderr)) -> dict:
    """Every variant (and the baseline) on the same requests; returns the §6 JSON object."""
    requests = select_robots(load_trace(opts.trace, opts.limit), opts.robots)
    peer = VllmPeer.located(opts.model, opts.peers_dir) if "vllm" in opts.baselines else None
    if peer is not None:  # NOTE: before any engine run: a missing peer fails at once, not after an hour
        peer.check(opts.engine.dtype_choice.name)
    model, ckpt = load_model(opts.model, opts.engine.torch_dtype)
    base, working_set = _size_pools(opts, ckpt, requests, log)
    peak = _matmul_peak(opts, log) if opts.profile else None
    runs = {}
    for index in opts.indexes:
        for tiers in opts.tiers:
            lengths = [opts.output_len] * len(requests)
            # NOTE: the constrained run goes first: it sets the lengths the unconstrained one matches.
            for fmt in sorted(opts.response_formats, key=lambda f: f == "none"):
                name = _variant_name(index, fmt, tiers, opts)
                with _tier_dir(base, tiers) as config:
                    engine = Engine(model, ckpt.tokenizer, dataclasses.replace(config, prefix_index=index))
                    profile = engine.enable_profile() if opts.profile else None
                    constrained = RESPONSE_FORMATS[fmt] is not None
                    with Progress(name, len(requests), enabled=opts.progress) as progress:
                        timings, wall = replay_offline(engine, requests, [PLAN_MAX_TOKENS] * len(requests)
                                                       if constrained else lengths, RESPONSE_FORMATS[fmt], progress)
                    stats = engine.stats()
                    engine.close()
                runs[name] = run_report(str(opts.trace), timings, wall, stats.prefix_hit_rate)
                runs[name]["dtype"] = stats.dtype
                runs[name]["compiled"] = stats.compiled
                runs[name]["kernels"] = stats.kernels
                runs[name]["kv_layout"] = stats.kv_layout
                if stats.kernel_plan:
                    runs[name]["kernel_plan"] = stats.kernel_plan
                    log(f"   kernels: {engine.runner.kernel_plan.describe()}")
                runs[name]["cuda_graphs"] = stats.cuda_graphs
                runs[name]["preemptions"] = stats.preemptions
                runs[name]["kv_blocks"] = stats.blocks_total
                if working_set:
                    runs[name]["working_set_tokens"] = working_set
                if stats.tiers is not None:
                    runs[name]["tiers"] = stats.tiers.as_dict()
                if constrained:
                    lengths = [t.output_tokens for t in timings]
                    runs[name]["decode_steps_saved_frac"] = stats.forced_tokens / max(runs[name]["output_tokens"], 1)
                    runs[name]["grammar"] = {"compiles": stats.grammar_compiles, "cache_hits": stats.grammar_cache_hits,
                                             "compile_s": stats.grammar_compile_s, "mask_s": stats.mask_s}
                log(format_run(f"engine, {name}", runs[name]))
                if profile is not None:
                    # NOTE: measured again after each run, the best kept: one measurement at start
                    # on a noisy machine read 91 GFLOP/s where the same machine gave 142-178
                    peak = max(peak, _matmul_peak(opts, log))
                    runs[name]["profile"] = report = profile.report(peak)
                    report["cpu"] = cpu_signature()
                    if stats.kernel_plan:
                        report["operations"] = operation_shares(stats.kernel_plan["chosen"], report["share"])
                    log(format_profile(runs[name]["profile"]))
                del engine
    runs = {name: runs[name] for name in (_variant_name(i, f, t, opts) for i in opts.indexes
                                          for t in opts.tiers for f in opts.response_formats)}
    _compare_formats(runs, opts, log)
    _compare_tiers(runs, opts, log)
    if peer is not None:
        runs["vllm"] = vllm = _vllm_baseline(peer, requests, opts, log)
        for name, run in runs.items():
            if name != "vllm":
                run["vs_vllm"] = run["output_tok_s"] / vllm["output_tok_s"]
                log(f"   {name}: {run['vs_vllm']:.2f}x vLLM CPU's output tok/s (cloudd / vllm)")
    result: dict = runs[opts.indexes[0]] if len(runs) == 1 else {"runs": runs}
    if "hf" in opts.baselines:
        result["baseline"] = _hf_baseline(ckpt, requests, opts, log)
        for name, run in runs.items():
            if name == "vllm":
                continue
            run["ratio"] = run["output_tok_s"] / result["baseline"]["output_tok_s"]
            log(f"   {name}: {run['ratio']:.2f}x HF transformers output tok/s")
    return result


def _matmul_peak(opts: BenchOptions, log) -> float:
    """The machine's matmul rate in the engine's dtype (measured before the runs and after each)."""
    choice = opts.engine.dtype_choice
    peak = matmul_peak_flops(choice.dtype, opts.engine.device)
    log(f"matmul peak: {peak / 1e9:.0f} GFLOP/s in {choice.name} ({choice.reason}), torch.mm 2048^3")
    return peak


def select_robots(requests: list[TraceRequest], robots: int | None) -> list[TraceRequest]:
    """The requests of the first ``robots`` robots to appear (each keeps its whole history, so
    the subset keeps the trace's reuse structure); all of them when ``robots`` is None."""
    if robots is None:
        return requests
    if robots < 1:
        raise ValueError(f"--robots must be >= 1, got {robots}")
    keep = set(list(dict.fromkeys(r.robot for r in requests))[:robots])
    return [r for r in requests if r.robot in keep]


def _size_pools(opts: BenchOptions, ckpt: Checkpoint, requests: list[TraceRequest], log) -> tuple[EngineConfig, int]:
    """The engine config with the KV pool (and a host tier not sized by the config) set as
    fractions of the replayed requests' working set; the working set (0 if not computed)."""
    config = opts.engine
    if opts.device_pool_frac is None and set(opts.tiers) == {"off"}:
        return config, 0
    prompts = [ckpt.tokenizer.encode_chat(list(r.messages)) for r in requests]
    ws = working_set_tokens(prompts)
    if opts.device_pool_frac is not None:
        tokens = pool_tokens(opts.device_pool_frac, ws, max(map(len, prompts)) + opts.output_len)
        config = dataclasses.replace(config, num_blocks=pool_blocks(tokens, config.block_size) + 1)
    if config.hicache.host_pool_mb == HiCacheConfig().host_pool_mb:  # not configured: size it from the trace
        per_token = 2 * ckpt.config.num_layers * ckpt.config.num_kv_heads * ckpt.config.head_dim * \
            config.torch_dtype.itemsize
        host_mb = max(opts.host_pool_frac * ws * per_token / 2**20, 1.0)
        config = dataclasses.replace(config, hicache=dataclasses.replace(config.hicache, host_pool_mb=host_mb))
    log(f"working set {ws:,} tokens: KV pool {config.num_blocks - 1:,} blocks of {config.block_size}"
        f" ({(config.num_blocks - 1) * config.block_size / ws:.1%}), host tier {config.hicache.host_pool_mb:,.0f} MB")
    return config, ws


class _tier_dir:
    """The config of one tiers variant; with tiers on and no ``disk_dir`` configured, a fresh
    temporary disk tier that is removed afterwards."""

    def __init__(self, config: EngineConfig, tiers: str) -> None:
        self.config, self.tmp = config, None
        hc = dataclasses.replace(config.hicache, enabled=tiers != "off")
        if tiers == "layerwise":
            hc = dataclasses.replace(hc, layerwise_load="on")
        if hc.enabled and not hc.disk_dir:
            self.tmp = tempfile.mkdtemp(prefix="fleetserve-disk-tier-")
            hc = dataclasses.replace(hc, disk_dir=self.tmp)
        self.config = dataclasses.replace(config, hicache=hc)

    def __enter__(self) -> EngineConfig:
        return self.config

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _variant_name(index: str, fmt: str, tiers: str, opts: BenchOptions) -> str:
    parts = [index] if len(opts.indexes) > 1 else []
    parts += [fmt] if len(opts.response_formats) > 1 else []
    parts += [f"tiers-{tiers}"] if len(opts.tiers) > 1 else []
    return "/".join(parts) or index


# (baseline, variant, the variant's ratio key, how the log names them)
_TIER_COMPARISONS = (("off", "on", "vs_tiers_off", "tiers on", "tiers off"),
                     ("on", "layerwise", "vs_whole_loads", "layerwise", "whole loads"))


def _compare_tiers(runs: dict, opts: BenchOptions, log) -> None:
    """With tiers off and on: the replay's speed-up (wall time off over on) and the reuse; with
    on and layerwise: the same for layer-by-layer loads over whole ones."""
    for index in opts.indexes:
        for fmt in opts.response_formats:
            run = {t: runs[_variant_name(index, fmt, t, opts)] for t in opts.tiers}
            for base_name, name, key, label, base_label in _TIER_COMPARISONS:
                if base_name not in run or name not in run:
                    continue
                base, variant = run[base_name], run[name]
                variant[key] = base["wall_s"] / variant["wall_s"]
                log(f"   {label}: {variant[key]:.2f}x faster than {base_label} ({variant['wall_s']:.1f} s vs"
                    f" {base['wall_s']:.1f} s); prompt tokens reused {100 * variant['prefix_hit_rate']:.1f}% vs"
                    f" {100 * base['prefix_hit_rate']:.1f}%; TTFT p50 {variant['ttft_s']['p50']:.2f}s vs"
                    f" {base['ttft_s']['p50']:.2f}s")


def _compare_formats(runs: dict, opts: BenchOptions, log) -> None:
    """With both formats: the constrained run's tokens/s over the unconstrained one's."""
    if set(opts.response_formats) != {"none", "plan-schema"}:
        return
    for index in opts.indexes:
        free = runs[_variant_name(index, "none", opts.tiers[0], opts)]
        plan = runs[_variant_name(index, "plan-schema", opts.tiers[0], opts)]
        plan["vs_unconstrained"] = plan["output_tok_s"] / free["output_tok_s"]
        log(f"   plan-schema: {plan['vs_unconstrained']:.2f}x the unconstrained output tok/s, "
            f"{100 * plan['decode_steps_saved_frac']:.0f}% of decode steps saved by jump-forward")


def _vllm_baseline(peer: VllmPeer, requests: list[TraceRequest], opts: BenchOptions, log) -> dict:
    """The peer's run on the same requests, output length and dtype, as a §6 run object."""
    dtype = opts.engine.dtype_choice.name  # the peer runs the engine's dtype ("auto" resolved)
    log(f"vLLM CPU peer: {len(requests)} requests, {opts.output_len} output tokens each, {dtype}")
    run = run_vllm_offline(peer, requests, opts.output_len, dtype, progress=opts.progress)
    expected = len(requests) * opts.output_len
    if run.get("output_tokens", expected) != expected:
        log(f"   warning: vLLM generated {run['output_tokens']} output tokens, the engine runs {expected}")
    run = {**run, "trace": str(opts.trace)}
    log(format_peer_run("vLLM CPU peer (offline.py)", run))
    return run


def _hf_baseline(ckpt: Checkpoint, requests: list[TraceRequest], opts: BenchOptions, log) -> dict:
    from cloudd.hf_baseline import run_hf_generate

    prompts = [ckpt.tokenizer.encode_chat(list(r.messages)) for r in requests]
    timings, wall = run_hf_generate(
        ckpt, prompts, [r.priority for r in requests], opts.output_len, opts.baseline_batch_size,
        opts.engine.torch_dtype, opts.engine.device,
    )
    report = run_report(str(opts.trace), timings, wall, prefix_hit_rate=0.0)
    log(format_run(f"HF transformers generate(), static batches of {opts.baseline_batch_size}", report))
    return report
