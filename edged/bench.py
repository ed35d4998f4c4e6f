"""``edged bench``: batch-1 TTFT (cold and from a pinned system prompt), decode speed and time
to a complete plan for every backend x quantization (x speculation on/off), in one process, on
plan requests from a fleet trace; optionally beside llama.cpp on the same GGUF.

For each run (``"<backend>-<quant>"``, ``"-plain"`` appended without speculation, ``"-float32"``
or ``"-bfloat16"`` for int4's block products when they are not ``auto``) and request:

- **cold**: nothing reusable in the buffer and no pinned prompt: the whole prompt is prefilled;
- **pinned**: the robot's standing prefix is pinned -- its system prompt and its scene message,
  which every request of that robot repeats (``[[pinned]] context``) -- and loaded from the
  host copy; the buffer holds nothing else of use: only the task is prefilled;
- **pinned system**: only the system prompt is pinned: the scene and task are prefilled;
- **decode**: tokens/s after the first token, unconstrained greedy with ``ignore_eos`` so every
  run decodes the same number of tokens;
- **plan**: the request as a robot sends it -- the fleet plan JSON schema (``PLAN_SCHEMA``),
  greedy, up to ``plan_tokens`` -- with only the system prompt pinned: ``ttft_s``, ``plan_s``
  (to the complete plan), ``plan_decode_tok_s`` and ``complete_plan_rate``.

Figures are medians over the requests; with speculation, ``acceptance_rate`` is the share of
draft tokens sampling confirmed, and before each timed request the generator's history of
recent outputs holds the plans of the requests before it only (never a run of the same one).
Before the timed requests each engine plans the trace's next plan request once, untimed (its plan
kept out of that history): the steady state of a daemon that has planned before -- edged with
its forward costs measured and the spellings of the schema's forced text learned
(``edged.speculation.Spellings``; measured here: the first plan of a fresh generator decoded
~10 % slower). ``baseline="llamacpp"`` adds ``runs.llamacpp``
(``edged.llamacpp_peer``): llama-server with one slot on the same GGUF and threads, the same requests,
its system prompt cached by a request that shares it (``cache_prompt``), the same schema (its
``json_schema``) for plans, ``ignore_eos`` for decode; and ``llama-bench``'s tg128. The report's
ratios are the issues' bars: onnx-int4 decode over torch-none decode, pinned TTFT over cold TTFT,
each run's plan time over llama-server's, and its decode over llama-bench's tg128. A progress
line on stderr follows each run (timed requests done, decoded tokens/s so far).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edged.backends.factory import make_backend
from edged.generation import Batch1Generator, LocalJob
from edged.speculation import NgramIndex, SpeculationConfig, recent_outputs, remember
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import FLEET_SKILLS, grammar_spec
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.model.checkpoint import load_checkpoint
from shared.plan.schema import plan_schema
from shared.progress import Progress

BASELINES = ("llamacpp",)
# The fleet traces' plans, at most 4 steps (the bundled robot tasks need no more), so that a
# plan closes within plan_tokens on both engines whatever their JSON whitespace.
PLAN_SCHEMA = plan_schema(FLEET_SKILLS, max_steps=4)


@dataclass(frozen=True)
class BenchOptions:
    model: Path
    backends: tuple[str, ...] = ("onnx", "torch")
    quants: tuple[str, ...] = ("none", "int8", "int4")
    threads: int = 2
    requests: int = 5
    decode_tokens: int = 64
    plan_tokens: int = 256  # a plan's max_tokens
    trace: Path = Path("../shared/workloads/fleet-256.jsonl")
    max_len: int = 2048
    progress: bool = True  # a progress line on stderr while each run goes
    device: str = "cpu"  # "cuda": the torch backend on the Triton kernels, the ONNX graph on ORT's GPU providers
    cuda_graphs: tuple[bool, ...] = (True,)  # torch on cuda: with and/or without its decode graph ("-eager")
    speculation: tuple[bool, ...] = (True,)  # with and/or without speculative decoding ("-plain")
    products: tuple[str, ...] = ("auto",)  # int4's block products on a CPU (both backends), a run each
    baseline: str | None = None  # "llamacpp": llama-server and llama-bench on the same GGUF


def plan_requests(trace: Path, n: int) -> list[list[dict]]:
    """The first ``n`` first-time plan requests of ``trace`` (their chat messages)."""
    out = []
    with open(trace) as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "plan":
                out.append(row["messages"])
            if len(out) == n:
                break
    if not out:
        raise ValueError(f"{trace}: no plan requests")
    return out


def run_bench(opts: BenchOptions, log: Callable[[str], None] | None = print) -> dict:
    """Every run's figures (``runs``), the bars' ``ratios``, threads and device.

    Raises ValueError for an unknown baseline or a llama.cpp baseline on a model that is not a
    GGUF, ``edged.llamacpp_peer.PeerMissing`` when llama.cpp is not set up (before any run).
    """
    if opts.baseline is not None:
        check_baseline(opts)
    checkpoint = load_checkpoint(opts.model)
    tok = checkpoint.tokenizer
    compiler = GrammarCompiler(tok)
    plan_spec = grammar_spec({"type": "json_schema", "json_schema": {"name": "fleet-plan", "schema": PLAN_SCHEMA}})
    compiler.compile(plan_spec)  # not timed: a robot's daemon precompiles it at start-up
    requests = plan_requests(opts.trace, opts.requests + 1)
    warm_up = requests.pop() if len(requests) > opts.requests else None  # planned once, untimed
    prompts = [tok.encode_chat(messages) for messages in requests]
    systems = [tok.encode_chat(messages[:1], add_generation_prompt=False) for messages in requests]
    standing = [tok.encode_chat(messages[:2], add_generation_prompt=False) for messages in requests]
    runs: dict[str, dict] = {}
    variants = [(kind, quant, graphs, spec, products) for kind in opts.backends for quant in opts.quants
                for graphs in (opts.cuda_graphs if kind == "torch" and opts.device == "cuda" else (True,))
                for spec in opts.speculation
                for products in (opts.products if quant == "int4" and opts.device == "cpu" else ("auto",))]
    for kind, quant, graphs, spec, products in variants:
        name = (f"{kind}-{quant}" + ("" if graphs else "-eager") + ("" if spec else "-plain")
                + ("" if products == "auto" else f"-{products}"))
        backend = make_backend(kind, quant, checkpoint, opts.model, opts.max_len, opts.threads, opts.device,
                               cuda_graph=graphs, products=products)
        gen = Batch1Generator(backend, tok, compiler, speculation=SpeculationConfig(enabled=spec))
        gen.run(_job(tok, prompts[0][:64], 4), _ignore)  # warm-up
        if warm_up is not None:  # untimed; the timed plans set the history themselves, without it
            _plan(gen, tok, tok.encode_chat(warm_up), tok.encode_chat(warm_up[:1], add_generation_prompt=False),
                  plan_spec, opts.plan_tokens)
        ttft: dict[str, list[float]] = {"cold": [], "pinned": [], "pinned_system": []}
        decode: list[float] = []
        plans: list[_Timed] = []
        earlier: list[list[int]] = []  # the plans of the requests before: what a robot's history holds
        progress = Progress(name, 4 * len(prompts), enabled=opts.progress)
        done = _counter(decode, plans, opts.decode_tokens)
        for prompt, system, prefix in zip(prompts, systems, standing, strict=True):
            for variant, pin in (("cold", None), ("pinned_system", system), ("pinned", prefix)):
                gen.pinned.clear()
                if pin is not None:
                    gen.pin(variant, pin)
                gen.history = _history(earlier, gen.speculation)  # never this request's own output
                timed = _timed(gen, _job(tok, prompt, opts.decode_tokens))
                ttft[variant].append(timed.ttft_s)
                decode.append(timed.decode_tok_s)
                progress.update(done)
            gen.history = _history(earlier, gen.speculation)
            timed, plan = _plan(gen, tok, prompt, system, plan_spec, opts.plan_tokens)
            plans.append(timed)
            earlier.append(plan)
            progress.update(done)
        progress.close()
        med = statistics.median
        runs[name] = {f"ttft_{variant}_s": med(times) for variant, times in ttft.items()}
        runs[name] |= {"decode_tok_s": med(decode), "requests": len(prompts),
                       "prompt_tokens": med(map(len, prompts)),
                       "pinned_tokens": med(map(len, standing)),
                       "pinned_system_tokens": med(map(len, systems)),
                       "ttft_s": med(p.ttft_s for p in plans), "plan_s": med(p.total_s for p in plans),
                       "plan_decode_tok_s": med(p.decode_tok_s for p in plans),
                       "plan_tokens": med(p.tokens for p in plans),
                       "complete_plan_rate": sum(p.complete for p in plans) / len(plans), "speculation": spec,
                       "products": backend.products}
        if spec:
            runs[name]["acceptance_rate"] = gen.accepted_drafts / max(gen.drafted_tokens, 1)
        if log:
            log(_run_line(name, runs[name]))
        del gen, backend
    if opts.baseline == "llamacpp":
        runs["llamacpp"] = _llamacpp_run(opts, requests, warm_up)
        if log:
            log(_run_line("llamacpp", runs["llamacpp"]))
    return {"runs": runs, "ratios": _ratios(runs), "threads": opts.threads, "device": opts.device}


@dataclass(frozen=True)
class _Timed:
    ttft_s: float
    total_s: float
    tokens: int
    decode_tok_s: float
    complete: bool  # ended by the model (a closed plan), not by max_tokens


def _timed(gen: Batch1Generator, job: LocalJob) -> _Timed:
    """One request with nothing useful left in the buffer (a pinned prompt may be loaded)."""
    gen.held = []
    stamps: list[float] = []
    start = time.perf_counter()
    gen.run(job, lambda tokens, text: stamps.extend(time.perf_counter() for _ in tokens))
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return _Timed(stamps[0] - start, stamps[-1] - start, len(stamps), decode, job.finish_reason is FinishReason.STOP)


def _plan(gen: Batch1Generator, tok, prompt: list[int], system: list[int], spec,
          plan_tokens: int) -> tuple[_Timed, list[int]]:
    """A plan request as a robot sends it (the plan schema ``spec``, greedy, up to ``plan_tokens``)
    with only its system prompt pinned: its timing and the plan's tokens."""
    gen.pinned.clear()
    gen.pin("system", system)
    plan = _job(tok, prompt, plan_tokens, ignore_eos=False)
    plan.spec = spec
    return _timed(gen, plan), plan.generated


def _history(outputs: list[list[int]], config: SpeculationConfig) -> NgramIndex:
    """A generator's history of recent outputs holding ``outputs``."""
    history = recent_outputs(config)
    for output in outputs:
        history = remember(history, output, config)
    return history


def _counter(decode: list, plans: list, decode_tokens: int) -> Callable[[], tuple[int, int]]:
    """The progress line's (timed requests, decoded tokens) so far."""
    return lambda: (len(decode) + len(plans), (len(decode) + len(plans)) * decode_tokens)


def _job(tok, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> LocalJob:
    return LocalJob("bench", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                    IncrementalDetokenizer(tok))


def _ignore(tokens, text) -> None:
    pass


def check_baseline(opts: BenchOptions) -> None:
    """ValueError for an unknown baseline or a llama.cpp one on a model that is not a GGUF;
    ``edged.llamacpp_peer.PeerMissing`` when llama.cpp is not set up."""
    from edged.llamacpp_peer import peer_binary

    if opts.baseline not in BASELINES:
        raise ValueError(f"baseline {opts.baseline!r}: must be one of {', '.join(BASELINES)}")
    if opts.model.suffix != ".gguf":
        raise ValueError(f"--baseline llamacpp runs llama.cpp on the same model: {opts.model} is not a GGUF")
    peer_binary("llama-server")
    peer_binary("llama-bench")


def _llamacpp_run(opts: BenchOptions, requests: list[list[dict]], warm_up: list[dict] | None) -> dict:
    """llama-server on the same requests (plans with the schema, decode with ignore_eos), each
    after a request that shares its system prompt, once ``warm_up`` is planned (untimed); then
    llama-bench's tg128."""
    from edged.llamacpp_peer import LlamaServer, llama_bench_decode

    decode, plans = [], []
    progress = Progress("llamacpp", 2 * len(requests), enabled=opts.progress)
    done = _counter(decode, plans, opts.decode_tokens)
    with LlamaServer(opts.model, opts.threads) as server:
        server.chat([{"role": "user", "content": "Hello."}], 4, cache_prompt=False)  # warm-up
        if warm_up is not None:
            server.chat(warm_up, opts.plan_tokens, json_schema=PLAN_SCHEMA)
        for messages in requests:
            warm = [messages[0], {"role": "user", "content": "Status?"}]  # the same system prompt, cached
            server.chat(warm, 1)
            decode.append(server.chat(messages, opts.decode_tokens, ignore_eos=True).decode_tok_s)
            progress.update(done)
            server.chat(warm, 1)
            plans.append(server.chat(messages, opts.plan_tokens, json_schema=PLAN_SCHEMA))
            progress.update(done)
    progress.close()
    med = statistics.median
    return {"decode_tok_s": med(decode), "requests": len(requests),
            "ttft_s": med(p.ttft_s for p in plans), "plan_s": med(p.total_s for p in plans),
            "plan_decode_tok_s": med(p.decode_tok_s for p in plans), "plan_tokens": med(p.tokens for p in plans),
            "complete_plan_rate": sum(p.finish_reason == "stop" for p in plans) / len(plans),
            "bench_tg128_tok_s": llama_bench_decode(opts.model, opts.threads)}


def _run_line(name: str, r: dict) -> str:
    if name == "llamacpp":
        return (f"llamacpp: plan TTFT {r['ttft_s']:.3f} s, plan {r['plan_s']:.3f} s ({r['plan_tokens']:.0f} tokens, "
                f"{r['plan_decode_tok_s']:.1f} tok/s); decode {r['decode_tok_s']:.1f} tok/s; "
                f"llama-bench tg128 {r['bench_tg128_tok_s']:.1f} tok/s")
    spec = f", drafts accepted {100 * r['acceptance_rate']:.0f} %" if "acceptance_rate" in r else ""
    return (f"{name}: TTFT cold {r['ttft_cold_s']:.3f} s, pinned {r['ttft_pinned_s']:.3f} s, "
            f"pinned system {r['ttft_pinned_system_s']:.3f} s; decode {r['decode_tok_s']:.1f} tok/s; "
            f"plan {r['plan_s']:.3f} s ({r['plan_tokens']:.0f} tokens, {r['plan_decode_tok_s']:.1f} tok/s){spec}")


def _ratios(runs: dict[str, dict]) -> dict[str, float]:
    ours = {name: r for name, r in runs.items() if name != "llamacpp"}
    ratios = {f"{name}_pinned_over_cold": r["ttft_pinned_s"] / r["ttft_cold_s"] for name, r in ours.items()}
    ratios |= {f"{name}_pinned_system_over_cold": r["ttft_pinned_system_s"] / r["ttft_cold_s"]
               for name, r in ours.items()}
    if "onnx-int4" in runs and "torch-none" in runs:
        ratios["onnx-int4_decode_over_torch-none"] = runs["onnx-int4"]["decode_tok_s"] / runs["torch-none"]["decode_tok_s"]
    peer = runs.get("llamacpp")
    if peer is not None:
        for name, r in ours.items():
            ratios[f"{name}_plan_s_over_llamacpp"] = r["plan_s"] / peer["plan_s"]
            ratios[f"{name}_decode_over_llama_bench_tg128"] = r["decode_tok_s"] / peer["bench_tg128_tok_s"]
            ratios[f"{name}_plan_decode_over_llama_bench_tg128"] = r["plan_decode_tok_s"] / peer["bench_tg128_tok_s"]
    return ratios


def format_report(report: dict) -> str:
    lines = [f"{'run':<16} {'TTFT cold s':>11} {'pinned s':>9} {'pin/cold':>9} {'sys-only s':>11} "
             f"{'sys/cold':>9} {'decode tok/s':>13} {'plan s':>8} {'plan tok/s':>11}"]
    for name, r in report["runs"].items():
        if name == "llamacpp":
            lines.append(f"{name:<16} {'':>11} {'':>9} {'':>9} {r['ttft_s']:>11.3f} {'':>9} "
                         f"{r['decode_tok_s']:>13.1f} {r['plan_s']:>8.3f} {r['plan_decode_tok_s']:>11.1f}")
            continue
        cold = r["ttft_cold_s"]
        lines.append(f"{name:<16} {cold:>11.3f} {r['ttft_pinned_s']:>9.3f} {r['ttft_pinned_s'] / cold:>9.2f} "
                     f"{r['ttft_pinned_system_s']:>11.3f} {r['ttft_pinned_system_s'] / cold:>9.2f} "
                     f"{r['decode_tok_s']:>13.1f} {r['plan_s']:>8.3f} {r['plan_decode_tok_s']:>11.1f}")
    ratios = report["ratios"]
    if "onnx-int4_decode_over_torch-none" in ratios:
        lines.append(f"onnx-int4 decode / torch-none decode: {ratios['onnx-int4_decode_over_torch-none']:.2f}x "
                     "(bar: >= 5x)")
    lines.append("bar: pinned/cold TTFT <= 0.20")
    peer = report["runs"].get("llamacpp")
    if peer is not None:
        lines.append(f"llamacpp: system prompt cached, sys-only column = plan TTFT; llama-bench tg128 "
                     f"{peer['bench_tg128_tok_s']:.1f} tok/s")
        for name in report["runs"]:
            if name != "llamacpp":
                lines.append(f"{name}: plan time / llama-server's {ratios[f'{name}_plan_s_over_llamacpp']:.2f} "
                             f"(bar <= 0.5); decode / llama-bench tg128 "
                             f"{ratios[f'{name}_decode_over_llama_bench_tg128']:.2f}x (bar >= 1.5), plan decode "
                             f"{ratios[f'{name}_plan_decode_over_llama_bench_tg128']:.2f}x")
    return "\n".join(lines)
