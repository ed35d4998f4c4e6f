"""``python -m cloudd.llamacpp_agreement --model NAME_OR_PATH``: our engine against llama-server
on the same GGUF and prompts (see the package docstring). Exit status 2 when llama.cpp's build
or the model is missing."""

from __future__ import annotations

import argparse
import json
import os
import sys

from cloudd.llamacpp_agreement.agreement import NEAR_TIE_NATS
from cloudd.llamacpp_agreement.prompts import PROMPT_SETS, named_prompts
from cloudd.llamacpp_agreement.report import as_json, format_table
from cloudd.llamacpp_agreement.run import measure
from edged.llamacpp_peer import PeerMissing
from shared.model.checkpoint import load_checkpoint
from shared.model.fetch import resolve_model


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        prompts = named_prompts(_names(args.prompts), args.plan_eval_tasks)
        ckpt = load_checkpoint(resolve_model(args.model))
        results = measure(ckpt, prompts, _names(args.dtype), args.tokens, args.threads,
                          log=lambda m: print(m, file=sys.stderr, flush=True))
    except (PeerMissing, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def name(token: int) -> str:
        return ckpt.tokenizer.decode([token], skip_special_tokens=False)

    if args.json:
        print(json.dumps(as_json(str(ckpt.source), results, name, args.near_tie)))
    else:
        print(format_table(results, name, args.near_tie))
    return 0


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cloudd.llamacpp_agreement", description=__doc__)
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a known model name or a GGUF path")
    p.add_argument("--prompts", default=",".join(PROMPT_SETS), help=f"comma-separated, of {', '.join(PROMPT_SETS)}")
    p.add_argument("--plan-eval-tasks", type=int, default=10, help="plan-eval's first K tasks (default 10)")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    p.add_argument("--dtype", default="float32,bfloat16", help="our compute dtypes, comma-separated")
    # NOTE: half the cores: llama.cpp's threads spin while they wait for each other, and on cores
    # shared with our model or other jobs that made its decode 5x slower (2 threads on 2 busy cores).
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="llama-server's threads (default: half the cores)")
    p.add_argument("--near-tie", type=float, default=NEAR_TIE_NATS, help="a near-tie's largest margin, nats")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


if __name__ == "__main__":
    sys.exit(main())
