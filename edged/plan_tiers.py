"""``edged plan-eval --tiers edge,cloud,hybrid``: what escalation buys, on the same tasks.

- ``edge``: on the robot: edged's batch-1 generator in this process (``--backend``, ``--quant``),
  nothing escalated;
- ``cloud``: by the cloud: every task through robot_sdk to cloudd, a running one
  (``--cloud-endpoint``) or one this tool starts (``--cloud-model``: ``cloudd serve`` on loopback
  at free ports with ``--cloud-config``, else cloudd's defaults and the kernels of the shipped
  ``configs/cloudd.toml``, stopped at the end, on failure too);
- ``hybrid``: through edged with its escalation policy: an edged front in this process (the same
  backend; the ``[escalation]`` rules of ``--config``, else those of the shipped
  ``configs/edged.toml``) linked to that cloud.
  The robot answers what it can and escalates the rest; an escalated plan's time is the local
  plan's and then the cloud's, or about the cloud's alone where the rules race the two
  (``race``, on in the shipped config).

One machine hosts both sides here, and by default they share its CPUs, which a deployment never
does: a raced plan then takes CPU from the other side's. ``robot_cpus`` (``--robot-cpus``) splits
the machine as deployed: this process (the robot: the edge tier's model, the hybrid's edged front,
robot_sdk's client) runs on those CPUs with a thread each, and a cloud this tool starts on all the
others, for every tier alike. The report then says which CPUs each side had (``cpus``).

Each tier's summary is ``plan_eval.summarize``'s, whose ``local_rate`` (the share answered on
the robot) is 1.0 for edge and 0.0 for cloud. ``records`` sees every answer with its outcome
(``--records``: one JSON line each, the edge tier's with the plan's mean token log-probability),
the data an escalation rule is designed from. With ``--cloud-endpoint`` both cloud tiers share
that cloudd, whose prefix cache then holds the first one's prompts when the second runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from edged.config import BackendConfig
from edged.escalation import EscalationConfig
from edged.plan_eval import (PLAN_TASKS, Answer, Answered, EvalTask, Outcome, endpoint_answerer, load_tasks,
                             local_answerer, local_generators, named_runs, run_variants)
from robot_sdk.client import PlanClient
from shared.cpu_affinity import available_cpus, format_cpu_list, pinned

TIERS = ("edge", "cloud", "hybrid")
CLOUD_KV_BLOCKS = 1024  # a started cloudd's KV pool: 16,384 tokens, plenty for one plan at a time
CLOUD_START_S = 900.0  # a large GGUF can take minutes to load on a small machine
PLAN_TIMEOUT_S = 300.0  # robot_sdk's silence tolerance: a slow CPU cloud may think that long
SHIPPED_CLOUD_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cloudd.toml"

# (tier, variant, task, answer, outcome) for each answer, as it is judged
Record = Callable[[str, str, EvalTask, Answered, Outcome], None]


@dataclasses.dataclass(frozen=True)
class TierOptions:
    """What ``run_tiers`` compares, and where the cloud comes from (one of the two, unless only
    the edge tier runs)."""

    tiers: tuple[str, ...] = TIERS
    backend: str = "onnx"  # the robot's backend and quantization (edge and hybrid)
    quant: str = "int4"
    cloud_model: Path | None = None  # start cloudd on this GGUF / HF folder
    cloud_config: Path | None = None  # that cloudd's TOML ([engine]: device, dtype, compile, ...; default: shipped kernels)
    cloud_endpoint: str | None = None  # or use the cloudd listening here (no CURVE)
    escalation: EscalationConfig = EscalationConfig()  # the hybrid's rules (its endpoint is replaced)
    robot_cpus: frozenset[int] | None = None  # the robot's CPUs (this process); a cloud started here: the others
    machine_cpus: frozenset[int] = dataclasses.field(default_factory=available_cpus, init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in TIERS]
        if unknown or not self.tiers:
            raise ValueError(f"tiers: choose from {','.join(TIERS)} (got {','.join(self.tiers) or 'none'})")
        needs_cloud = bool({"cloud", "hybrid"} & set(self.tiers))
        if needs_cloud and (self.cloud_model is None) == (self.cloud_endpoint is None):
            raise ValueError("the cloud and hybrid tiers need exactly one of --cloud-model and --cloud-endpoint")
        if self.cloud_config is not None and self.cloud_model is None:
            raise ValueError("--cloud-config goes with --cloud-model (the cloud this tool starts)")
        if self.robot_cpus is not None:
            mine = format_cpu_list(self.machine_cpus)
            if not self.robot_cpus or not self.robot_cpus <= self.machine_cpus:
                raise ValueError(f"--robot-cpus {format_cpu_list(self.robot_cpus) or '(none)'}: "
                                 f"choose among this process's CPUs {mine}")
            if needs_cloud and self.cloud_model is not None and not self.cloud_cpus:
                raise ValueError(f"--robot-cpus {format_cpu_list(self.robot_cpus)} leaves the cloud no CPU "
                                 f"(this process has {mine})")

    @property
    def cloud_cpus(self) -> frozenset[int] | None:
        """The CPUs of a cloud started here: all those this process had when the options were made
        but the robot's (None: unsplit)."""
        return None if self.robot_cpus is None else self.machine_cpus - self.robot_cpus

    def cpu_split(self) -> dict[str, str]:
        """The report's ``cpus``: each side's CPU list (the cloud's only when started here)."""
        if self.robot_cpus is None:
            return {}
        split = {"robot": format_cpu_list(self.robot_cpus)}
        if self.cloud_model is not None:
            split["cloud"] = format_cpu_list(self.cloud_cpus)
        return split


def run_tiers(model: Path, options: TierOptions, variants: Sequence[str] = ("grounded",),
              tasks_path: Path | None = None, limit: int | None = None, threads: int | None = None,
              log: Callable[[str], None] | None = print, record: Record | None = None) -> dict:
    """The report: ``{"tasks": n, "tiers": {"<tier>[-free]": summary, ...}}`` (and ``"cpus"``
    with ``robot_cpus``), the tiers in the order asked, one after another (each with only its own
    processes and models loaded). ``threads``: the robot model's (default: one per robot CPU,
    edged's ``BackendConfig.threads`` unsplit)."""
    tasks = load_tasks(tasks_path or PLAN_TASKS)[:limit]
    robot_cpus = options.robot_cpus
    threads = threads or (len(robot_cpus) if robot_cpus else BackendConfig().threads)
    report: dict[str, dict] = {}
    with pinned(robot_cpus) if robot_cpus else contextlib.nullcontext():
        for tier in options.tiers:
            with tier_answerer(tier, model, options, threads) as answer:
                summaries = run_variants(tasks, answer, variants, functools.partial(record, tier) if record else None)
            report.update(named_runs(tier, summaries, log))
    split = options.cpu_split()
    return {"tasks": len(tasks), "tiers": report, **({"cpus": split} if split else {})}


@contextlib.contextmanager
def tier_answerer(tier: str, model: Path, options: TierOptions, threads: int) -> Iterator[Answer]:
    """``tier``'s answerer, and what it needs (a model, a cloud, an edged front) until the block
    ends. A cloud this tool starts is started afresh for each tier: a cloud that answered the
    cloud tier would hold the same prompts in its prefix cache for the hybrid's escalations."""
    if tier == "edge":
        _, generator = next(local_generators(model, [(options.backend, options.quant)], threads))
        yield local_answerer(generator)
        return
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(cloud_endpoint(options))
        if tier == "hybrid":
            endpoint = stack.enter_context(edged_front(model, options, endpoint, threads))
        client = stack.enter_context(PlanClient(endpoint, robot_id="plan-eval", timeout_s=PLAN_TIMEOUT_S, retries=0))
        yield endpoint_answerer(client)


def shipped_cloud_kernels(config: Path = SHIPPED_CLOUD_CONFIG) -> str:
    """The ``[engine] kernels`` of the fleet's shipped cloudd config (the 1.5B's int8 products);
    "auto" where the file or the key is absent. ValueError for a bad [engine] table."""
    from shared.config import load_section
    from shared.engine.engine_config import EngineConfig  # NOTE: loads torch: only for a cloud started here

    try:
        return load_section(config, "engine", EngineConfig).kernels
    except FileNotFoundError:
        return "auto"


def cloud_serve_args(options: TierOptions) -> list[str]:
    """``cloudd serve``'s arguments for the cloud this tool starts: ``--cloud-model`` on loopback
    at free ports, a KV pool for one plan at a time, and ``--cloud-config``, else cloudd's
    defaults with the shipped config's kernels (not its [serve] quotas, which would throttle
    this one client's back-to-back plans)."""
    config = (["--config", str(options.cloud_config)] if options.cloud_config is not None
              else ["--kernels", shipped_cloud_kernels()])
    return ["serve", "--model", str(options.cloud_model), *config, "--zmq-port", "0", "--http-port", "0",
            "--num-blocks", str(CLOUD_KV_BLOCKS)]


@contextlib.contextmanager
def cloud_endpoint(options: TierOptions) -> Iterator[str]:
    """``--cloud-endpoint`` as given, or the ZeroMQ endpoint of a ``cloudd serve`` started on
    ``--cloud-model`` (``--cloud-config`` its TOML; loopback, free ports, a KV pool for one plan
    at a time, on ``cloud_cpus``), stopped when the block ends however it ends."""
    if options.cloud_endpoint is not None:
        yield options.cloud_endpoint
        return
    from shared.daemon_process import DaemonProcess

    cloudd = DaemonProcess("cloudd", cloud_serve_args(options), ready="cloudd ready:", timeout_s=CLOUD_START_S,
                           cpus=options.cloud_cpus)
    try:
        yield cloudd.fields["zmq"]
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):  # terminate() has killed it then
            cloudd.terminate(timeout_s=30)


@contextlib.contextmanager
def edged_front(model: Path, options: TierOptions, cloud: str, threads: int) -> Iterator[str]:
    """An edged server in this process (its own model copy, no pinned prompts) on an ipc
    socket in a directory of its own, escalating by ``options.escalation`` to ``cloud``;
    stopped when the block ends. Yields its endpoint."""
    from edged.config import BackendConfig, EdgeConfig
    from edged.daemon import build_server
    from edged.server import EdgeServeConfig

    with tempfile.TemporaryDirectory(prefix="plan-eval-edged-") as scratch:
        config = EdgeConfig(
            backend=BackendConfig(kind=options.backend, quant=options.quant, threads=threads, model=str(model)),
            serve=EdgeServeConfig(robot_id="plan-eval", endpoints=(f"ipc://{scratch}/edged.sock",),
                                  pinned_dir=scratch),
            escalation=dataclasses.replace(options.escalation, cloud_endpoint=cloud, server_public_key="",
                                           robot_secret_key=""))
        server = build_server(config)
        thread = threading.Thread(target=server.serve_forever, name="plan-eval-edged", daemon=True)
        thread.start()
        try:
            yield server.endpoints[0]
        finally:
            server.stop()
            thread.join(timeout=server.config.shutdown_grace_s + 30)


@contextlib.contextmanager
def json_lines(path: Path | None) -> Iterator[Record | None]:
    """A ``Record`` writing one JSON line per answer to ``path`` (None: no records), closed when
    the block ends."""
    if path is None:
        yield None
        return
    with open(path, "w") as f:

        def write(tier: str, variant: str, task: EvalTask, answered: Answered, outcome: Outcome) -> None:
            judged = {k: v for k, v in dataclasses.asdict(outcome).items() if k not in ("latency_s", "local")}
            f.write(json.dumps({"tier": tier, "variant": variant, "task": task.id, **dataclasses.asdict(answered),
                                **judged}) + "\n")
            f.flush()

        yield write
