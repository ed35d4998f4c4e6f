"""`cloudd bench --serve` against in-process cloudd servers (a tiny random model with the default
model's tokenizer, so trace chat messages work): per-priority report, one run per URL keyed by
policy, the HTTP path, and unreachable servers."""

from __future__ import annotations

import json
import threading
import time

import pytest

from cloudd.__main__ import main
from cloudd.http_api import ApiContext, HttpServer
from cloudd.serve_bench import ServeBenchOptions, run_names, run_serve_bench
from cloudd.server import CloudServer, ServeConfig
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.policy import FCFS, FleetPolicy
from shared.model.gguf_loader import build_tokenizer, read_gguf
from shared.transport.client import FleetClient
from shared.transport.loopback import free_port
from tests.engine.tiny import tiny_model
from tests.robot_grants import ROBOT_GRANTS

SYSTEM = "You are a warehouse robot. Answer with a numbered plan of at most five short steps. " * 3
TRACE = [  # (robot, priority, arrival_s, max_tokens)
    ("r1", 0, 0.0, 6), ("r2", 0, 0.1, 5), ("r1", 0, 0.2, 7),
    ("r2", 1, 0.3, 4), ("r1", 0, 0.4, 6), ("r2", 0, 0.5, 5),
]
RUN_KEYS = {"trace", "requests", "output_tok_s", "total_tok_s", "ttft_s", "tpot_s", "e2e_s", "prefix_hit_rate",
            "peak_rss_mb", "by_priority", "policy", "url", "errors", "deadline_misses",
            "urgent_over_normal_ttft_p99"}


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-bench") / "tiny-fleet.jsonl"
    lines = [
        json.dumps({"id": f"q{i}", "robot": robot, "kind": "urgent" if prio else "plan", "priority": prio,
                    "arrival_s": arrival, "max_tokens": max_tokens,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"{robot}: bring crate {i} to the dock."}]})
        for i, (robot, prio, arrival, max_tokens) in enumerate(TRACE)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _serve(model, tokenizer, policy):
    """A CloudServer on loopback and the thread running it."""
    engine = Engine(model, tokenizer, EngineConfig(block_size=16, num_blocks=1024), policy=policy)
    server = CloudServer(engine, ServeConfig(zmq_port=0, http_port=0, priority_grants=ROBOT_GRANTS), "tiny")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture(scope="module")
def servers(default_model_path):
    """{"fleet": (server, http_url), "fcfs": (server, None)}: one model, two engines."""
    tokenizer = build_tokenizer(read_gguf(default_model_path)[0])
    model = tiny_model(vocab_size=tokenizer.vocab_size, tie_word_embeddings=False)
    fleet, fleet_thread = _serve(model, tokenizer, FleetPolicy())
    fcfs, fcfs_thread = _serve(model, tokenizer, FCFS())
    client = FleetClient(fleet.inproc_endpoint, context=fleet.context)
    http = HttpServer.for_api("127.0.0.1", 0, ApiContext(client, tokenizer, fleet.metrics, "tiny"))
    yield {"fleet": (fleet, http.url), "fcfs": (fcfs, None)}
    http.close()
    client.close()
    for server, thread in ((fleet, fleet_thread), (fcfs, fcfs_thread)):
        server.stop()
        thread.join(timeout=10)



def test_one_server_reports_both_priority_classes(servers, trace_file):
    fleet = servers["fleet"][0]
    r = run_serve_bench(ServeBenchOptions(trace_file, (fleet.endpoint,), rate_scale=20.0), log=lambda _: None)
    assert RUN_KEYS <= set(r)
    assert r["requests"] == len(TRACE) and r["errors"] == {} and r["deadline_misses"] == 0
    assert r["output_tokens"] == sum(t[3] for t in TRACE)  # ignore_eos: exactly max_tokens each
    assert r["policy"] == "fleet" and r["url"] == fleet.endpoint
    assert set(r["by_priority"]) == {"0", "1"} and r["by_priority"]["1"]["requests"] == 1
    assert r["urgent_over_normal_ttft_p99"] == pytest.approx(
        r["by_priority"]["1"]["ttft_s"]["p99"] / r["by_priority"]["0"]["ttft_s"]["p99"])
    assert 0 < r["prefix_hit_rate"] < 1  # the shared system prompt is reused
    assert r["wall_s"] >= TRACE[-1][2] / 20.0  # arrivals were honoured


def test_two_servers_are_keyed_by_policy_with_the_fcfs_ratio(servers, trace_file, capsys):
    urls = f"{servers['fleet'][0].endpoint},{servers['fcfs'][0].endpoint}"
    assert main(["bench", "--serve", urls, "--trace", str(trace_file), "--rate-scale", "20", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # exactly one JSON object on stdout; the report went to stderr
    runs = result["runs"]
    assert set(runs) == {"fleet", "fcfs"}
    assert runs["fleet"]["throughput_vs_fcfs"] == pytest.approx(
        runs["fleet"]["output_tok_s"] / runs["fcfs"]["output_tok_s"])
    assert "throughput_vs_fcfs" not in runs["fcfs"]
    assert all(r["errors"] == {} and r["output_tokens"] == sum(t[3] for t in TRACE) for r in runs.values())
    assert "priority 1 (safety)" in err and "x the fcfs run's output tok/s" in err


def test_http_url_streams_chat_completions(servers, trace_file):
    url = servers["fleet"][1]
    r = run_serve_bench(ServeBenchOptions(trace_file, (url,), rate_scale=20.0), log=lambda _: None)
    assert r["requests"] == len(TRACE) and r["errors"] == {}
    assert 0 < r["output_tokens"] <= sum(t[3] for t in TRACE)  # no ignore_eos over HTTP
    assert r["policy"] is None and r["url"] == url and set(r["by_priority"]) == {"0", "1"}
    assert 0 < r["prefix_hit_rate"] < 1  # from the streams' usage.prompt_tokens_details


def test_unreachable_zmq_server_fails_fast_naming_the_url(trace_file):
    url = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=url):
        run_serve_bench(ServeBenchOptions(trace_file, (url,), probe_timeout_s=0.5), log=lambda _: None)
    assert time.monotonic() - started < 5


def test_unreachable_http_server_exits_2(trace_file, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--serve", url, "--trace", str(trace_file)]) == 2
    assert url in capsys.readouterr().err


def test_bad_serve_arguments_are_refused(trace_file):
    with pytest.raises(ValueError, match="ftp://x"):
        ServeBenchOptions(trace_file, ("ftp://x",))
    with pytest.raises(ValueError, match="rate-scale"):
        ServeBenchOptions(trace_file, ("tcp://127.0.0.1:1",), rate_scale=0)
    with pytest.raises(ValueError, match="twice"):
        ServeBenchOptions(trace_file, ("tcp://127.0.0.1:1", "tcp://127.0.0.1:1"))


def test_runs_fall_back_to_the_url_when_the_policy_does_not_name_them():
    reports = [{"policy": "fleet", "url": "a"}, {"policy": "fleet", "url": "b"}, {"policy": "fcfs", "url": "c"},
               {"policy": None, "url": "http://d"}]
    assert run_names(reports) == ["a", "b", "fcfs", "http://d"]
