"""cloudd command line: `bench` (trace replay), `chat` (one reply), `serve` (a later issue)."""

from __future__ import annotations

import os

# NOTE: before torch loads: spin-waiting OpenMP threads cost 2-5x on a shared CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from cloudd.trace import bundled_trace  # noqa: E402
from shared.config import load_engine_config  # noqa: E402
from shared.engine.engine_config import EngineConfig  # noqa: E402


def _comma_list(choices: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)} (got {text!r})")
        return items

    return parse


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="daemon TOML ([engine], [scheduler]); flags override it")
    p.add_argument("--model", type=Path, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-batched-tokens", type=int)


def _engine_config(args) -> EngineConfig:
    """The config file (or defaults), then any flag given on the command line."""
    base = load_engine_config(args.config) if args.config else EngineConfig(num_blocks=8192)
    engine = {"dtype": args.dtype, "block_size": args.block_size, "num_blocks": args.num_blocks}
    scheduler = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_batched_tokens}
    return dataclasses.replace(
        base,
        **{k: v for k, v in engine.items() if v is not None},
        scheduler=dataclasses.replace(base.scheduler, **{k: v for k, v in scheduler.items() if v is not None}),
    )


def _model_path(args) -> Path:
    from shared.model.fetch import ensure_default_model

    return args.model or ensure_default_model()


def cmd_bench(args) -> int:
    from cloudd.bench import BenchOptions, run_bench

    opts = BenchOptions(
        trace=args.trace,
        model=_model_path(args),
        engine=_engine_config(args),
        indexes=args.index,
        baseline=args.baseline,
        baseline_batch_size=args.baseline_batch,
        output_len=args.output_len,
        limit=args.limit,
    )
    result = run_bench(opts)
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_chat(args) -> int:
    from shared.engine.engine import Engine
    from shared.engine.sampling_params import SamplingParams

    engine = Engine.from_checkpoint(_model_path(args), _engine_config(args))
    messages = [{"role": "user", "content": args.prompt}]
    rid = engine.submit(messages, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    for delta in engine.stream(rid):
        print(delta.text, end="", flush=True)
    print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cloudd", description="fleetserve's fleet daemon")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="replay a fleet trace through the engine in-process")
    bench.add_argument("--trace", type=Path, default=bundled_trace())
    bench.add_argument("--index", type=_comma_list(("radix", "hashed")), default=("radix",),
                       help="prefix index variants, comma list (radix,hashed)")
    bench.add_argument("--baseline", choices=["hf"], help="also run HF transformers generate() and print the ratio")
    bench.add_argument("--baseline-batch", type=int, default=16)
    bench.add_argument("--output-len", type=int, default=96, help="fixed output tokens per request")
    bench.add_argument("--limit", type=int, help="replay only the first N requests")
    bench.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    _engine_args(bench)
    bench.set_defaults(func=cmd_bench)

    chat = sub.add_parser("chat", help="print one chat reply from the model")
    chat.add_argument("prompt")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    _engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="the ZeroMQ / OpenAI server (not built yet)")
    serve.set_defaults(func=lambda _args: _not_yet("serve"))

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: ModelFetchError, HF baseline
        print(f"cloudd: error: {e}", file=sys.stderr)
        return 2


def _not_yet(command: str) -> int:
    print(f"usage: cloudd {{bench,chat}} ...\n'cloudd {command}' arrives with the fleet server.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
