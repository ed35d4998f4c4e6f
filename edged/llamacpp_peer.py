"""llama.cpp, the peer a robot team would run instead of edged: ``llama-server`` on loopback with
one slot, and ``llama-bench``'s decode figure, from the build ``../shared/peers/llamacpp/setup.sh``
makes (``$PEERS_DIR/llama.cpp-build/bin``, default ``~/.cache/fleetserve-peers``).

``LlamaServer.chat`` streams one chat completion and times it on the client, as edged's bench
times its own: time to the first content token, time to the last, and the decode rate between
them (the server's own ``timings`` when it sends them).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import environment_for_peers
from shared.transport.loopback import free_port

SETUP_HINT = "set it up with ../shared/peers/llamacpp/setup.sh (builds llama.cpp from PyPI's llama-cpp-python sdist, ~15 min)"


class PeerMissing(RuntimeError):
    """llama.cpp's binaries are not where the peers' setup puts them."""


def peer_binary(name: str) -> Path:
    """``$PEERS_DIR/llama.cpp-build/bin/<name>``; PeerMissing naming the setup script otherwise."""
    peers = Path(os.environ.get("PEERS_DIR", "~/.cache/fleetserve-peers")).expanduser()
    path = peers / "llama.cpp-build" / "bin" / name
    if not os.access(path, os.X_OK):
        raise PeerMissing(f"llama.cpp peer not found: no {path}; {SETUP_HINT}")
    return path


@dataclass(frozen=True)
class Completion:
    """One timed chat completion: seconds from sending to the first and the last content token."""

    text: str
    ttft_s: float
    total_s: float
    tokens: int
    decode_tok_s: float  # after the first token; the server's figure when it sends one
    finish_reason: str  # "stop" (the model or its grammar ended it) | "length"


class LlamaServer:
    """``llama-server`` for ``model`` (a GGUF) on 127.0.0.1, one slot; a context manager.

    Raises PeerMissing without the build, RuntimeError when the server does not come up.
    """

    def __init__(self, model: Path, threads: int, context: int = 4096, start_timeout_s: float = 120.0) -> None:
        binary = peer_binary("llama-server")
        self.port = free_port()
        self.process = subprocess.Popen(
            [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(context),
             "-np", "1", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment_for_peers())
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def chat(self, messages: Sequence[Mapping[str, str]], max_tokens: int, json_schema: Mapping[str, Any] | None = None,
             cache_prompt: bool = True, ignore_eos: bool = False) -> Completion:
        """Greedy completion of ``messages``, streamed; ``json_schema`` constrains it (the
        server's own grammar), ``cache_prompt`` reuses the slot's common prefix."""
        body: dict[str, Any] = {"messages": list(messages), "max_tokens": max_tokens, "temperature": 0,
                                "stream": True, "cache_prompt": cache_prompt, "ignore_eos": ignore_eos}
        if json_schema is not None:
            body["json_schema"] = dict(json_schema)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            start = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"llama-server: HTTP {response.status}: {response.read()[:300]!r}")
            stamps, parts, timings, finish = _read_stream(response)
        finally:
            conn.close()
        if not stamps:
            raise RuntimeError("llama-server streamed no content")
        tokens = int(timings.get("predicted_n", len(stamps)))
        decode = timings.get("predicted_per_second") or (
            (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0)
        return Completion("".join(parts), stamps[0] - start, stamps[-1] - start, tokens, float(decode), finish)

    def _wait_healthy(self, timeout_s: float) -> None:
        ends = time.monotonic() + timeout_s
        while time.monotonic() < ends:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode} at start-up")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass  # not listening yet, or half started
            finally:
                conn.close()
            time.sleep(0.3)
        raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f} s")


def _read_stream(response) -> tuple[list[float], list[str], dict, str]:
    """(arrival time of each content chunk, the chunks' text, the server's timings or {}, the
    finish reason)."""
    stamps: list[float] = []
    parts: list[str] = []
    timings: dict = {}
    finish = ""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        timings = event.get("timings") or timings
        for choice in event.get("choices", []):
            finish = choice.get("finish_reason") or finish
            content = (choice.get("delta") or {}).get("content")
            if content:
                stamps.append(time.perf_counter())
                parts.append(content)
    return stamps, parts, timings, finish


def llama_bench_decode(model: Path, threads: int, tokens: int = 128) -> float:
    """``llama-bench -n tokens`` (tg128 by default): the peer's own decode tokens/s at batch 1."""
    out = subprocess.run([str(peer_binary("llama-bench")), "-m", str(model), "-t", str(threads), "-p", "0",
                          "-n", str(tokens), "-o", "json"], capture_output=True, text=True, check=True, timeout=600,
                         env=environment_for_peers())
    (row,) = [r for r in json.loads(out.stdout) if r.get("n_gen") == tokens]
    return float(row["avg_ts"])
