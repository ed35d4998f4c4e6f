"""edged command line: ``serve`` (the robot daemon), ``export`` (the ONNX graph of a model),
``bench`` (batch-1 TTFT and decode speed per backend and quantization), ``quality`` (what each
quantization costs against the unquantized model)."""

from __future__ import annotations

from shared.config import (SHARED_CPU_SPIN_COUNT, freeze_start_up_heap, keep_freed_memory_in_process,
                           respond_between_steps, set_openmp_wait_defaults)

set_openmp_wait_defaults(SHARED_CPU_SPIN_COUNT)  # NOTE: before torch loads
keep_freed_memory_in_process()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from edged.backends.base import BACKENDS, QUANTS  # noqa: E402
from edged.plan_tiers import TIERS  # noqa: E402
from kernels.block_products import PRODUCTS  # noqa: E402
from shared.cli import comma_list  # noqa: E402

GRAPH_VARIANTS = ("on", "off")


def _model_path(arg: Path | None) -> Path:
    from shared.model.fetch import ensure_default_model

    return arg or ensure_default_model()


def cmd_serve(args) -> int:
    import logging
    import signal

    from edged.config import EdgeConfig
    from edged.daemon import build_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = EdgeConfig.load(args.config) if args.config else EdgeConfig()
    server = build_server(config)
    freeze_start_up_heap()
    respond_between_steps()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    cloud = config.escalation.cloud_endpoint or "none"
    print(f"edged ready: endpoints={','.join(server.endpoints)} model={server.model} backend={config.backend.kind}-"
          f"{config.backend.quant} cloud={cloud}", flush=True)
    server.serve_forever()
    print("edged: stopped", flush=True)
    return 0


def cmd_export(args) -> int:
    from edged.export import export_onnx

    for quant in args.quant:
        out = export_onnx(_model_path(args.model), quant, target=args.target, log=print, products=args.products)
        print(f"{quant}: {out}")
    return 0


def cmd_bench(args) -> int:
    from edged.bench import BenchOptions, check_baseline, format_report, run_bench

    from edged.llamacpp_peer import PeerMissing

    opts = BenchOptions(model=_model_path(args.model), backends=args.backend, quants=args.quant,
                        threads=args.threads, requests=args.requests, decode_tokens=args.decode_tokens,
                        plan_tokens=args.plan_tokens, trace=args.trace, progress=not args.no_progress,
                        device=args.device, cuda_graphs=tuple(v == "on" for v in args.cuda_graphs),
                        speculation=tuple(v == "on" for v in args.speculation), baseline=args.baseline,
                        products=args.products)
    if opts.baseline is not None:
        try:
            check_baseline(opts)
        except (PeerMissing, ValueError) as exc:
            print(f"edged bench: {exc}", file=sys.stderr)
            return 2
    runs = run_bench(opts, log=None if args.json else print)
    print(json.dumps(runs, indent=2) if args.json else format_report(runs))
    return 0


def cmd_plan_eval(args) -> int:
    from edged.plan_eval import HEADER, run_plan_eval

    if args.tiers is not None:
        return _plan_eval_tiers(args)
    if args.cloud_model or args.cloud_config or args.cloud_endpoint or args.config or args.records or args.robot_cpus:
        raise ValueError("--cloud-model, --cloud-config, --cloud-endpoint, --config, --records and --robot-cpus "
                         "go with --tiers")
    if not args.json:
        print(HEADER, flush=True)
    report = run_plan_eval(_model_path(args.model), args.backend, args.quant, args.variants or ("grounded", "free"),
                           args.tasks, args.limit, args.endpoint, args.threads, log=None if args.json else print)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _plan_eval_tiers(args) -> int:
    from edged.config import SHIPPED_CONFIG, EdgeConfig
    from edged.plan_eval import HEADER
    from edged.plan_tiers import TierOptions, json_lines, run_tiers
    from shared.cpu_affinity import parse_cpu_list
    from shared.model.fetch import resolve_model

    if args.endpoint or len(args.backend) > 1 or len(args.quant) > 1:
        raise ValueError("--tiers runs one --backend and one --quant on the robot, and no --endpoint")
    options = TierOptions(tiers=args.tiers, backend=args.backend[0], quant=args.quant[0],
                          cloud_model=resolve_model(args.cloud_model).resolve() if args.cloud_model else None,
                          cloud_config=args.cloud_config, cloud_endpoint=args.cloud_endpoint,
                          escalation=EdgeConfig.load(args.config or SHIPPED_CONFIG).escalation,
                          robot_cpus=parse_cpu_list(args.robot_cpus) if args.robot_cpus else None)
    if not args.json:
        print(HEADER, flush=True)
    with json_lines(args.records) as record:
        report = run_tiers(_model_path(args.model), options, args.variants or ("grounded",), args.tasks, args.limit,
                           args.threads, log=None if args.json else print, record=record)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def cmd_quality(args) -> int:
    from edged.backends.factory import make_backend
    from edged.quality import format_table, quality_report

    specs = [(kind, quant) for kind in args.backend for quant in args.quant]
    rows = quality_report(_model_path(args.model), specs, make_backend=functools.partial(make_backend,
                                                                                        products=args.products))
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="edged", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the robot daemon")
    s.add_argument("--config", type=Path, help="edged TOML (default: built-in defaults)")
    s.set_defaults(func=cmd_serve)
    e = sub.add_parser("export", help="build (or find cached) ONNX graphs of the model")
    e.add_argument("--model", type=Path, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    e.add_argument("--quant", type=comma_list(QUANTS), default=("int4",))
    e.add_argument("--target", choices=["cpu", "cuda"], default="cpu")
    e.add_argument("--products", choices=PRODUCTS, default="auto", help="the int4 CPU graph's block products")
    e.set_defaults(func=cmd_export)
    b = sub.add_parser("bench", help="batch-1 TTFT (cold, pinned) and decode tok/s, every combination")
    b.add_argument("--model", type=Path)
    b.add_argument("--backend", type=comma_list(BACKENDS), default=("onnx", "torch"))
    b.add_argument("--quant", type=comma_list(QUANTS), default=("none", "int8", "int4"))
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--requests", type=int, default=5, help="plan requests per run (medians over them)")
    b.add_argument("--decode-tokens", type=int, default=64)
    b.add_argument("--plan-tokens", type=int, default=256, help="max_tokens of the timed plan requests")
    b.add_argument("--speculation", type=comma_list(GRAPH_VARIANTS), default=("on",),
                   help="speculative decoding variants, comma list (on,off); 'off' runs are named '-plain'")
    b.add_argument("--baseline", choices=["llamacpp"], default=None,
                   help="also run llama.cpp (../shared/peers/llamacpp) on the same GGUF and requests")
    b.add_argument("--trace", type=Path, default=Path("../shared/workloads/fleet-256.jsonl"))
    b.add_argument("--products", type=comma_list(PRODUCTS), default=("auto",),
                   help="int4's block products on a CPU (a run each): auto, float32, bfloat16")
    b.add_argument("--json", action="store_true")
    b.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    b.add_argument("--cuda-graphs", type=comma_list(GRAPH_VARIANTS), default=("on",),
                   help="torch on cuda: decode graph variants, comma list (on,off); 'off' runs are named '-eager'")
    b.set_defaults(func=cmd_bench)
    v = sub.add_parser("plan-eval", help="plan quality on the bundled robot tasks (valid, grounded, meets the task)")
    v.add_argument("--model", type=Path, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    v.add_argument("--backend", type=comma_list(BACKENDS), default=("onnx",))
    v.add_argument("--quant", type=comma_list(QUANTS), default=("int4",))
    v.add_argument("--variants", type=comma_list(("grounded", "free")), default=None,
                   help="grounded: scene names as enums (robot_sdk's default); free: the same arguments as free "
                        "text (default: both; grounded only with --tiers)")
    v.add_argument("--tasks", type=Path, default=None, help="a task file (default: edged/data/plan_tasks.json)")
    v.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    v.add_argument("--endpoint", default=None, help="ask a running edged or cloudd through robot_sdk instead")
    v.add_argument("--threads", type=int, default=None,
                   help="the robot model's threads (default: edged's, 2; with --robot-cpus, one per robot CPU)")
    v.add_argument("--tiers", type=comma_list(TIERS), default=None,
                   help="compare edge (the robot alone), cloud (cloudd alone) and hybrid (edged escalating to "
                        "cloudd), comma list")
    v.add_argument("--cloud-model", default=None,
                   help="the tiers' cloud: start cloudd on loopback on this GGUF / HF folder or model name "
                        "(qwen2.5-coder-1.5b: fetched once)")
    v.add_argument("--cloud-config", type=Path, default=None,
                   help="the started cloudd's TOML ([engine] device, dtype, compile, ...; default: cloudd's defaults "
                        "with the kernels of the shipped configs/cloudd.toml)")
    v.add_argument("--cloud-endpoint", default=None, help="the tiers' cloud: a running cloudd (no CURVE)")
    v.add_argument("--config", type=Path, default=None,
                   help="an edged TOML whose [escalation] rules the hybrid tier runs (default: configs/edged.toml, "
                        "the shipped robot config)")
    v.add_argument("--robot-cpus", default=None,
                   help="with --tiers: split the machine as deployed: the robot's side on these CPUs (e.g. 0 or "
                        "0-1), a cloud started here on all the others; default: both share every CPU")
    v.add_argument("--records", type=Path, default=None,
                   help="with --tiers: write every answer and its outcome here, one JSON line each")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_plan_eval)
    q = sub.add_parser("quality", help="perplexity and greedy agreement of each quantization")
    q.add_argument("--model", type=Path)
    q.add_argument("--backend", type=comma_list(BACKENDS), default=("onnx",))
    q.add_argument("--quant", type=comma_list(QUANTS), default=("none", "int8", "int4", "int4-a8"))
    q.add_argument("--products", choices=PRODUCTS, default="auto", help="int4's block products on a CPU")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_quality)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"edged: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
