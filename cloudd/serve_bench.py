"""`cloudd bench --serve URL[,URL...]`: replay a fleet trace with its arrival times against
running cloudd servers and report latency per priority class (ARCHITECTURE §6 keys).

Each request is sent ``arrival_s / rate_scale`` seconds after the run starts, greedy, with the
trace's ``max_tokens``, robot and priority (1 -> ``safety``, 0 -> ``plan``), and streamed so
TTFT is measured at the first chunk carrying tokens. One thread per in-flight request.

Transports, by URL scheme:
- ``tcp://`` / ``ipc://``: the ZeroMQ protocol (``FleetClient``), with ``ignore_eos`` so every
  request produces exactly ``max_tokens``. Server counters (policy, prompt and cache-hit
  tokens, deadline misses, running/waiting) come from the ``stats`` query.
- ``http://`` / ``https://``: OpenAI ``/v1/chat/completions`` with ``"stream": true`` (no
  ``ignore_eos`` there: outputs may stop early at EOS). Running/waiting and deadline misses come
  from ``/metrics``; the prefix hit rate from each stream's ``usage`` chunk
  (``stream_options.include_usage``); the policy is unknown.

Several URLs run one after the other, each after its server reports no running or waiting
requests; a server that cannot be reached raises ``RuntimeError`` naming its URL.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cloudd.bench_report import RequestTiming, format_run, run_report
from cloudd.trace import TraceRequest, load_trace
from shared.protocol.messages import ChatMessage, Chunk, Error, Generate, Priority, Sampling
from shared.transport.client import FleetClient, RequestFailed

ZMQ_SCHEMES = ("tcp://", "ipc://")
HTTP_SCHEMES = ("http://", "https://")
TRACE_PRIORITY = {1: Priority.SAFETY, 0: Priority.PLAN}  # the trace's 0/1 -> protocol classes
IDLE_POLL_S = 0.5

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServeBenchOptions:
    """What to replay against which servers; ValueError for a URL or rate it cannot use."""

    trace: Path
    urls: tuple[str, ...]
    rate_scale: float = 1.0  # 2: twice the trace's request rate
    limit: int | None = None  # replay only the first N requests
    probe_timeout_s: float = 5.0  # a server silent this long to a stats/metrics query is unreachable
    idle_timeout_s: float = 600.0  # longest wait for a server to finish earlier work before a run
    # A request silent this long (queued included: HTTP sends nothing before the first token)
    # ends as a "timeout" error; a dead ZeroMQ server fails its calls much sooner ("unavailable").
    stall_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("--serve needs at least one URL")
        for url in self.urls:
            if not url.startswith(ZMQ_SCHEMES + HTTP_SCHEMES):
                raise ValueError(f"{url!r}: a server URL starts with tcp://, ipc://, http:// or https://")
            if self.urls.count(url) > 1:
                raise ValueError(f"--serve lists {url} twice (runs are keyed by policy or URL)")
        if self.rate_scale <= 0:
            raise ValueError(f"--rate-scale must be > 0, got {self.rate_scale}")


@dataclass(frozen=True)
class ServerState:
    """What a server says about itself; a counter is None where its interface lacks it."""

    busy: int  # running + waiting requests
    policy: str | None = None
    prompt_tokens: int | None = None
    cache_hit_tokens: int | None = None
    deadline_misses: int | None = None


@dataclass(frozen=True)
class SentRequest:
    """One trace request as the bench saw it (``perf_counter`` times); ``error`` is the code
    that ended it (an ``ErrorCode`` value, "timeout" or "connection"), None for a result."""

    priority: int  # the trace's value
    sent_at: float
    first_token_at: float | None  # None: no chunk carried tokens
    ended_at: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def timing(self) -> RequestTiming:
        """Latencies from the send; a result without chunks counts its end as its first token."""
        first = self.first_token_at if self.first_token_at is not None else self.ended_at
        return RequestTiming(self.priority, self.prompt_tokens, self.output_tokens, first - self.sent_at,
                             self.ended_at - self.sent_at)


@dataclass(frozen=True)
class RunResult:
    """One URL's replay: every request's outcome and the server's state around it."""

    url: str
    sent: list[SentRequest]
    wall_s: float
    before: ServerState
    after: ServerState


class Target(Protocol):
    """One server, over one transport."""

    url: str

    def state(self) -> ServerState:
        """The server's current state; RuntimeError naming the URL if it does not answer."""
        ...

    def send(self, req: TraceRequest, request_id: str) -> SentRequest:
        """Send one request now and block until it ends (never raises for a failed request)."""
        ...

    def close(self) -> None: ...


# --- ZeroMQ protocol -----------------------------------------------------------------------------


class ZmqTarget:
    def __init__(self, url: str, opts: ServeBenchOptions):
        self.url = url
        self.opts = opts
        self.client = FleetClient(url)

    def state(self) -> ServerState:
        try:
            stats = self.client.stats(timeout_s=self.opts.probe_timeout_s)
        except (TimeoutError, RequestFailed) as e:
            raise RuntimeError(f"{self.url}: no cloudd answering the stats query ({e})") from None
        engine = stats["engine"]
        return ServerState(
            busy=engine["running"] + engine["waiting"],
            policy=stats["policy"],
            prompt_tokens=engine["prompt_tokens"],
            cache_hit_tokens=engine["cache_hit_tokens"],
            deadline_misses=engine["deadline_misses"],
        )

    def send(self, req: TraceRequest, request_id: str) -> SentRequest:
        generate = Generate(
            request_id=request_id,
            messages=tuple(ChatMessage(m["role"], m["content"]) for m in req.messages),
            sampling=Sampling(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True),
            priority=TRACE_PRIORITY[req.priority],
            robot_id=req.robot,
            stream=True,
        )
        sent = time.perf_counter()
        first = reply = None
        try:
            for reply in self.client.start(generate).events(self.opts.stall_timeout_s):
                if first is None and isinstance(reply, Chunk) and reply.token_ids:
                    first = time.perf_counter()
        except TimeoutError:
            return SentRequest(req.priority, sent, first, time.perf_counter(), error="timeout")
        ended = time.perf_counter()
        if isinstance(reply, Error):
            return SentRequest(req.priority, sent, first, ended, error=reply.code.value)
        u = reply.usage
        return SentRequest(req.priority, sent, first, ended, u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                           reply.finish_reason)

    def close(self) -> None:
        self.client.close()


# --- OpenAI HTTP ---------------------------------------------------------------------------------


class HttpTarget:
    def __init__(self, url: str, opts: ServeBenchOptions):
        self.url = url.rstrip("/")
        self.opts = opts

    def state(self) -> ServerState:
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=self.opts.probe_timeout_s) as resp:
                samples = _prometheus_samples(resp.read().decode())
        except (OSError, ValueError) as e:  # URLError, HTTPError and socket timeouts are OSErrors
            raise RuntimeError(f"{self.url}: no cloudd answering GET /metrics ({e})") from None
        misses = samples.get("fleetserve_deadline_misses_total")
        return ServerState(
            busy=int(samples.get("fleetserve_running_requests", 0) + samples.get("fleetserve_waiting_requests", 0)),
            deadline_misses=None if misses is None else int(misses),
        )

    def send(self, req: TraceRequest, request_id: str) -> SentRequest:
        body = {
            "messages": list(req.messages),
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": TRACE_PRIORITY[req.priority].value,
            "robot_id": req.robot,
            "request_id": request_id,
        }
        http_request = urllib.request.Request(f"{self.url}/v1/chat/completions", json.dumps(body).encode(),
                                              {"Content-Type": "application/json"})
        sent = time.perf_counter()
        try:
            with urllib.request.urlopen(http_request, timeout=self.opts.stall_timeout_s) as resp:
                return _sse_outcome(req.priority, sent, _sse_events(resp))
        except urllib.error.HTTPError as e:  # refused before streaming: the body names the code
            error = _http_error_code(e)
        except TimeoutError:
            error = "timeout"
        except OSError:
            error = "connection"
        return SentRequest(req.priority, sent, None, time.perf_counter(), error=error)

    def close(self) -> None:
        pass


def _sse_outcome(priority: int, sent: float, events: Iterator[dict]) -> SentRequest:
    """Read a chat completion stream to its end: the last event carries ``usage`` (asked for with
    ``include_usage``; its ``choices`` is empty), an ``error`` event (or a stream that stops
    short) ends the request as an error."""
    first = finish = None
    for event in events:
        now = time.perf_counter()
        if "error" in event:
            return SentRequest(priority, sent, first, now, error=str(event["error"].get("code", "internal")))
        for choice in event["choices"]:
            if first is None and choice.get("delta", {}).get("content"):
                first = now
            finish = choice.get("finish_reason") or finish
        if u := event.get("usage"):
            return SentRequest(priority, sent, first, now, u["prompt_tokens"], u["completion_tokens"],
                               u.get("prompt_tokens_details", {}).get("cached_tokens", 0), finish)
    return SentRequest(priority, sent, first, time.perf_counter(), error="connection")


def _sse_events(resp: Iterable[bytes]) -> Iterator[dict]:
    """The JSON ``data:`` events of a server-sent-event stream, lazily, up to ``[DONE]``."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _http_error_code(e: urllib.error.HTTPError) -> str:
    """The OpenAI error body's ``code`` (cloudd sends the protocol's error code), else the status."""
    try:
        return str(json.loads(e.read())["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{e.code}"


def _prometheus_samples(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition, by name."""
    samples = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            samples[parts[0]] = float(parts[1])
    return samples


def open_target(url: str, opts: ServeBenchOptions) -> Target:
    return ZmqTarget(url, opts) if url.startswith(ZMQ_SCHEMES) else HttpTarget(url, opts)


# --- a run ---------------------------------------------------------------------------------------


def wait_idle(target: Target, timeout_s: float) -> ServerState:
    """Poll until the server has no running or waiting request; returns that state."""
    deadline = time.monotonic() + timeout_s
    while (state := target.state()).busy:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{target.url}: still {state.busy} requests running or waiting after {timeout_s:.0f} s")
        time.sleep(IDLE_POLL_S)
    return state


def replay(target: Target, requests: list[TraceRequest], rate_scale: float,
           run_id: str) -> tuple[list[SentRequest], float]:
    """Send each request at ``arrival_s / rate_scale`` after the start; returns the outcomes
    (in trace order) and the wall time until the last one ended."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests), thread_name_prefix="serve-bench") as pool:
        futures = []
        for req in requests:  # the trace is in arrival order; a late one is sent at once
            time.sleep(max(0.0, t0 + req.arrival_s / rate_scale - time.perf_counter()))
            futures.append(pool.submit(target.send, req, f"{run_id}-{req.id}"))
        sent = [f.result() for f in futures]
    return sent, time.perf_counter() - t0


def run_one(url: str, requests: list[TraceRequest], opts: ServeBenchOptions, log: Log) -> RunResult:
    target = open_target(url, opts)
    try:
        log(f"{url}: waiting for the server to be idle")
        before = wait_idle(target, opts.idle_timeout_s)
        run_id = f"bench-{before.policy or 'http'}-{uuid.uuid4().hex[:8]}"  # fresh ids: no ledger replays
        log(f"{url}: replaying {len(requests)} requests at {opts.rate_scale:g}x the trace's rate ({run_id})")
        sent, wall = replay(target, requests, opts.rate_scale, run_id)
        return RunResult(url, sent, wall, before, target.state())
    finally:
        target.close()


# --- the report ----------------------------------------------------------------------------------


def prefix_hit_rate(run: RunResult) -> float:
    """The server's cache-hit / prompt token delta over the run, or (a server without those
    counters) the requests' own cached / prompt tokens."""
    b, a = run.before, run.after
    if None not in (b.prompt_tokens, a.prompt_tokens, b.cache_hit_tokens, a.cache_hit_tokens):
        prompt, hit = a.prompt_tokens - b.prompt_tokens, a.cache_hit_tokens - b.cache_hit_tokens
    else:
        done = [s for s in run.sent if s.error is None]
        prompt, hit = sum(s.prompt_tokens for s in done), sum(s.cached_tokens for s in done)
    return hit / prompt if prompt else 0.0


def deadline_misses(run: RunResult) -> int:
    """The server's deadline-miss delta over the run, or (a server without that counter) the
    results that ended with finish reason ``deadline``. The server counts exactly those results,
    so the two are never added."""
    if run.before.deadline_misses is not None and run.after.deadline_misses is not None:
        return run.after.deadline_misses - run.before.deadline_misses
    return sum(1 for s in run.sent if s.finish_reason == "deadline")


def urgent_over_normal(by_priority: dict) -> float | None:
    """Urgent (trace priority 1) over normal (0) TTFT p99, when both classes finished some."""
    if "0" not in by_priority or "1" not in by_priority or not by_priority["0"]["ttft_s"]["p99"]:
        return None
    return by_priority["1"]["ttft_s"]["p99"] / by_priority["0"]["ttft_s"]["p99"]


def report(trace: Path, run: RunResult) -> dict:
    """The §6 object of one run plus policy, url, errors, deadline_misses and the urgent ratio."""
    done = [s for s in run.sent if s.error is None]
    r = run_report(str(trace), [s.timing() for s in done], run.wall_s, prefix_hit_rate(run))
    r["policy"] = run.after.policy
    r["url"] = run.url
    r["errors"] = dict(Counter(s.error for s in run.sent if s.error is not None))
    r["deadline_misses"] = deadline_misses(run)
    r["urgent_over_normal_ttft_p99"] = urgent_over_normal(r["by_priority"])
    return r


def run_names(reports: list[dict]) -> list[str]:
    """Each run's key: its server's policy, or its URL where the policy is unknown or shared."""
    policies = Counter(r["policy"] for r in reports)
    return [r["policy"] if r["policy"] is not None and policies[r["policy"]] == 1 else r["url"] for r in reports]


def add_fcfs_ratios(runs: dict[str, dict]) -> None:
    """With one ``fcfs`` run, every other run gets ``throughput_vs_fcfs`` (output tok/s ratio)."""
    fcfs = runs.get("fcfs")
    if fcfs is None or not fcfs["output_tok_s"]:
        return
    for name, r in runs.items():
        if name != "fcfs":
            r["throughput_vs_fcfs"] = r["output_tok_s"] / fcfs["output_tok_s"]


def format_serve_run(r: dict) -> str:
    """``format_run`` plus a line per priority class, the urgent/normal ratio and any errors."""
    lines = [format_run(f"{r['policy'] or 'server'} at {r['url']}", r)]
    for p, s in r["by_priority"].items():
        klass = TRACE_PRIORITY[int(p)].value
        lines.append(f"   priority {p} ({klass}): {s['requests']} requests, TTFT p50 {s['ttft_s']['p50']:.2f}s"
                     f" p99 {s['ttft_s']['p99']:.2f}s")
    if r["urgent_over_normal_ttft_p99"] is not None:
        lines.append(f"   urgent/normal TTFT p99: {r['urgent_over_normal_ttft_p99']:.2f}")
    if r["errors"] or r["deadline_misses"]:
        errors = ", ".join(f"{code} {n}" for code, n in r["errors"].items()) or "none"
        lines.append(f"   errors: {errors}; deadline misses {r['deadline_misses']}")
    return "\n".join(lines)


def load_requests(trace: Path, limit: int | None) -> list[TraceRequest]:
    """The trace's first ``limit`` requests in arrival order; ValueError for a priority other
    than 0 or 1 (the two classes this bench maps)."""
    requests = load_trace(trace, limit)
    bad = [r.id for r in requests if r.priority not in TRACE_PRIORITY]
    if bad:
        raise ValueError(f"{trace}: request {bad[0]!r} has a priority other than 0 or 1")
    return sorted(requests, key=lambda r: r.arrival_s)


def run_serve_bench(opts: ServeBenchOptions, log: Log = _stderr, progress: Log = _stderr) -> dict:
    """Replay the trace against each URL in turn; returns the §6 object of the one run, or
    ``{"runs": {name: run}}`` for several. ``log`` gets the human-readable blocks, ``progress``
    the run-by-run notes."""
    requests = load_requests(opts.trace, opts.limit)
    reports = []
    for url in opts.urls:
        reports.append(report(opts.trace, run_one(url, requests, opts, progress)))
        log(format_serve_run(reports[-1]))
    if len(reports) == 1:
        return reports[0]
    runs = dict(zip(run_names(reports), reports, strict=True))
    add_fcfs_ratios(runs)
    for name, r in runs.items():
        if "throughput_vs_fcfs" in r:
            log(f"   {name}: {r['throughput_vs_fcfs']:.2f}x the fcfs run's output tok/s")
    return {"runs": runs}
