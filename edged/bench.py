"""``edged bench``: batch-1 TTFT (cold and from a pinned system prompt) and decode speed for
every backend x quantization, in one process, on plan requests from a fleet trace.

For each run (``"<backend>-<quant>"``) and each request:

- **cold**: nothing reusable in the buffer and no pinned prompt: the whole prompt is prefilled;
- **pinned**: the robot's standing prefix is pinned -- its system prompt and its scene message,
  which every request of that robot repeats (``[[pinned]] context``) -- and loaded from the
  host copy; the buffer holds nothing else of use: only the task is prefilled;
- **pinned system**: only the system prompt is pinned: the scene and task are prefilled;
- **decode**: tokens/s after the first token, unconstrained greedy with ``ignore_eos`` so every
  run decodes the same number of tokens.

Figures are medians over the requests. The report's ratios are the issue's bars: onnx-int4
decode over torch-none decode, and pinned TTFT over cold TTFT for each run. A progress line on
stderr follows each run (timed requests done, decoded tokens/s so far).
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
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.sampling_params import SamplingParams
from shared.model.checkpoint import load_checkpoint
from shared.progress import Progress


@dataclass(frozen=True)
class BenchOptions:
    model: Path
    backends: tuple[str, ...] = ("onnx", "torch")
    quants: tuple[str, ...] = ("none", "int8", "int4")
    threads: int = 2
    requests: int = 5
    decode_tokens: int = 64
    trace: Path = Path("../shared/workloads/fleet-256.jsonl")
    max_len: int = 2048
    progress: bool = True  # a progress line on stderr while each run goes
    device: str = "cpu"  # "cuda": the torch backend on the Triton kernels, the ONNX graph on ORT's GPU providers
    cuda_graphs: tuple[bool, ...] = (True,)  # torch on cuda: with and/or without its decode graph ("-eager")


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
    checkpoint = load_checkpoint(opts.model)
    tok = checkpoint.tokenizer
    compiler = GrammarCompiler(tok)
    requests = plan_requests(opts.trace, opts.requests)
    prompts = [tok.encode_chat(messages) for messages in requests]
    systems = [tok.encode_chat(messages[:1], add_generation_prompt=False) for messages in requests]
    standing = [tok.encode_chat(messages[:2], add_generation_prompt=False) for messages in requests]
    runs: dict[str, dict] = {}
    variants = [(kind, quant, graphs) for kind in opts.backends for quant in opts.quants
                for graphs in (opts.cuda_graphs if kind == "torch" and opts.device == "cuda" else (True,))]
    for kind, quant, graphs in variants:
        name = f"{kind}-{quant}" + ("" if graphs else "-eager")
        backend = make_backend(kind, quant, checkpoint, opts.model, opts.max_len, opts.threads, opts.device,
                               cuda_graph=graphs)
        gen = Batch1Generator(backend, tok, compiler)
        gen.run(_job(tok, prompts[0][:64], 4), _ignore)  # warm-up
        ttft: dict[str, list[float]] = {"cold": [], "pinned": [], "pinned_system": []}
        decode = []
        progress = Progress(name, 3 * len(prompts), enabled=opts.progress)
        for prompt, system, prefix in zip(prompts, systems, standing, strict=True):
            for variant, pin in (("cold", None), ("pinned_system", system), ("pinned", prefix)):
                gen.pinned.clear()
                if pin is not None:
                    gen.pin(variant, pin)
                first, rate = _timed(gen, _job(tok, prompt, opts.decode_tokens))
                ttft[variant].append(first)
                decode.append(rate)
                progress.update(lambda: (len(decode), len(decode) * opts.decode_tokens))
        progress.close()
        runs[name] = {f"ttft_{variant}_s": statistics.median(times) for variant, times in ttft.items()}
        runs[name] |= {"decode_tok_s": statistics.median(decode), "requests": len(prompts),
                       "prompt_tokens": statistics.median(map(len, prompts)),
                       "pinned_tokens": statistics.median(map(len, standing)),
                       "pinned_system_tokens": statistics.median(map(len, systems))}
        if log:
            r = runs[name]
            log(f"{name}: TTFT cold {r['ttft_cold_s']:.3f} s, pinned {r['ttft_pinned_s']:.3f} s, "
                f"pinned system {r['ttft_pinned_system_s']:.3f} s; decode {r['decode_tok_s']:.1f} tok/s")
        del gen, backend
    return {"runs": runs, "ratios": _ratios(runs), "threads": opts.threads, "device": opts.device}


def _timed(gen: Batch1Generator, job: LocalJob) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one request with nothing useful left in the buffer."""
    gen.held = []
    stamps: list[float] = []
    start = time.perf_counter()
    gen.run(job, lambda tokens, text: stamps.extend(time.perf_counter() for _ in tokens))
    return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _job(tok, prompt: list[int], max_tokens: int) -> LocalJob:
    return LocalJob("bench", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    IncrementalDetokenizer(tok))


def _ignore(tokens, text) -> None:
    pass


def _ratios(runs: dict[str, dict]) -> dict[str, float]:
    ratios = {f"{name}_pinned_over_cold": r["ttft_pinned_s"] / r["ttft_cold_s"] for name, r in runs.items()}
    ratios |= {f"{name}_pinned_system_over_cold": r["ttft_pinned_system_s"] / r["ttft_cold_s"]
               for name, r in runs.items()}
    if "onnx-int4" in runs and "torch-none" in runs:
        ratios["onnx-int4_decode_over_torch-none"] = runs["onnx-int4"]["decode_tok_s"] / runs["torch-none"]["decode_tok_s"]
    return ratios


def format_report(report: dict) -> str:
    lines = [f"{'run':<12} {'TTFT cold s':>11} {'pinned s':>9} {'pin/cold':>9} {'sys-only s':>11} "
             f"{'sys/cold':>9} {'decode tok/s':>13}"]
    for name, r in report["runs"].items():
        cold = r["ttft_cold_s"]
        lines.append(f"{name:<12} {cold:>11.3f} {r['ttft_pinned_s']:>9.3f} {r['ttft_pinned_s'] / cold:>9.2f} "
                     f"{r['ttft_pinned_system_s']:>11.3f} {r['ttft_pinned_system_s'] / cold:>9.2f} "
                     f"{r['decode_tok_s']:>13.1f}")
    ratio = report["ratios"].get("onnx-int4_decode_over_torch-none")
    if ratio is not None:
        lines.append(f"onnx-int4 decode / torch-none decode: {ratio:.2f}x (bar: >= 5x)")
    lines.append("bar: pinned/cold TTFT <= 0.20")
    return "\n".join(lines)
