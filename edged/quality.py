"""What a quantization costs: perplexity on a fixed text and greedy agreement on plan prompts,
each backend measured against the unquantized reference, through the Batch1Backend protocol only.

- **nll / ppl**: the bundled text (``edged/data/quality_text.txt``) teacher-forced one token per
  forward, as edged decodes (``edged.generation.forward_tokens``: with the token before it on a
  graph that is not row-exact); nll is the mean negative log-likelihood of each next token (nats).
- **top1**: share of the text's positions where the argmax equals the reference's argmax.
- **greedy**: per plan prompt, the greedy continuation of ``greedy_tokens`` tokens; ``greedy_prefix``
  is the mean share of leading tokens equal to the reference's (tokens after the first
  difference do not count), ``greedy_exact`` the share of prompts equal all the way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from edged.backends.base import Batch1Backend
from edged.backends.factory import make_backend as factory_backend
from edged.generation import forward_tokens
from shared.engine.kv.radix import common_prefix_len

QUALITY_TEXT = Path(__file__).parent / "data" / "quality_text.txt"
PLAN_PROMPTS = (
    "Plan how a warehouse robot brings crate 17 from aisle 4 to the packing station.",
    "The kitchen robot must load the dishwasher and then wipe the table. List the steps.",
    "A delivery robot finds its path blocked by a closed door. What should it do next?",
    "Plan a safe route for a cleaning robot through a hallway where people are walking.",
    "The robot arm dropped a box. Write a short plan to recover and report the error.",
)
DEFAULT_SPECS = (("onnx", "none"), ("onnx", "int8"), ("onnx", "int4"), ("onnx", "int4-a8"))


@dataclass
class _Trace:
    """What one backend produced: per-position argmax and nll over the text, greedy ids per prompt."""

    argmax: list[int]
    nll: list[float]
    greedy: list[list[int]]
    seconds: float


def measure(backend: Batch1Backend, text_ids: Sequence[int], prompts: Sequence[Sequence[int]],
            greedy_tokens: int) -> _Trace:
    """Teacher-force ``text_ids`` and run greedy decoding on each prompt (a fresh sequence each)."""
    t0 = time.perf_counter()
    argmax, nll = [], []
    for pos in range(len(text_ids) - 1):
        logits = forward_tokens(backend, [text_ids[pos]], pos, text_ids[pos - 1] if pos else None, False)[0]
        argmax.append(int(logits.argmax()))
        nll.append(-float(torch.log_softmax(logits, dim=-1)[text_ids[pos + 1]]))
    greedy = [greedy_ids(backend, prompt, greedy_tokens) for prompt in prompts]
    return _Trace(argmax, nll, greedy, time.perf_counter() - t0)


def greedy_ids(backend: Batch1Backend, prompt: Sequence[int], n: int) -> list[int]:
    """The ``n`` greedy tokens after ``prompt`` (prefilled in one forward), eos not special-cased."""
    logits = backend.forward(list(prompt), 0)
    out: list[int] = []
    for step in range(n):
        out.append(int(logits.argmax()))
        if step + 1 < n:
            before = out[-2] if step else prompt[-1]
            logits = forward_tokens(backend, [out[-1]], len(prompt) + step, before, False)[0]
    return out


def compare(name: str, quant: str, trace: _Trace, ref: _Trace) -> dict:
    """One report row: ``trace``'s figures, with agreement measured against ``ref``."""
    nll = sum(trace.nll) / len(trace.nll)
    prefixes = [common_prefix_len(a, b) / len(b) for a, b in zip(trace.greedy, ref.greedy)]
    return {
        "backend": name, "quant": quant,
        "nll": round(nll, 4), "ppl": round(math.exp(nll), 3),
        "nll_delta": round(nll - sum(ref.nll) / len(ref.nll), 4),
        "top1": round(sum(a == b for a, b in zip(trace.argmax, ref.argmax)) / len(ref.argmax), 4),
        "greedy_prefix": round(sum(prefixes) / len(prefixes), 4),
        "greedy_exact": round(sum(p == 1.0 for p in prefixes) / len(prefixes), 4),
        "seconds": round(trace.seconds, 1),
    }


def quality_report(model_path: Path | str, specs: Sequence[tuple[str, str]] = DEFAULT_SPECS,
                   reference: tuple[str, str] | None = None, greedy_tokens: int = 32, threads: int = 2,
                   make_backend: Callable[..., Batch1Backend] | None = None,
                   log: Callable[[str], None] | None = None) -> list[dict]:
    """Rows (one per ``(backend, quant)`` in ``specs``) of nll/ppl/top1/greedy agreement.

    ``reference`` (default: the first spec whose quant is "none", else ("torch", "none")) is the
    unquantized model everything is compared with; it is measured once and reported as a row too
    when it is in ``specs``. ``make_backend(kind, quant, checkpoint, model_path, max_len, threads)``
    builds a backend (default ``edged.backends.factory.make_backend``, exporting ONNX graphs as needed).
    """
    from shared.model.checkpoint import load_checkpoint

    say = log or (lambda _msg: None)
    make = make_backend or factory_backend
    model_path = Path(model_path).expanduser()
    checkpoint = load_checkpoint(model_path)
    tokenizer = checkpoint.tokenizer
    text_ids = tokenizer.encode(QUALITY_TEXT.read_text(encoding="utf-8"))
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PLAN_PROMPTS]
    max_len = max(len(text_ids), *(len(p) + greedy_tokens for p in prompts))
    reference = reference or next((s for s in specs if s[1] == "none"), ("torch", "none"))
    traces: dict[tuple[str, str], _Trace] = {}
    for spec in (reference, *[s for s in specs if s != reference]):
        say(f"measuring {spec[0]} {spec[1]} ...")
        backend = make(spec[0], spec[1], checkpoint, model_path, max_len, threads)
        traces[spec] = measure(backend, text_ids, prompts, greedy_tokens)
        del backend
        say(f"  {compare(*spec, traces[spec], traces[reference])}")
    return [compare(kind, quant, traces[(kind, quant)], traces[reference]) for kind, quant in specs]


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a markdown table (what docs/edged.md quotes)."""
    head = "| backend | quant | NLL (nat) | ppl | ΔNLL | top-1 vs ref | greedy prefix | greedy exact |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['quant']} | {r['nll']:.3f} | {r['ppl']:.2f} | {r['nll_delta']:+.3f} "
                     f"| {r['top1']:.1%} | {r['greedy_prefix']:.1%} | {r['greedy_exact']:.0%} |")
    return "\n".join(lines)

