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
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from cloudd.peer_baseline import VllmPeer, log_tail, shown_path
from shared.daemon_process import DaemonProcess
from shared.engine.kernel_choice import cpu_signature

Log = Callable[[str], None]

CLOUDD_READY_TIMEOUT_S = 900.0  # a first start converts weights, compiles and times kernels
VLLM_STOP_TIMEOUT_S = 60.0

# ratio name -> (the run's field, the bar, whether cloudd's figure must be at least or at most the bar)
BARS: dict[str, tuple[str, float, str]] = {
    "request_throughput": ("request_throughput", 1.0, "at least"),
    "tpot_p50": ("tpot_p50_ms", 1.0, "at most"),
    "ttft_p99": ("ttft_p99_ms", 1.5, "at most"),
}


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
        if min(self.num_prompts, self.prefix_len, self.suffix_len, self.num_prefixes, self.output_len) < 1:
            raise ValueError(f"online workload: prompts, prefix and suffix lengths, prefixes and output length "
                             f"must be >= 1, got {self}")
        if not self.request_rate > 0:
            raise ValueError(f"online workload: request_rate must be > 0, got {self.request_rate}")

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
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float

    @classmethod
    def from_result(cls, server: str, result: dict) -> OnlineRun:
        """From ``bench serve --save-result`` JSON run with ``--metric-percentiles 50,99``;
        ValueError naming the keys it lacks."""
        keys = {"completed": "completed", "failed": "failed", "request_throughput": "request_throughput",
                "output_throughput": "output_throughput", "ttft_p50_ms": "p50_ttft_ms",
                "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "p50_tpot_ms"}
        missing = [k for k in keys.values() if k not in result]
        if missing:
            raise ValueError(f"the client's result lacks {', '.join(missing)}")
        values = {field: result[key] for field, key in keys.items()}
        counts = {k: int(values.pop(k)) for k in ("completed", "failed")}
        return cls(server, **counts, **{k: float(v) for k, v in values.items()})

    def summary(self) -> str:
        return (f"{self.server}: {self.completed} completed, {self.failed} failed, "
                f"{self.request_throughput:.2f} req/s, TTFT p50 / p99 {self.ttft_p50_ms:,.0f} / "
                f"{self.ttft_p99_ms:,.0f} ms, TPOT p50 {self.tpot_p50_ms:.1f} ms")


def ratios(cloudd: OnlineRun, peer: OnlineRun) -> dict[str, float]:
    """cloudd's figure over the peer's, per bar (inf where the peer's is 0)."""
    out = {}
    for name, (field, _, _) in BARS.items():
        ours, theirs = getattr(cloudd, field), getattr(peer, field)
        out[name] = ours / theirs if theirs else float("inf")
    return out


def bars_met(ratio: dict[str, float]) -> dict[str, bool]:
    return {name: (ratio[name] >= bar if side == "at least" else ratio[name] <= bar)
            for name, (_, bar, side) in BARS.items()}


def format_ratios(ratio: dict[str, float]) -> str:
    met = bars_met(ratio)
    parts = [f"{name} {ratio[name]:.2f}x (bar: {side} {bar}x{'' if met[name] else ', missed'})"
             for name, (_, bar, side) in BARS.items()]
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
    opts.peer.check(opts.dtype)
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
            "bars": {name: {"ratio": bar, "cloudd": side} for name, (_, bar, side) in BARS.items()}}


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
    finally:
        code = daemon.terminate()
        if code != 0:
            raise RuntimeError(f"cloudd serve exited with {code}; the end of its log:\n{daemon.log()}")


@contextmanager
def _vllm_server(opts: OnlineOptions) -> Iterator[str]:
    port = _free_port()
    with tempfile.NamedTemporaryFile(prefix="fleetserve-vllm-serve-", suffix=".log", delete=False) as log_file:
        log_path = Path(log_file.name)
    env = {**os.environ, "PEERS_DIR": str(opts.peer.install), "VLLM_MODEL": str(opts.peer.model(opts.dtype)),
           "VLLM_MODEL_NAME": opts.model_name, "VLLM_LOG": str(log_path)}
    # NOTE: its own session: serve.sh starts the server in the background and returns; the group
    # (the API server and its engine process) is what stopping ends
    starter = subprocess.run(["bash", str(opts.peer.serve_script), str(port), "--dtype", opts.dtype],
                             env=env, capture_output=True, text=True, start_new_session=True)
    try:
        if starter.returncode != 0:
            raise RuntimeError(f"{shown_path(opts.peer.serve_script)} failed ({starter.stderr.strip()}); the end of "
                               f"vLLM's log:\n{log_tail(log_path)}")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop_group(int(starter.stdout.split()[-1]) if starter.returncode == 0 else None)
        log_path.unlink(missing_ok=True)


def run_client(base_url: str, opts: OnlineOptions, server: str) -> OnlineRun:
    """The peer's ``bench serve`` against ``base_url``: its figures for ``server``."""
    peer = opts.peer
    with tempfile.TemporaryDirectory(prefix="fleetserve-online-") as tmp:
        cmd = [str(peer.python), str(peer.cli_script), "bench", "serve", "--backend", "openai-chat",
               "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", opts.model_name,
               "--tokenizer", str(peer.model(opts.dtype)), *opts.workload.client_args(),
               "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        log_path = Path(tmp) / "client.log"
        with open(log_path, "w", encoding="utf-8") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        result_path = Path(tmp) / "result.json"
        if code != 0 or not result_path.is_file():
            raise RuntimeError(f"the peer's client against {server} exited with {code}; the end of its log:\n"
                               + log_tail(log_path))
        try:
            return OnlineRun.from_result(server, json.loads(result_path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as e:
            raise RuntimeError(f"the peer's client against {server}: {e}") from e


def _stop_group(pid: int | None) -> None:
    """SIGTERM ``pid``'s process group, then SIGKILL what is left after VLLM_STOP_TIMEOUT_S."""
    if pid is None:
        return
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    for sig, wait_s in ((signal.SIGTERM, VLLM_STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
