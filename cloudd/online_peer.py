"""`cloudd bench --online --baseline vllm`: cloudd's server and vLLM's, one after the other on
this machine, each driven by the peer's own client with the same requests at the same rate, and
the online bars against the peer.

The client is neutral: vLLM's ``bench serve`` from the peer's venv (``vllm-cpu/serve.sh`` in the
peers folder documents the command), OpenAI chat over HTTP on loopback, with its
``prefix_repetition`` dataset (``OnlineWorkload``: a few shared system prompts, a short suffix
each, fixed output lengths with ``ignore_eos``), requests arriving as a Poisson process at
``request_rate``. Its result file gives each server's request throughput, TTFT p50 / p99 and
TPOT p50 (``OnlineRun``).

- cloudd runs as ``python -m cloudd serve`` with this bench's engine flags and
  ``--no-robot-quotas``: the client is one anonymous sender, which the shipped per-robot quotas
  would answer 429 (the peer has no quotas).
- vLLM runs through ``serve.sh`` (its threads, allocator and prefix caching as the peer set
  them) on the HF folder made from the same GGUF, in the engine's dtype, under cloudd's model
  name, so one client command fits both.
- One server at a time: two servers on the same cores would share them. ``pairs`` > 1 repeats
  the pair with the order alternating (cloudd first in the first pair), since a server's TPOT
  can move 2x within minutes on these machines; the bars are judged on the median ratios.

The bars (issue 49): cloudd's request throughput at least vLLM's, its TPOT p50 at most vLLM's,
its TTFT p99 at most 1.5x vLLM's.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from cloudd.peer_baseline import VllmPeer, log_tail, shown_path
from shared.config import environment_for_peers
from shared.daemon_process import DaemonProcess
from shared.engine.kernel_choice import cpu_signature
from shared.transport.loopback import free_port

Log = Callable[[str], None]

CLOUDD_READY_TIMEOUT_S = 900.0  # a first start converts weights, compiles and times kernels
VLLM_START_TIMEOUT_S = 420.0  # serve.sh gives up on the server's health after 300 s; its curl may hang
VLLM_STOP_TIMEOUT_S = 60.0
SERVER_LOG_TAIL_BYTES = 2000  # of a server's log, added to the error of a run that failed on it

@dataclass(frozen=True)
class Bar:
    """cloudd's ``field`` over the peer's must be at least (``at_least``) or at most ``limit``."""

    field: str
    limit: float
    at_least: bool

    def met(self, ratio: float) -> bool:
        return ratio >= self.limit if self.at_least else ratio <= self.limit

    def __str__(self) -> str:
        return f"{'at least' if self.at_least else 'at most'} {self.limit}x"


BARS = {"request_throughput": Bar("request_throughput", 1.0, at_least=True),
        "tpot_p50": Bar("tpot_p50_ms", 1.0, at_least=False),
        "ttft_p99": Bar("ttft_p99_ms", 1.5, at_least=False)}


@dataclass(frozen=True)
class OnlineWorkload:
    """What the peer's client sends: ``num_prompts`` requests at ``request_rate`` a second, each
    one of ``num_prefixes`` shared prefixes of ``prefix_len`` tokens with its own ``suffix_len``
    tokens, ``output_len`` tokens generated (EOS ignored). The defaults are serve.sh's command."""

    num_prompts: int = 160
    request_rate: float = 4.0
    prefix_len: int = 448
    suffix_len: int = 64
    num_prefixes: int = 4
    output_len: int = 64
    seed: int = 7

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.prefix_len, self.suffix_len, self.num_prefixes) < 1 or self.output_len < 2:
            raise ValueError(f"online workload: the prompts (--limit), prefix and suffix lengths and prefixes must be "
                             f">= 1, the output length (--output-len) >= 2 (TPOT is the time between tokens), got {self}")
        if not self.request_rate > 0:
            raise ValueError(f"online workload: --request-rate must be > 0, got {self.request_rate}")

    @property
    def client_timeout_s(self) -> float:
        """How long the client may run: ten times its arrivals' span plus ten minutes (a server that
        falls behind finishes late; one that stopped answering would hold the client for hours)."""
        return 10 * self.num_prompts / self.request_rate + 600

    def client_args(self) -> list[str]:
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-output-len", str(self.output_len),
                "--num-prompts", str(self.num_prompts), "--request-rate", str(self.request_rate),
                "--ignore-eos", "--seed", str(self.seed)]


@dataclass(frozen=True)
class OnlineRun:
    """One server's figures from the client's result file (milliseconds, requests a second)."""

    server: str
    completed: int
    failed: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float

    @classmethod
    def from_result(cls, server: str, result: dict) -> OnlineRun:
        """From ``bench serve --save-result`` JSON run with ``--metric-percentiles 50,99``;
        ValueError naming the keys it lacks."""
        keys = {"completed": "completed", "failed": "failed", "output_tokens": "total_output_tokens",
                "request_throughput": "request_throughput",
                "output_throughput": "output_throughput", "ttft_p50_ms": "p50_ttft_ms",
                "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "p50_tpot_ms"}
        missing = [k for k in keys.values() if k not in result]
        if missing:
            raise ValueError(f"the client's result lacks {', '.join(missing)}")
        values = {field: result[key] for field, key in keys.items()}
        counts = {k: int(values.pop(k)) for k in ("completed", "failed", "output_tokens")}
        return cls(server, **counts, **{k: float(v) for k, v in values.items()})

    def check_complete(self, workload: OnlineWorkload) -> None:
        """ValueError unless every request of ``workload`` was answered with all its tokens (the
        client's latencies count answered requests only: a server that failed some would look
        faster)."""
        expected = workload.num_prompts * workload.output_len
        if self.failed or self.completed != workload.num_prompts or self.output_tokens != expected:
            raise ValueError(f"{self.completed} of {workload.num_prompts} requests answered ({self.failed} failed), "
                             f"{self.output_tokens} of {expected} output tokens: no comparison without all of them")

    def summary(self) -> str:
        return (f"{self.server}: {self.completed} completed, {self.failed} failed, "
                f"{self.request_throughput:.2f} req/s, TTFT p50 / p99 {self.ttft_p50_ms:,.0f} / "
                f"{self.ttft_p99_ms:,.0f} ms, TPOT p50 {self.tpot_p50_ms:.1f} ms")


def ratios(cloudd: OnlineRun, peer: OnlineRun) -> dict[str, float]:
    """cloudd's figure over the peer's, per bar (complete runs: every figure is above 0)."""
    return {name: getattr(cloudd, bar.field) / getattr(peer, bar.field) for name, bar in BARS.items()}


def bars_met(ratio: dict[str, float]) -> dict[str, bool]:
    return {name: bar.met(ratio[name]) for name, bar in BARS.items()}


def format_ratios(ratio: dict[str, float]) -> str:
    parts = [f"{name} {ratio[name]:.2f}x (bar: {bar}{'' if bar.met(ratio[name]) else ', missed'})"
             for name, bar in BARS.items()]
    return "cloudd / vLLM: " + ", ".join(parts)


@dataclass(frozen=True)
class OnlineOptions:
    """``serve_args``: cloudd serve's flags besides the ports (its engine and model); ``dtype``: the
    engine's resolved dtype, which the peer runs too; ``model_name``: the name cloudd serves the
    model under (its GGUF's stem), which the peer is given and the client asks for."""

    peer: VllmPeer
    serve_args: tuple[str, ...]
    dtype: str
    model_name: str
    workload: OnlineWorkload = OnlineWorkload()
    pairs: int = 1

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"--pairs must be >= 1, got {self.pairs}")


def server_order(pair: int) -> tuple[str, str]:
    """Which server runs first in pair ``pair`` (0-based): cloudd, then alternating."""
    return ("cloudd", "vllm") if pair % 2 == 0 else ("vllm", "cloudd")


def run_online(opts: OnlineOptions, log: Log) -> dict:
    """This CPU's signature, every pair's two runs, their ratios, the median ratios and the bars met
    on them; raises RuntimeError (with a log's tail) when a server does not start or the client
    fails."""
    opts.peer.check(opts.dtype, online=True)
    pairs = []
    for pair in range(opts.pairs):
        runs = {}
        for server in server_order(pair):
            log(f"pair {pair + 1}/{opts.pairs}: {server} serve, then the peer's client "
                f"({opts.workload.num_prompts} requests at {opts.workload.request_rate:g}/s)")
            runs[server] = run_server(server, opts)
            log("   " + runs[server].summary())
        ratio = ratios(runs["cloudd"], runs["vllm"])
        log("   " + format_ratios(ratio))
        pairs.append({"runs": {name: asdict(run) for name, run in runs.items()}, "vs_vllm": ratio,
                      "bars_met": bars_met(ratio)})
    median = {name: statistics.median(p["vs_vllm"][name] for p in pairs) for name in BARS}
    if opts.pairs > 1:
        log(f"median of {opts.pairs} pairs: " + format_ratios(median))
    return {"cpu": cpu_signature(), "workload": asdict(opts.workload), "model": opts.model_name, "dtype": opts.dtype,
            "pairs": pairs,
            "vs_vllm": median, "bars_met": bars_met(median),
            "bars": {name: str(bar) for name, bar in BARS.items()}}


def run_server(server: str, opts: OnlineOptions) -> OnlineRun:
    """``server`` ("cloudd" or "vllm") started, driven by the peer's client, stopped: its figures."""
    start = _cloudd_server if server == "cloudd" else _vllm_server
    with start(opts) as base_url:
        return run_client(base_url, opts, server)


@contextmanager
def _cloudd_server(opts: OnlineOptions) -> Iterator[str]:
    daemon = DaemonProcess("cloudd", ["serve", *opts.serve_args, "--no-robot-quotas", "--http-port", "0",
                                      "--zmq-port", "0"], ready="cloudd ready:", timeout_s=CLOUDD_READY_TIMEOUT_S)
    try:
        yield daemon.fields["http"]
    except BaseException as e:
        daemon.kill()
        if isinstance(e, Exception):  # the run's own error, with the server's side of it (not an interrupt)
            raise RuntimeError(f"{e}\nthe end of cloudd serve's log:\n{daemon.log(SERVER_LOG_TAIL_BYTES)}") from e
        raise
    try:
        code = daemon.terminate()
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"cloudd serve did not stop within {e.timeout:.0f} s of SIGTERM (killed)") from e
    if code != 0:
        raise RuntimeError(f"cloudd serve exited with {code}; the end of its log:\n{daemon.log()}")


@contextmanager
def _vllm_server(opts: OnlineOptions) -> Iterator[str]:
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="fleetserve-vllm-serve-", suffix=".log", delete=False) as log_file:
        log_path = Path(log_file.name)
    try:
        with _serve_script_group(opts, port, log_path):
            try:
                yield f"http://127.0.0.1:{port}"
            except Exception as e:  # the run's own error, with the server's side of it
                raise RuntimeError(f"{e}\nthe end of vLLM's log:\n{log_tail(log_path)}") from e
    finally:
        log_path.unlink(missing_ok=True)


@contextmanager
def _serve_script_group(opts: OnlineOptions, port: int, log_path: Path) -> Iterator[None]:
    """serve.sh run to its end (the server up on ``port``, logging to ``log_path``), then, on
    leaving, its whole process group stopped; RuntimeError when the script fails or hangs."""
    env = {**environment_for_peers(), "PEERS_DIR": str(opts.peer.install),
           "VLLM_MODEL": str(opts.peer.model(opts.dtype)), "VLLM_MODEL_NAME": opts.model_name,
           "VLLM_LOG": str(log_path)}
    # NOTE: its own session, so its process group is serve.sh's PID: the script starts the server
    # in the background and returns, and stopping ends the group (the API server and its engine
    # process), whether the script succeeded, failed or was interrupted
    starter = subprocess.Popen(["bash", str(opts.peer.serve_script), str(port), "--dtype", opts.dtype], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    try:
        try:
            _, err = starter.communicate(timeout=VLLM_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{shown_path(opts.peer.serve_script)} did not finish within {VLLM_START_TIMEOUT_S:.0f} s "
                               f"(stopped); the end of vLLM's log:\n{log_tail(log_path)}") from None
        if starter.returncode != 0:
            raise RuntimeError(f"{shown_path(opts.peer.serve_script)} failed ({err.strip()}); the end of "
                               f"vLLM's log:\n{log_tail(log_path)}")
        yield
    finally:
        _stop_group(starter.pid)
        starter.wait()


def run_client(base_url: str, opts: OnlineOptions, server: str) -> OnlineRun:
    """The peer's ``bench serve`` against ``base_url``: its figures for ``server``. RuntimeError
    when the client fails, runs past its time limit, or a request failed or stopped short (a
    comparison needs every request answered in full on both servers)."""
    peer, workload = opts.peer, opts.workload
    with tempfile.TemporaryDirectory(prefix="fleetserve-online-") as tmp:
        cmd = [str(peer.python), str(peer.cli_script), "bench", "serve", "--backend", "openai-chat",
               "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", opts.model_name,
               "--tokenizer", str(peer.model(opts.dtype)), *workload.client_args(),
               "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        log_path = Path(tmp) / "client.log"
        with open(log_path, "w", encoding="utf-8") as log:
            try:
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=environment_for_peers(), timeout=workload.client_timeout_s).returncode
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the peer's client against {server} ran past {workload.client_timeout_s:.0f} s "
                                   f"(stopped); the end of its log:\n{log_tail(log_path)}") from None
        result_path = Path(tmp) / "result.json"
        if code != 0 or not result_path.is_file():
            raise RuntimeError(f"the peer's client against {server} exited with {code}; the end of its log:\n"
                               + log_tail(log_path))
        try:
            run = OnlineRun.from_result(server, json.loads(result_path.read_text(encoding="utf-8")))
            run.check_complete(workload)
        except (ValueError, TypeError) as e:
            raise RuntimeError(f"the peer's client against {server}: {e}; the end of its log:\n"
                               + log_tail(log_path)) from e
        return run


def _stop_group(pgid: int) -> None:
    """SIGTERM process group ``pgid``, then SIGKILL what is left after VLLM_STOP_TIMEOUT_S;
    RuntimeError if some of it still runs 10 s later (the next server would share the cores)."""
    for sig, wait_s in ((signal.SIGTERM, VLLM_STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while _group_runs(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not _group_runs(pgid):
            return
    raise RuntimeError(f"vLLM's processes (group {pgid}) still run after SIGKILL: stop them before measuring again")


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs: a zombie that its parent (here, after the
    starter exited, whoever reaps orphans) has not reaped yet does not."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != "Z":
            return True
    return False
