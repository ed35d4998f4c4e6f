"""fleetctl against a real in-process cloudd (tiny model): every view renders within 80 columns,
``--json`` prints the snapshot's parts, the model is named as ``cloudd serve`` names it (ready
line, stats, status), and a silent daemon is one line on stderr and exit 1."""

from __future__ import annotations

import io
import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from rich.cells import cell_len
from rich.console import Console, RenderableType

from cloudd.assembly import ServingEngine, engine_note
from cloudd.fleetctl import fmt_seconds, main, requests_view, robots_table, status_panel, top_view
from cloudd.server import CloudServer, ServeConfig
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.policy import FleetPolicy
from shared.protocol.messages import Generate, Priority, Sampling
from shared.transport.client import ClientConfig, FleetClient
from shared.transport.loopback import free_port
from tests.engine.tiny import tiny_model
from tests.robot_grants import ROBOT_GRANTS

ROBOTS = ("amr-1", "forklift-north-warehouse-0042")  # the second is longer than any robot column
# its robots send safety, which [serve] grants only where named (issue 48: priority is a permission)
LIVE_ID = "long-running-safety-check"  # still streaming when the busy snapshot is taken
CLASSES = [p.value for p in Priority]
SNAPSHOT_KEYS = {"model", "model_arch", "model_params", "uptime_s", "state", "throughput", "engine", "queue", "latency", "by_priority",
                 "totals", "robots", "running", "recent"}


@dataclass(frozen=True)
class Fleet:
    endpoint: str
    idle: dict  # the snapshot before any request: latencies are None
    busy: dict  # after one request per robot and class, taken while LIVE_ID runs
    serving: ServingEngine  # what `cloudd serve` would have built
    params: int  # the tiny model's parameters, counted by torch


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """A tiny-model cloudd in a thread; LIVE_ID is cancelled once the busy snapshot is taken."""
    model = tiny_model(tie_word_embeddings=False)
    params = sum(p.numel() for p in model.parameters())
    engine = Engine(model, None, EngineConfig(block_size=4, num_blocks=512), policy=FleetPolicy())
    serve = ServeConfig(zmq_port=0, shutdown_grace_s=0, priority_grants=ROBOT_GRANTS)
    serving = ServingEngine(engine, None, "tiny", serve, "fleet", 0.0)
    server = CloudServer(engine, serving.serve, "tiny")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = FleetClient(server.endpoint, ClientConfig(timeout_s=5))
    try:
        idle = client.stats()
        sampling = Sampling(max_tokens=5, ignore_eos=True)
        calls = [client.start(Generate(f"{robot}-{p.value}", prompt_ids=(1, 2, 3, i), sampling=sampling,
                                       robot_id=robot, priority=p))
                 for i, (robot, p) in enumerate(itertools.product(ROBOTS, Priority))]
        for call in calls:
            call.result(timeout_s=10)
        live = client.stream(Generate(LIVE_ID, prompt_ids=(5, 6, 7), priority=Priority.SAFETY, robot_id=ROBOTS[0],
                                      sampling=Sampling(max_tokens=1000, ignore_eos=True)), timeout_s=10)
        next(live)  # its first token: it is running (1000 tokens take seconds)
        busy = client.stats()
        client.cancel(LIVE_ID)
        yield Fleet(server.endpoint, idle, busy, serving, params)
    finally:
        client.close()
        server.stop()
        thread.join(timeout=10)


def render(renderable: RenderableType) -> str:
    """The text an 80-column terminal shows; fails if any line is wider."""
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(renderable)
    text = console.export_text()
    assert max(cell_len(line) for line in text.splitlines()) <= 80
    return text


def test_busy_snapshot_has_live_and_finished_requests(fleet):
    assert [r["request_id"] for r in fleet.busy["running"]] == [LIVE_ID]
    assert len(fleet.busy["recent"]) == len(ROBOTS) * len(Priority)
    assert {r["robot_id"] for r in fleet.busy["robots"]} == set(ROBOTS)


@pytest.mark.parametrize("view, expected", [
    (status_panel, ["cloudd tiny", "TTFT", "TPOT", "KV cache", "prefix hits", *CLASSES]),
    (robots_table, ["robots (2)", ROBOTS[0], "forklift-north-ware…"]),
    (requests_view, ["live requests (1)", "long-running-…", "running", "recent requests (8)", ROBOTS[0],
                     "forklift-…", "length", *CLASSES]),
    (top_view, ["cloudd tiny", "slowest robots", "live requests (1)", ROBOTS[0], "forklift-north-ware…",
                *CLASSES]),
])
def test_views_fit_80_columns_and_show_the_fleet(fleet, view, expected):
    text = render(view(fleet.busy))
    missing = [s for s in expected if s not in text]
    assert not missing, text
    assert ROBOTS[1] not in text  # cut with an ellipsis


def test_status_shows_the_kv_tiers(fleet):
    tiers = {"hit_tokens": {"device": 71729, "host": 57846, "disk": 13453}, "loads": 140, "loads_layerwise": 120,
             "bytes_moved": {"device_to_host": 2**30, "host_to_device": 2**29, "host_to_disk": 0, "disk_to_host": 0},
             "load_mean_s": 0.0042, "loading": 2, "host_pages_used": 900, "host_pages_total": 1000, "disk_pages": 12}
    text = " ".join(render(status_panel({**fleet.busy, "tiers": tiers})).split())
    for shown in ("host 57,846", "140 loads (120 layer by layer)", "4.20 ms avg", "H→D 512 MB"):
        assert shown in text, text


@pytest.mark.parametrize("view", [status_panel, robots_table, requests_view, top_view])
def test_views_of_an_idle_server_show_dashes(fleet, view):
    text = render(view(fleet.idle))
    assert "None" not in text
    if view is status_panel:
        assert "p50 - · p99 -" in text


@pytest.mark.parametrize("seconds, shown", [
    (None, "-"), (0.0001234, "0.12 ms"), (0.0123, "12.3 ms"), (0.5, "500 ms"), (1.5, "1.50 s"),
    (42.0, "42.0 s"), (65.0, "1m05s"), (7380.0, "2h03m"), (2 * 86400 + 3 * 3600, "2d03h"),
])
def test_fmt_seconds(seconds, shown):
    assert fmt_seconds(seconds) == shown


@pytest.mark.parametrize("command", ["status", "top"])
def test_json_prints_the_whole_snapshot(fleet, capsys, command):
    assert main([command, "--json", "--endpoint", fleet.endpoint]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    assert SNAPSHOT_KEYS <= set(snapshot)
    assert (snapshot["model"], snapshot["model_arch"], snapshot["model_params"]) == ("tiny", "llama", fleet.params)
    assert snapshot["totals"]["requests"] == len(ROBOTS) * len(Priority) + 1


def test_the_ready_line_and_status_name_the_model_its_architecture_and_size(fleet, capsys):
    size = f"{fleet.params / 1e3:.1f}K params"  # 36.9K: torch's count of the tiny model
    assert engine_note(fleet.serving).startswith(f"model=tiny (llama, {size}) policy=fleet ")
    assert main(["status", "--endpoint", fleet.endpoint]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cloudd tiny (fleet policy)" in out and f"│ model llama, {size} │" in out, out


def test_a_model_not_described_shows_a_dash(fleet):
    text = " ".join(render(status_panel({**fleet.busy, "model_arch": None, "model_params": None})).split())
    assert "│ model - │" in text and "None" not in text


def test_robots_json_lists_both_robots(fleet, capsys):
    assert main(["robots", "--json", "--endpoint", fleet.endpoint]) == 0
    robots = json.loads(capsys.readouterr().out)
    assert {r["robot_id"] for r in robots} == set(ROBOTS)


def test_requests_json_has_running_and_recent(fleet, capsys):
    assert main(["requests", "--json", "--endpoint", fleet.endpoint]) == 0
    requests = json.loads(capsys.readouterr().out)
    assert set(requests) == {"running", "recent"}
    assert requests["running"] == []
    assert requests["recent"][0]["request_id"] == LIVE_ID  # newest first: cancelled last
    assert requests["recent"][0]["finish_reason"] == "abort"


def test_top_refreshes_then_exits(fleet, capsys):
    assert main(["top", "--iterations", "2", "--interval", "0.1", "--endpoint", fleet.endpoint]) == 0
    out = capsys.readouterr().out
    assert "slowest robots" in out and ROBOTS[0] in out


def test_silent_endpoint_is_one_line_and_exit_1(capsys):
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # a port nobody listens on
    assert main(["status", "--endpoint", endpoint, "--timeout", "0.5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fleetctl: no answer from {endpoint} within 0.5 s — is cloudd running?\n"


def test_malformed_endpoint_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["robots", "--endpoint", "localhost:5555"])
    assert exit_info.value.code == 2
    assert "not a ZeroMQ endpoint" in capsys.readouterr().err
