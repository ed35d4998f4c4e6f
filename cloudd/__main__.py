"""cloudd command line: `serve` (the fleet server), `bench` (trace replay in-process, against
running servers or through cluster replicas, or the online pair against vLLM's server:
``cloudd.bench_modes``), `chat` (one reply), and the cluster, agreement and API-key commands."""

from __future__ import annotations

from shared.config import (SERVER_SPIN_COUNT, freeze_start_up_heap, keep_freed_memory_in_process,
                           respond_between_steps, set_openmp_wait_defaults)

set_openmp_wait_defaults(SERVER_SPIN_COUNT)  # NOTE: before torch loads
keep_freed_memory_in_process()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from cloudd.assembly import (build_serving_engine, engine_config_from, engine_note, model_path_from,  # noqa: E402
                             replica_args, serve_argv)
from cloudd.bench_modes import CLUSTER, ONLINE, SERVE, bench_mode  # noqa: E402
from cloudd.online_peer import OnlineOptions, OnlineWorkload, run_online  # noqa: E402
from cloudd.peer_baseline import VllmPeer  # noqa: E402
from cloudd.trace import bundled_trace  # noqa: E402
from kernels.kv_layout import LAYOUTS  # noqa: E402
from shared.cli import comma_list  # noqa: E402
from shared.engine.dtype_choice import DTYPE_NAMES  # noqa: E402
from shared.engine.kernel_choice import KernelSpec  # noqa: E402


OUTPUT_LEN = 96  # bench's output tokens per request, unless --output-len says


def _url_list(text: str) -> tuple[str, ...]:
    urls = tuple(x.strip() for x in text.split(",") if x.strip())
    if not urls:
        raise argparse.ArgumentTypeError(f"expected URL[,URL...] (got {text!r})")
    return urls


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="daemon TOML ([engine], [scheduler]; bench --online hands it to "
                                               "cloudd serve, which reads every table); flags override it")
    p.add_argument("--model", help="a known model name (python -m shared.model.fetch --list: fetched once) or a "
                                   "GGUF file / HF folder (default: the config's [model] name, else the "
                                   "embedded SmolLM2-135M)")
    p.add_argument("--dtype", choices=list(DTYPE_NAMES),
                   help="auto (default): bfloat16 on CUDA or a CPU with AVX-512 BF16/AMX, else float32")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="the layers' dense halves through torch.compile at start-up (default: the "
                        "config's [engine] compile, else on for serve and bench)")
    p.add_argument("--device", help="cpu (default) | cuda | cuda:N: model, KV pool and step tensors")
    p.add_argument("--kernels", type=_kernels_arg,
                   help="auto (default): Triton on CUDA, torch (with the C++ CPU kernels) on a CPU, each CPU "
                        "operation's implementation timed at start-up; then operation=implementation items "
                        "force one: 'auto,dense=packed,prefill_attention=gemm'")
    p.add_argument("--time-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="on a CPU, time each operation's implementations on the model at start-up and keep the "
                        "fastest, cached per CPU and model (default: the config's [engine] time_kernels, else on "
                        "for serve and bench); off: each takes its first implementation unless --kernels forces one")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode-only steps replay CUDA graphs (default on; Triton kernels on CUDA only)")
    p.add_argument("--kv-layout", choices=list(LAYOUTS),
                   help="KV pool layout: auto (default: paired where the CPU decode kernel reads it in bf16) | tokens | paired")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-batched-tokens", type=int)


def _output_len(args) -> int:
    """``--output-len``, else the in-process and cluster benches' OUTPUT_LEN (``--online`` has its
    client's own default)."""
    return OUTPUT_LEN if args.output_len is None else args.output_len


def _kernels_arg(text: str) -> str:
    try:
        KernelSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_bench(args) -> int:
    mode = bench_mode(args.online, bool(args.serve), args.cluster)
    mode.check_given(_bench_flags_given(args))
    if mode is ONLINE:
        return _cmd_online_bench(args)
    if mode is SERVE:
        return _cmd_serve_bench(args)
    if mode is CLUSTER:
        return _cmd_cluster_bench(args)
    from cloudd.bench import BenchOptions, run_bench

    opts = BenchOptions(
        trace=args.trace,
        model=model_path_from(args),
        engine=engine_config_from(args, offline=True),
        indexes=args.index,
        response_formats=args.response_format,
        baselines=args.baseline or (),
        baseline_batch_size=args.baseline_batch,
        output_len=_output_len(args),
        limit=args.limit,
        robots=args.robots,
        tiers=args.tiers,
        device_pool_frac=args.device_pool_frac,
        peers_dir=args.peers_dir,
        progress=not args.no_progress,
        profile=args.profile,
    )
    result = run_bench(opts)
    if args.json:
        print(json.dumps(result))
    return 0


@contextlib.contextmanager
def _stdout_to_stderr():
    """Everything written to stdout meanwhile (Python's and the file descriptor's) goes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _cmd_cluster_bench(args) -> int:
    """`bench --cluster`: the report blocks go to stderr; stdout gets the JSON (--json) or a summary."""
    from cloudd.cluster.bench import ClusterBenchOptions, run_cluster_bench
    from cloudd.cluster.config import ClusterConfig
    from shared.config import load_section

    cluster = load_section(args.config, "cluster", ClusterConfig) if args.config else ClusterConfig()
    cluster = dataclasses.replace(cluster, replicas=args.replicas or cluster.replicas)
    opts = ClusterBenchOptions(args.trace, cluster, args.router, replica_args(args), _output_len(args), args.limit,
                               args.rate_scale, args.device_pool_frac)
    with _stdout_to_stderr():  # NOTE: Ray's own messages ("(raylet) Task ... failed") print to stdout
        result = run_cluster_bench(opts, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(result))
    else:
        for router, r in result["runs"].items():
            print(f"{router}: prefix hit {r['prefix_hit_rate']:.3f}, {r['output_tok_s']:.1f} output tok/s")
        single = result["single_replica"]["prefix_hit_rate"]
        print(f"one replica{' with the combined pool' if 'pool' in result else ''}: prefix hit {single:.3f}")
    return 0


def _cmd_online_bench(args) -> int:
    """`bench --online --baseline vllm`: the report goes to stderr; stdout gets the JSON (--json)
    or the verdict on the bars."""
    if args.baseline != ("vllm",):
        raise ValueError("--online compares cloudd serve with vLLM's server: give --baseline vllm (alone)")
    model = model_path_from(args)
    given = {"num_prompts": args.limit, "output_len": args.output_len}
    workload = OnlineWorkload(request_rate=args.request_rate, **{k: v for k, v in given.items() if v is not None})
    opts = OnlineOptions(
        peer=VllmPeer.located(model, args.peers_dir),
        serve_args=tuple(serve_argv(args)), dtype=engine_config_from(args).dtype_choice.name,
        model_name=model.stem, workload=workload, pairs=args.pairs)
    result = run_online(opts, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(result))
    else:
        met = result["bars_met"]
        print("online bars: " + ", ".join(f"{name} {'met' if ok else 'missed'}" for name, ok in met.items()))
    return 0


def _cmd_serve_bench(args) -> int:
    """`bench --serve`: the human-readable report goes to stdout, or to stderr with --json."""
    from cloudd.serve_bench import ServeBenchOptions, run_serve_bench

    opts = ServeBenchOptions(trace=args.trace, urls=args.serve, rate_scale=args.rate_scale, limit=args.limit)
    out = sys.stderr if args.json else sys.stdout
    result = run_serve_bench(opts, log=lambda msg: print(msg, file=out, flush=True))
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_api_key(args) -> int:
    from cloudd.api_keys import make_key

    token = make_key(args.file, args.name)
    print(f"API key for {args.name} (shown once; {args.file} keeps only its hash):\n{token}")
    return 0


def cmd_serve(args) -> int:
    import logging
    import signal

    from cloudd.http_api import start_http_api
    from cloudd.server import CloudServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serving = build_serving_engine(args)
    engine, serve, model_name = serving.engine, serving.serve, serving.model_name
    freeze_start_up_heap()
    respond_between_steps()
    server = CloudServer(engine, serve, model_name=model_name)
    http = start_http_api(serve, server, serving.tokenizer, server.metrics, model_name)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    signal.signal(signal.SIGHUP, lambda *_: (server.reload_keys(), http.reload_keys()))
    host, port = http.server.server_address[:2]
    print(f"cloudd ready: zmq={server.endpoint} http=http://{host}:{port} {engine_note(serving)}", flush=True)
    try:
        server.serve_forever()
    finally:
        http.close()
        engine.close()  # after the loop returned: no step races the tier copier's last copies
    print("cloudd: stopped", flush=True)
    return 0


def cmd_cluster_serve(args) -> int:
    """`cluster serve`: replicas on Ray Serve behind the fleet router (cloudd.cluster)."""
    import logging

    from cloudd.cluster.app import serve_cluster
    from cloudd.cluster.config import ClusterConfig
    from cloudd.server import ServeConfig
    from shared.config import load_section

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cluster = load_section(args.config, "cluster", ClusterConfig) if args.config else ClusterConfig()
    overrides = {"replicas": args.replicas, "router": args.router}
    cluster = dataclasses.replace(cluster, **{k: v for k, v in overrides.items() if v is not None})
    serve = load_section(args.config, "serve", ServeConfig) if args.config else ServeConfig()
    replicas = replica_args(args)
    return serve_cluster(cluster, replicas, replicas["model"],
                         {"zmq_port": args.zmq_port, "http_port": args.http_port}, serve)


def cmd_cluster_status(args) -> int:
    """`cluster status`: the front's replicas and router decisions."""
    from rich.console import Console

    from cloudd.fleetctl import replicas_table, status_panel
    from shared.transport.client import ClientConfig, FleetClient

    with FleetClient(args.endpoint, ClientConfig(timeout_s=args.timeout, retries=0)) as client:
        snap = client.stats(args.timeout)
    if "cluster" not in snap:
        raise ValueError(f"{args.endpoint} is a single cloudd, not a cluster front (see fleetctl status)")
    if args.json:
        print(json.dumps(snap["cluster"], indent=2))
    else:
        Console().print(status_panel(snap) if args.verbose else replicas_table(snap))
    return 0


def cmd_agreement(args) -> int:
    from cloudd.dtype_agreement import format_agreement, measure_agreement
    from cloudd.trace import load_trace
    from shared.model.checkpoint import load_checkpoint

    if args.dtype in (None, "auto", "float32"):
        raise ValueError("--dtype must name the dtype compared with float32 (bfloat16 or float16)")
    ckpt = load_checkpoint(model_path_from(args))
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    result = measure_agreement(ckpt, load_trace(args.trace, args.limit), args.dtype, args.tokens,
                               engine_config_from(args, compile_by_default=False), log)
    print(json.dumps(result.as_dict()) if args.json else format_agreement(result))
    return 0


def cmd_chat(args) -> int:
    from shared.engine.engine import Engine
    from shared.engine.sampling_params import SamplingParams

    engine = Engine.from_checkpoint(model_path_from(args), engine_config_from(args, compile_by_default=False))
    messages = [{"role": "user", "content": args.prompt}]
    rid = engine.submit(messages, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    for delta in engine.stream(rid):
        print(delta.text, end="", flush=True)
    print()
    return 0


def _bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`bench`'s flags, all four modes' (``cloudd.bench_modes`` says which mode reads which)."""
    p.add_argument("--trace", type=Path, default=bundled_trace())
    p.add_argument("--index", type=comma_list(("radix", "hashed")), default=("radix",),
                   help="prefix index variants, comma list (radix,hashed)")
    p.add_argument("--response-format", type=comma_list(("none", "plan-schema")), default=("none",),
                   help="structured-output variants, comma list (none,plan-schema)")
    p.add_argument("--baseline", type=comma_list(("hf", "vllm")),
                   help="also run baselines on the same requests and print the ratios, comma list: hf "
                        "(HF transformers generate()), vllm (the vLLM CPU peer: runs.vllm and vs_vllm; "
                        "set up by ../shared/peers/vllm-cpu/setup.sh)")
    p.add_argument("--peers-dir", type=Path,
                   help="the peers' scripts (default: $FLEETSERVE_PEERS_DIR, else ../shared/peers beside "
                        "the repo); the peers themselves install under $PEERS_DIR")
    p.add_argument("--baseline-batch", type=int, default=16)
    p.add_argument("--output-len", type=int,
                   help=f"fixed output tokens per request (default {OUTPUT_LEN}; with --online the client's, "
                        f"default {OnlineWorkload.output_len})")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--robots", type=int, help="replay only the first N robots' requests (whole histories)")
    p.add_argument("--tiers", type=comma_list(("off", "on", "layerwise")), default=("off",),
                   help="HiCache KV tiers variants, comma list (off,on,layerwise: on with every host "
                        "load run layer by layer); [hicache] in --config sizes them")
    p.add_argument("--device-pool-frac", type=float,
                   help="KV pool as a fraction of the replayed requests' working set (overrides --num-blocks); "
                        "with --cluster each replica's, and the single replica gets them combined")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--profile", action="store_true",
                   help="time each step's phases (model, attention, sampling, scheduling, detokenizing) and "
                        "report the model's FLOP/s against this machine's matmul peak (JSON: runs.<v>.profile)")
    p.add_argument("--serve", type=_url_list, metavar="URL[,URL...]",
                   help="replay against running servers (tcp://, ipc:// or http://), one run per URL, "
                        "with the trace's arrival times; uses --trace, --limit, --rate-scale, --json")
    p.add_argument("--online", action="store_true",
                   help="with --baseline vllm: cloudd serve (these engine flags, per-robot quotas off) and vLLM's "
                        "server one after the other, each driven by vLLM's own client (bench serve, serve.sh's "
                        "workload: 4 shared 448-token prefixes; --limit prompts, default 160, at --request-rate); "
                        "prints request rate, TTFT p50/p99 and TPOT p50 of each and cloudd's ratios to the online bars")
    p.add_argument("--request-rate", type=float, default=OnlineWorkload.request_rate,
                   help="with --online: requests a second (Poisson arrivals)")
    p.add_argument("--pairs", type=int, default=1,
                   help="with --online: run the two servers this many times, the order alternating; the bars "
                        "are judged on the median ratios")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="with --serve or --cluster: arrival-rate multiplier (2: requests come twice as fast)")
    p.add_argument("--cluster", action="store_true",
                   help="replay through cloudd cluster replicas under each --router, and through one replica "
                        "(Ray; run inside `unshare -n`: make bench-cluster); uses --trace, --limit, --output-len, "
                        "--rate-scale, --config's [cluster]")
    p.add_argument("--replicas", type=int, help="with --cluster: replicas per run (default [cluster] replicas)")
    p.add_argument("--router", type=comma_list(("fleet", "hash", "pow2")), default=("fleet", "pow2"),
                   help="with --cluster: router variants, comma list (fleet,hash,pow2)")
    _engine_args(p)
    return p


def bench_flag_defaults() -> dict:
    """Every `bench` flag (argparse dest) with its default."""
    return vars(_bench_args(argparse.ArgumentParser()).parse_args([]))


def _bench_flags_given(args) -> set[str]:
    """The bench flags this command line set away from their defaults (argparse dests)."""
    return {dest for dest, default in bench_flag_defaults().items() if getattr(args, dest) != default}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cloudd", description="fleetserve's fleet daemon")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="replay a fleet trace through the engine in-process, against running "
                                         "servers (--serve) or cluster replicas (--cluster); or cloudd serve and "
                                         "vLLM's server under vLLM's client (--online)")
    _bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    agreement = sub.add_parser("agreement", help="greedy and top-1 agreement of a dtype (--dtype) with float32")
    agreement.add_argument("--trace", type=Path, required=True, help="e.g. ../shared/workloads/fleet-256.jsonl")
    agreement.add_argument("--limit", type=int, default=100, help="the first N requests (default 100)")
    agreement.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    agreement.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    _engine_args(agreement)
    agreement.set_defaults(func=cmd_agreement)

    chat = sub.add_parser("chat", help="print one chat reply from the model")
    chat.add_argument("prompt")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    _engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="the fleet server: ZeroMQ protocol, OpenAI HTTP, /metrics")
    serve.add_argument("--zmq-port", type=int, help="ZeroMQ ROUTER port on loopback (0: any free port)")
    serve.add_argument("--http-port", type=int, help="OpenAI / health / metrics HTTP port (0: any free port)")
    serve.add_argument("--no-robot-quotas", action="store_true",
                       help="no per-robot quota (requests a second, tokens a minute, in flight), whatever the config "
                            "says: for a load test from one anonymous client, which the quotas count as one robot")
    serve.add_argument("--policy", choices=["fleet", "fcfs"], default="fleet",
                       help="scheduling: fleet (classes, deadlines, fairness; default) or fcfs (a baseline)")
    _engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    cluster = sub.add_parser("cluster", help="cloudd replicas on Ray Serve behind the fleet router")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    cluster_serve = cluster_sub.add_parser("serve", help="start (or join) Ray, the replicas and the front")
    cluster_serve.add_argument("--zmq-port", type=int, help="the front's ZeroMQ port on loopback (0: any free port)")
    cluster_serve.add_argument("--http-port", type=int, help="the front's OpenAI HTTP port (0: any free port)")
    cluster_serve.add_argument("--replicas", type=int, help="replicas at start ([cluster] replicas)")
    cluster_serve.add_argument("--router", choices=["fleet", "hash", "pow2"], help="[cluster] router")
    _engine_args(cluster_serve)
    cluster_serve.set_defaults(func=cmd_cluster_serve)
    cluster_status = cluster_sub.add_parser("status", help="the replicas and the router's decisions")
    cluster_status.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the front's ZeroMQ endpoint")
    cluster_status.add_argument("--timeout", type=float, default=15.0)
    cluster_status.add_argument("--json", action="store_true", help="print the cluster part of the stats as JSON")
    cluster_status.add_argument("--verbose", action="store_true", help="the whole status panel (fleetctl status)")
    cluster_status.set_defaults(func=cmd_cluster_status)

    api_key = sub.add_parser("api-key", help="make an HTTP API key: prints the token once, appends its hash to FILE")
    api_key.add_argument("name", help="the key's name: requests with it are served as this robot_id")
    api_key.add_argument("--file", required=True, help="the key file ([serve] http_api_keys)")
    api_key.set_defaults(func=cmd_api_key)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: ModelFetchError, HF baseline
        print(f"cloudd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
