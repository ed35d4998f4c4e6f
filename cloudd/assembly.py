"""Assemble cloudd's serving engine from its engine arguments (``cloudd serve``'s flags, or the
dict a cluster replica is given as a namespace): the model, the engine with the config's policy,
the configured grammars compiled and one warm-up step run.

The caller sets the process's OpenMP defaults before importing this module (it loads torch).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from shared.config import load_engine_config, load_section
from shared.engine.engine_config import EngineConfig

if TYPE_CHECKING:
    from cloudd.server import ServeConfig
    from shared.engine.engine import Engine
    from shared.model.summary import ModelSummary
    from shared.model.tokenizer import Tokenizer


# Offline replay without a config batches for throughput, as vLLM's offline LLM does: every
# request may run at once (the trace's 256) and a step computes up to 2,048 tokens.
OFFLINE_SCHEDULER = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}


def engine_config_from(args, offline: bool = False, compile_by_default: bool = True) -> EngineConfig:
    """The config file (or defaults; ``offline``: OFFLINE_SCHEDULER's; compiled layers unless a
    one-off command would wait on the compiler for nothing), then any flag given on the command
    line."""
    from shared.engine.scheduler import SchedulerConfig

    base = load_engine_config(args.config) if args.config else EngineConfig(
        num_blocks=8192, compile=compile_by_default, time_kernels=compile_by_default,
        scheduler=SchedulerConfig(**OFFLINE_SCHEDULER) if offline else SchedulerConfig())
    if args.config:
        from shared.engine.kv.hicache_config import HiCacheConfig

        base = dataclasses.replace(base, hicache=load_section(args.config, "hicache", HiCacheConfig))
    engine = {"dtype": args.dtype, "compile": args.compile, "block_size": args.block_size,
              "num_blocks": args.num_blocks, "device": args.device, "kernels": args.kernels,
              "time_kernels": args.time_kernels,
              "cuda_graphs": args.cuda_graphs, "kv_layout": args.kv_layout}
    scheduler = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_batched_tokens}
    return dataclasses.replace(
        base,
        **{k: v for k, v in engine.items() if v is not None},
        scheduler=dataclasses.replace(base.scheduler, **{k: v for k, v in scheduler.items() if v is not None}),
    )


@dataclasses.dataclass(frozen=True)
class ModelTable:
    """The ``[model]`` table of cloudd's config: what the fleet tier serves."""

    name: str = ""  # a known model name (fetched and checked once) or a GGUF file / HF folder; "" = the default


def model_path_from(args) -> Path:
    """``--model``, else the config's ``[model] name``, else the embedded default model: a known
    name is fetched (``shared.model.fetch.resolve_model``); ValueError for anything else."""
    from shared.model.fetch import ensure_default_model, resolve_model

    spec = args.model or (load_section(args.config, "model", ModelTable).name if getattr(args, "config", None) else "")
    return resolve_model(spec) if spec else ensure_default_model()


@dataclasses.dataclass
class ServingEngine:
    """What ``cloudd serve`` (and each cluster replica) runs: the engine, warmed up, and the config."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    serve: ServeConfig
    policy: str  # "fleet" | "fcfs"
    warm_up_s: float


def build_serving_engine(args) -> ServingEngine:
    """The model, the engine with the config's policy, the configured grammars compiled and one
    warm-up step run: ready for the first request."""
    import concurrent.futures

    from shared.engine.engine import Engine
    from shared.engine.policy import FCFS, FleetPolicy, FleetPolicyConfig
    from shared.model.weight_cache import load_model

    serve = serve_config_from(args)
    policy_config = load_section(args.config, "policy", FleetPolicyConfig) if args.config else FleetPolicyConfig()
    policy = FCFS() if args.policy == "fcfs" else FleetPolicy(policy_config)

    model_path = model_path_from(args)
    engine_config = engine_config_from(args)
    model, ckpt = load_model(model_path, engine_config.torch_dtype)
    engine = Engine(model, ckpt.tokenizer, engine_config, policy=policy)
    # NOTE: the configured grammars finish compiling before the first request: a compile still
    # running takes a core from the first steps (measured: a first step of 234 ms, not 22)
    concurrent.futures.wait(engine.precompile(_response_formats(serve.precompile)))
    warm_up_s = engine.warm_up()
    return ServingEngine(engine, ckpt.tokenizer, model_path.stem, serve, args.policy, warm_up_s)


def serve_config_from(args) -> ServeConfig:
    """The config's ``[serve]`` table (defaults without one) with the command's ports and, where
    it says ``no_robot_quotas``, no per-robot quota."""
    from cloudd.server import ServeConfig

    serve = load_section(args.config, "serve", ServeConfig) if args.config else ServeConfig()
    ports = {"zmq_port": args.zmq_port, "http_port": args.http_port}
    serve = dataclasses.replace(serve, **{k: v for k, v in ports.items() if v is not None})
    return serve.without_robot_quotas() if getattr(args, "no_robot_quotas", False) else serve


def engine_note(serving: ServingEngine) -> str:
    """What the engine runs and how it started, for a ready line (``model=<stem> (<arch>, <n>
    params)`` first)."""
    engine = serving.engine
    dtype = engine.config.dtype_choice
    return (f"model={model_summary(serving)} policy={serving.policy} "
            f"compile={'off' if engine.compile_seconds is None else f'{engine.compile_seconds:.1f}s'} "
            f"warm_up={serving.warm_up_s:.1f}s dtype={dtype.name} ({dtype.reason}) kernels={engine.runner.kernels} "
            f"kv_layout={engine.runner.kv_layout} cuda_graphs={_graphs_note(engine)}")


def model_summary(serving: ServingEngine) -> ModelSummary:
    from shared.model.summary import ModelSummary

    return ModelSummary.of(serving.model_name, serving.engine.runner.model.config)


def _graphs_note(engine) -> str:
    graphs = engine.runner.graphs
    return "off" if graphs is None else f"{len(graphs.buckets)} captured in {graphs.capture_seconds:.1f}s"


def _response_formats(names: tuple[str, ...]) -> list[dict]:
    """``[serve] precompile`` entries: "fleet-plan" (the bundled traces' skills) or a JSON file
    holding a response_format object."""
    from shared.engine.grammar.response_format import fleet_plan_format

    formats = []
    for name in names:
        if name == "fleet-plan":
            formats.append(fleet_plan_format())
            continue
        with open(name, encoding="utf-8") as f:
            formats.append(json.load(f))
    return formats


ENGINE_ARGS = ("config", "model", "dtype", "compile", "device", "kernels", "time_kernels", "cuda_graphs", "kv_layout",
               "block_size", "num_blocks", "max_num_seqs", "max_batched_tokens")


def serve_argv(args) -> list[str]:
    """`cloudd serve`'s flags for this command's engine flags (those given), with the model
    resolved here and paths made absolute: a server started from a bench, in another working
    directory, runs the engine the bench was asked for."""
    argv = []
    for name in ENGINE_ARGS:
        value = model_path_from(args) if name == "model" else getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, Path):
            argv += [flag, str(value.resolve())]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def replica_args(args) -> dict:
    """What each cluster replica builds its engine from (``build_serving_engine``'s arguments):
    this command's engine flags, the model resolved here, the fleet policy, no ports of its own."""
    return {**{k: getattr(args, k) for k in ENGINE_ARGS}, "model": model_path_from(args), "zmq_port": 0, "http_port": 0,
            "policy": "fleet"}
