"""`cloudd bench --online --baseline vllm` (cloudd.online_peer): the client's result read into a
run, the ratios and the online bars, the servers' order, the flags a bench passes to the cloudd
server it starts, and the whole pair with a real `cloudd serve` beside a stand-in peer (a
loopback HTTP server and a client script in the peer's place)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloudd.__main__ import build_parser, main
from cloudd.assembly import ENGINE_ARGS, model_path_from, serve_argv, serve_config_from
from cloudd.online_peer import (OnlineOptions, OnlineRun, OnlineWorkload, bars_met, format_ratios, ratios, run_server,
                                server_order)
from cloudd.peer_baseline import VllmPeer, hf_folder_name
from tests.cloudd.vllm_peer_fake import fake_vllm_peer

RESULT = {"completed": 160, "failed": 0, "total_output_tokens": 160 * 64, "request_throughput": 3.8, "output_throughput": 240.0,
          "median_ttft_ms": 170.0, "p50_ttft_ms": 169.0, "p99_ttft_ms": 928.0, "median_tpot_ms": 61.0,
          "p50_tpot_ms": 61.0, "p99_tpot_ms": 80.0, "num_prompts": 160, "duration": 42.1}


def run(server: str, rate: float, ttft_p99: float, tpot_p50: float) -> OnlineRun:
    return OnlineRun(server, 160, 0, 160 * 64, rate, rate * 64, 100.0, ttft_p99, tpot_p50)


def test_a_run_is_read_from_the_clients_result_file():
    r = OnlineRun.from_result("cloudd", RESULT)
    assert (r.completed, r.failed, r.request_throughput) == (160, 0, 3.8)
    assert (r.ttft_p50_ms, r.ttft_p99_ms, r.tpot_p50_ms) == (169.0, 928.0, 61.0)
    assert "3.80 req/s" in r.summary() and "TPOT p50 61.0 ms" in r.summary()
    with pytest.raises(ValueError, match="lacks p99_ttft_ms, p50_tpot_ms"):
        OnlineRun.from_result("vllm", {k: v for k, v in RESULT.items() if k not in ("p99_ttft_ms", "p50_tpot_ms")})


def test_ratios_are_cloudds_over_the_peers_and_each_bar_has_its_side():
    ratio = ratios(run("cloudd", 3.8, 928.0, 61.0), run("vllm", 3.49, 2154.0, 159.8))
    assert ratio["request_throughput"] == pytest.approx(3.8 / 3.49)
    assert ratio["tpot_p50"] == pytest.approx(61.0 / 159.8)
    assert ratio["ttft_p99"] == pytest.approx(928.0 / 2154.0)
    assert all(bars_met(ratio).values())
    # on each bar, exactly at it meets it; past it misses
    assert bars_met({"request_throughput": 1.0, "tpot_p50": 1.0, "ttft_p99": 1.5}) == dict.fromkeys(ratio, True)
    missed = bars_met({"request_throughput": 0.99, "tpot_p50": 1.01, "ttft_p99": 1.51})
    assert missed == dict.fromkeys(ratio, False)
    assert format_ratios({"request_throughput": 1.07, "tpot_p50": 1.44, "ttft_p99": 0.72}).count("missed") == 1


def test_a_run_compares_only_with_every_request_answered_in_full():
    workload = OnlineWorkload()  # 160 requests of 64 tokens
    OnlineRun.from_result("cloudd", RESULT).check_complete(workload)
    for short in ({"failed": 1, "completed": 159}, {"total_output_tokens": 160 * 64 - 3}, {"completed": 150}):
        with pytest.raises(ValueError, match="no comparison without all of them"):
            OnlineRun.from_result("cloudd", {**RESULT, **short}).check_complete(workload)


def test_the_order_alternates_from_cloudd_first():
    assert [server_order(i) for i in range(3)] == [("cloudd", "vllm"), ("vllm", "cloudd"), ("cloudd", "vllm")]


def test_the_workload_is_the_clients_flags_and_rejects_what_cannot_run():
    args = OnlineWorkload(num_prompts=12, request_rate=2.5).client_args()
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert flags["--dataset-name"] == "prefix_repetition" and flags["--num-prompts"] == "12"
    assert flags["--request-rate"] == "2.5" and flags["--prefix-repetition-prefix-len"] == "448"
    assert "--ignore-eos" in args  # every request generates exactly output_len tokens on both servers
    for bad in ({"num_prompts": 0}, {"request_rate": 0.0}, {"output_len": 1}):
        with pytest.raises(ValueError, match="online workload"):
            OnlineWorkload(**bad)


def test_a_bench_starts_cloudd_serve_with_its_own_engine_flags(default_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the server runs in the repository root: relative paths are resolved first
    Path("engine.toml").write_text("[engine]\nblock_size = 16\n")
    parser = build_parser()
    bench = parser.parse_args(["bench", "--config", "engine.toml", "--dtype", "float32", "--no-compile",
                               "--kernels", "auto,dense=packed", "--num-blocks", "512", "--max-num-seqs", "40"])
    served = parser.parse_args(["serve", *serve_argv(bench)])
    for name in set(ENGINE_ARGS) - {"model", "config"}:
        assert getattr(served, name) == getattr(bench, name), name
    assert served.config == tmp_path / "engine.toml"
    assert served.model == str(model_path_from(bench)) == str(default_model_path)  # resolved once, in the bench


def test_no_robot_quotas_turns_off_the_three_per_robot_limits_and_nothing_else(tmp_path):
    cfg = tmp_path / "cloudd.toml"
    cfg.write_text("[serve]\nrobot_requests_per_s = 2.0\nrobot_tokens_per_min = 500.0\nrobot_max_in_flight = 3\n"
                   "frames_per_s = 40.0\n")
    parser = build_parser()
    kept = serve_config_from(parser.parse_args(["serve", "--config", str(cfg)]))
    off = serve_config_from(parser.parse_args(["serve", "--config", str(cfg), "--no-robot-quotas"]))
    assert (kept.robot_requests_per_s, kept.robot_tokens_per_min, kept.robot_max_in_flight) == (2.0, 500.0, 3)
    assert (off.robot_requests_per_s, off.robot_tokens_per_min, off.robot_max_in_flight) == (0.0, 0.0, 0)
    assert off.frames_per_s == kept.frames_per_s == 40.0  # a sender's frame limit is not a robot quota


def test_online_needs_the_vllm_baseline(capsys):
    assert main(["bench", "--online"]) == 2
    assert "give --baseline vllm" in capsys.readouterr().err
    assert main(["bench", "--online", "--baseline", "vllm", "--pairs", "0", "--peers-dir", "/nonexistent"]) == 2
    assert "--pairs must be >= 1" in capsys.readouterr().err


# --- the whole pair: a real cloudd serve, a stand-in peer ---

FAKE_SERVE = """\
#!/usr/bin/env bash
# serve.sh's contract: PORT [flags]; a server on loopback in the background; prints its PID
HERE=$(cd "$(dirname "$0")" && pwd)
PORT=$1; shift
echo "$PORT $* model=$VLLM_MODEL name=$VLLM_MODEL_NAME" > "$HERE/serve-args"
echo "stand-in vllm serve on port $PORT" > "$VLLM_LOG"
"$PEERS_DIR/vllm/bin/python" -m http.server --bind 127.0.0.1 "$PORT" > /dev/null 2>&1 &
pid=$!
echo "$pid" > "$HERE/server-pid"
for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && { echo "$pid"; exit 0; }; sleep 0.1; done
exit 1
"""

# `bench serve` in the peer's place: against cloudd (which lists --model) it sends its requests
# in a row from one anonymous client, more than the test's per-robot quota lets through, and
# counts the answers; the stand-in peer gets canned figures (one failed with FAKE_PEER_FAILS set)
FAKE_CLIENT = """\
import argparse, json, os, pathlib, sys, urllib.error, urllib.request
p = argparse.ArgumentParser()
p.add_argument("words", nargs=2)
for flag in ("--base-url", "--model", "--result-dir", "--result-filename", "--num-prompts",
             "--prefix-repetition-output-len"):
    p.add_argument(flag)
args, _ = p.parse_known_args()
here = pathlib.Path(__file__).parent
num_prompts, output_len = int(args.num_prompts), int(args.prefix_repetition_output_len)
try:
    models = json.load(urllib.request.urlopen(args.base_url + "/v1/models", timeout=30))
    server = "cloudd" if [m["id"] for m in models["data"]] == [args.model] else "unexpected"
except urllib.error.URLError:
    server = "peer"
(here / f"client-args-{server}").write_text(json.dumps(sys.argv[1:]))
if os.environ.get("FAKE_CLIENT_EXIT"):
    sys.exit(int(os.environ["FAKE_CLIENT_EXIT"]))
completed = failed = 0
if server == "cloudd":
    body = json.dumps({"model": args.model, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "Which aisle?"}]}).encode()
    for _ in range(num_prompts):
        req = urllib.request.Request(args.base_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
            completed += 1
        except urllib.error.HTTPError:
            failed += 1
else:
    failed = int(os.environ.get("FAKE_PEER_FAILS", "0"))
    completed = num_prompts - failed
rate, ttft, tpot = (3.8, 928.0, 61.0) if server == "cloudd" else (3.49, 2154.0, 159.8)
result = {"completed": completed, "failed": failed, "total_output_tokens": completed * output_len,
          "request_throughput": rate, "output_throughput": 1.0, "p50_ttft_ms": 1.0, "p99_ttft_ms": ttft,
          "p50_tpot_ms": tpot}
pathlib.Path(args.result_dir, args.result_filename).write_text(json.dumps(result))
"""


def _stand_in_peer(tmp_path: Path, gguf: Path) -> tuple[Path, Path]:
    """A peer with serve.sh and vllm_cli.py stand-ins and the HF folders made for ``gguf``."""
    return fake_vllm_peer(tmp_path, {"serve.sh": FAKE_SERVE, "vllm_cli.py": FAKE_CLIENT}, gguf)


def _stand_in_options(scripts: Path, gguf: Path, serve_args: tuple[str, ...] = ()) -> OnlineOptions:
    """A pair's options for the stand-in peer: float32 (its one HF folder), 8 requests."""
    return OnlineOptions(VllmPeer.located(gguf, scripts), serve_args=serve_args, dtype="float32", model_name=gguf.stem,
                         workload=OnlineWorkload(num_prompts=8))


def test_the_pair_runs_real_cloudd_serve_then_the_peer_and_stops_both(default_model_path, tmp_path, monkeypatch,
                                                                      capsys):
    scripts, install = _stand_in_peer(tmp_path, default_model_path)
    monkeypatch.setenv("PEERS_DIR", str(install))
    cfg = tmp_path / "cloudd.toml"  # a tight quota the 30 requests would cross; float32: the peer's fp32 folder
    cfg.write_text('[engine]\ndtype = "float32"\nnum_blocks = 512\ncompile = false\ntime_kernels = false\n'
                   '[serve]\nrobot_requests_per_s = 0.01\nrobot_burst = 5\n')
    args = ["bench", "--online", "--baseline", "vllm", "--peers-dir", str(scripts), "--config", str(cfg),
            "--limit", "30", "--request-rate", "8", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # exactly one JSON object on stdout; the report went to stderr
    (pair,) = result["pairs"]
    cloudd, peer = pair["runs"]["cloudd"], pair["runs"]["vllm"]
    assert (cloudd["completed"], cloudd["failed"]) == (30, 0)  # one anonymous client, no 429: quotas off
    assert peer["request_throughput"] == 3.49
    assert result["vs_vllm"]["tpot_p50"] == pytest.approx(61.0 / 159.8)
    assert result["bars_met"] == {"request_throughput": True, "tpot_p50": True, "ttft_p99": True}
    assert result["model"] == default_model_path.stem and result["dtype"] == "float32"
    assert "cloudd: 30 completed, 0 failed" in captured.err

    here = scripts / "vllm-cpu"
    port, *flags = (here / "serve-args").read_text().split()
    assert flags[:2] == ["--dtype", "float32"]  # the peer runs the engine's dtype
    assert f"name={default_model_path.stem}" in flags  # under cloudd's name: one client command fits both
    assert f"model={install / 'models' / hf_folder_name(default_model_path)}" in flags
    client = json.loads((here / "client-args-peer").read_text())
    assert client[client.index("--base-url") + 1] == f"http://127.0.0.1:{port}"
    assert client[client.index("--num-prompts") + 1] == "30" and client[client.index("--request-rate") + 1] == "8.0"
    assert not (here / "client-args-unexpected").exists()
    assert not _runs(int((here / "server-pid").read_text()))  # the peer's server was stopped


def _runs(pid: int) -> bool:
    """Whether ``pid`` runs: a stopped orphan may stay a zombie until its new parent reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_peer_that_does_not_start_is_an_error_naming_its_script(default_model_path, tmp_path, monkeypatch):
    scripts, install = _stand_in_peer(tmp_path, default_model_path)
    (scripts / "vllm-cpu" / "serve.sh").write_text("echo 'vllm serve did not become healthy' >&2; exit 1\n")
    monkeypatch.setenv("PEERS_DIR", str(install))
    opts = _stand_in_options(scripts, default_model_path)
    with pytest.raises(RuntimeError, match=r"serve.sh failed \(vllm serve did not become healthy\)"):
        run_server("vllm", opts)


def test_a_run_with_a_failed_request_is_an_error_with_the_servers_log_not_a_figure(default_model_path, tmp_path,
                                                                                   monkeypatch):
    scripts, install = _stand_in_peer(tmp_path, default_model_path)
    monkeypatch.setenv("PEERS_DIR", str(install))
    monkeypatch.setenv("FAKE_PEER_FAILS", "1")
    opts = _stand_in_options(scripts, default_model_path)
    with pytest.raises(RuntimeError, match=r"(?s)against vllm: 7 of 8 requests answered \(1 failed\).*"
                                           r"the end of vLLM's log:\nstand-in vllm serve on port"):
        run_server("vllm", opts)
    assert not _runs(int((scripts / "vllm-cpu" / "server-pid").read_text()))


def test_a_client_that_fails_against_cloudd_carries_cloudds_log(default_model_path, tmp_path, monkeypatch):
    scripts, install = _stand_in_peer(tmp_path, default_model_path)
    monkeypatch.setenv("PEERS_DIR", str(install))
    monkeypatch.setenv("FAKE_CLIENT_EXIT", "3")
    cfg = tmp_path / "cloudd.toml"
    cfg.write_text('[engine]\ndtype = "float32"\nnum_blocks = 512\ncompile = false\ntime_kernels = false\n')
    opts = _stand_in_options(scripts, default_model_path, serve_args=("--config", str(cfg)))
    with pytest.raises(RuntimeError, match=r"(?s)against cloudd exited with 3.*the end of cloudd serve's log:\n") as e:
        run_server("cloudd", opts)
    assert "kernels: dense=" in str(e.value)  # a line of the server's own log: the plan it started with
