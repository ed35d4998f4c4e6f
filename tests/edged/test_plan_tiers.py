"""``edged plan-eval --tiers``: which tiers run and with which cloud, the summary's keys (with
``local_rate``), the per-answer records, and the command line's refusals; no model runs here
(``test_plan_tiers_process.py`` runs them)."""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from pathlib import Path

import pytest

import edged.plan_tiers as plan_tiers
from edged.__main__ import main
from edged.plan_eval import Answered, Outcome, summarize
from edged.plan_tiers import (SHIPPED_CLOUD_CONFIG, TierOptions, cloud_serve_args, json_lines, run_tiers,
                              shipped_cloud_kernels)
from shared.cpu_affinity import format_cpu_list

KEYS = {"tasks", "valid_rate", "grounded_rate", "requirements_met_rate", "mean_steps", "latency_p50_s",
        "latency_p90_s", "local_rate"}
RIGHT = '{"steps": [{"skill": "goto", "args": {"place": "waypoint 17"}}], "done": true, "confidence": 1}'


def outcome(latency_s: float, local: bool, met: bool = True) -> Outcome:
    return Outcome(True, True, met, 1, latency_s, local)


def test_the_summary_counts_the_share_answered_on_the_robot():
    s = summarize([outcome(0.5, True), outcome(4.0, False, met=False), outcome(0.7, True), outcome(5.0, False)])
    assert set(s) == KEYS
    assert (s["local_rate"], s["requirements_met_rate"], s["latency_p50_s"]) == (0.5, 0.75, 2.35)


@pytest.mark.parametrize("kw, error", [
    ({"tiers": ("edge", "moon")}, "tiers: choose from edge,cloud,hybrid"),
    ({"tiers": ()}, "tiers: choose from"),
    ({"tiers": ("cloud",)}, "exactly one of --cloud-model and --cloud-endpoint"),
    ({"tiers": ("hybrid",), "cloud_model": Path("m.gguf"), "cloud_endpoint": "tcp://127.0.0.1:1"}, "exactly one"),
    ({"tiers": ("cloud",), "cloud_endpoint": "tcp://127.0.0.1:1", "cloud_config": Path("c.toml")}, "goes with"),
])
def test_tier_options_refuse_unknown_tiers_and_an_unclear_cloud(kw, error):
    with pytest.raises(ValueError, match=error):
        TierOptions(**kw)


def test_the_edge_tier_alone_needs_no_cloud():
    assert TierOptions(tiers=("edge",)).cloud_endpoint is None


ANSWERS = {"edge": Answered(RIGHT, 0.5, True, -0.9), "cloud": Answered("{", 4.0, False),
           "hybrid": Answered(RIGHT, 0.6, True)}


def fake_answerer(seen: list):
    """``tier_answerer`` without models: the edge answers right at 0.5 s, the cloud wrong at
    4 s, the hybrid from the robot. ``seen`` gets (tier, options) as each tier starts."""

    @contextlib.contextmanager
    def answerer(tier, model, options, threads):
        seen.append((tier, options))
        yield lambda task, variant: ANSWERS[tier]

    return answerer


def test_run_tiers_reports_each_tier_and_variant_in_the_order_asked(monkeypatch, tmp_path):
    seen: list = []
    monkeypatch.setattr(plan_tiers, "tier_answerer", fake_answerer(seen))
    options = TierOptions(tiers=("hybrid", "cloud", "edge"), cloud_endpoint="tcp://127.0.0.1:1")
    with json_lines(tmp_path / "records.jsonl") as record:
        report = run_tiers(Path("m.gguf"), options, ("grounded", "free"), limit=3, log=None, record=record)
    assert report["tasks"] == 3 and seen == [("hybrid", options), ("cloud", options), ("edge", options)]
    assert list(report["tiers"]) == ["hybrid", "hybrid-free", "cloud", "cloud-free", "edge", "edge-free"]
    assert all(set(s) == KEYS for s in report["tiers"].values())
    edge, cloud = report["tiers"]["edge"], report["tiers"]["cloud"]
    assert (edge["local_rate"], edge["valid_rate"], edge["latency_p50_s"]) == (1.0, 1.0, 0.5)
    assert (cloud["local_rate"], cloud["valid_rate"], cloud["requirements_met_rate"]) == (0.0, 0.0, 0.0)
    rows = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and rows[0]["tier"] == "hybrid" and rows[-1]["variant"] == "free"
    edge_row = next(r for r in rows if r["tier"] == "edge")
    assert edge_row == {"tier": "edge", "variant": "grounded", "task": edge_row["task"], "text": RIGHT,
                        "latency_s": 0.5, "local": True, "mean_logprob": -0.9, "valid": True,
                        "grounded": True, "requirements_met": edge_row["requirements_met"], "steps": 1}


@pytest.mark.parametrize("argv, error", [
    (["--tiers", "edge", "--endpoint", "tcp://127.0.0.1:1"], "no --endpoint"),
    (["--tiers", "edge", "--backend", "onnx,torch"], "one --backend and one --quant"),
    (["--tiers", "cloud,hybrid"], "exactly one of --cloud-model and --cloud-endpoint"),
    (["--cloud-endpoint", "tcp://127.0.0.1:1"], "go with --tiers"),
])
def test_the_command_line_refuses_what_the_tiers_cannot_run(argv, error, capsys):
    assert main(["plan-eval", *argv]) == 2
    assert error in capsys.readouterr().err


def test_an_unknown_tier_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan-eval", "--tiers", "edge,moon"])
    assert e.value.code == 2 and "choose from edge,cloud,hybrid" in capsys.readouterr().err


def test_the_command_line_builds_the_tiers_and_prints_their_json(monkeypatch, tmp_path, capsys):
    seen: list = []
    monkeypatch.setattr(plan_tiers, "tier_answerer", fake_answerer(seen))
    config = tmp_path / "edged.toml"
    config.write_text("[escalation]\nmin_mean_logprob = -2.5\ncheck_task_names = false\n")
    assert main(["plan-eval", "--tiers", "edge,hybrid", "--cloud-endpoint", "tcp://127.0.0.1:1", "--limit", "2",
                 "--config", str(config), "--model", str(tmp_path / "m.gguf"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["tiers"]) == ["edge", "hybrid"]  # grounded only, by default
    options = seen[0][1]
    assert (options.backend, options.quant, options.cloud_endpoint) == ("onnx", "int4", "tcp://127.0.0.1:1")
    assert (options.escalation.min_mean_logprob, options.escalation.check_task_names) == (-2.5, False)


def test_a_cloud_model_given_by_a_relative_path_reaches_the_cloud_as_an_absolute_one(monkeypatch, tmp_path, capsys):
    seen: list = []
    monkeypatch.setattr(plan_tiers, "tier_answerer", fake_answerer(seen))
    (tmp_path / "big.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)  # cloudd runs from the repository root
    assert main(["plan-eval", "--tiers", "cloud", "--cloud-model", "big.gguf", "--limit", "1", "--json"]) == 0
    assert seen[0][1].cloud_model == tmp_path.resolve() / "big.gguf"
    capsys.readouterr()
    assert main(["plan-eval", "--tiers", "cloud", "--cloud-model", "no-such-model"]) == 2
    assert "neither an existing path nor a known model name" in capsys.readouterr().err


def test_a_started_cloud_runs_its_config_else_the_shipped_configs_kernels(tmp_path):
    shipped = tmp_path / "cloudd.toml"
    shipped.write_text('[engine]\nkernels = "auto,dense=int8"\n[serve]\nrobot_requests_per_s = 1.0\n')
    assert shipped_cloud_kernels(shipped) == "auto,dense=int8"
    assert shipped_cloud_kernels(tmp_path / "absent.toml") == "auto"
    assert shipped_cloud_kernels() == tomllib.loads(SHIPPED_CLOUD_CONFIG.read_text())["engine"]["kernels"]
    args = cloud_serve_args(TierOptions(tiers=("cloud",), cloud_model=Path("/m.gguf")))
    assert args[:5] == ["serve", "--model", "/m.gguf", "--kernels", shipped_cloud_kernels()]
    args = cloud_serve_args(TierOptions(tiers=("cloud",), cloud_model=Path("/m.gguf"), cloud_config=shipped))
    assert args[3:5] == ["--config", str(shipped)] and "--kernels" not in args


def two_cpus() -> frozenset[int]:
    """Two CPUs this process may use (the test is skipped on a machine with one)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("splitting robot and cloud CPUs needs two CPUs")
    return frozenset(mine[:2])


def test_robot_cpus_must_be_this_processes_and_leave_a_started_cloud_some():
    mine = frozenset(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="choose among this process's CPUs"):
        TierOptions(tiers=("edge",), robot_cpus=frozenset({max(mine) + 1}))
    with pytest.raises(ValueError, match="choose among"):
        TierOptions(tiers=("edge",), robot_cpus=frozenset())
    with pytest.raises(ValueError, match="leaves the cloud no CPU"):
        TierOptions(tiers=("cloud",), cloud_model=Path("/m.gguf"), robot_cpus=mine)
    # a running cloud's CPUs are its own: only this process is pinned
    running = TierOptions(tiers=("cloud",), cloud_endpoint="tcp://127.0.0.1:1", robot_cpus=mine)
    assert running.cpu_split() == {"robot": format_cpu_list(mine)}
    assert TierOptions(tiers=("edge",)).cloud_cpus is None and TierOptions(tiers=("edge",)).cpu_split() == {}


def test_split_cpus_pin_the_robot_side_and_start_the_cloud_on_the_others(monkeypatch):
    robot, cloud = (frozenset({cpu}) for cpu in sorted(two_cpus()))
    mine = frozenset(os.sched_getaffinity(0))
    options = TierOptions(tiers=("edge", "cloud"), cloud_model=Path("/m.gguf"), robot_cpus=robot)
    assert options.cloud_cpus == mine - robot and cloud <= options.cloud_cpus
    started, pinned_to = [], []

    class FakeDaemon:
        def __init__(self, module, args, ready, timeout_s, cpus):
            started.append(cpus)
            self.fields = {"zmq": "tcp://127.0.0.1:1"}

        def terminate(self, timeout_s):
            return 0

    monkeypatch.setattr("shared.daemon_process.DaemonProcess", FakeDaemon)

    @contextlib.contextmanager
    def answerer(tier, model, opts, threads):
        pinned_to.append((tier, os.sched_getaffinity(0), threads))
        with plan_tiers.cloud_endpoint(opts) if tier == "cloud" else contextlib.nullcontext():
            yield lambda task, variant: ANSWERS[tier]

    monkeypatch.setattr(plan_tiers, "tier_answerer", answerer)
    report = run_tiers(Path("m.gguf"), options, limit=1, log=None)
    assert pinned_to == [("edge", set(robot), 1), ("cloud", set(robot), 1)]  # a thread per robot CPU
    assert started == [mine - robot]
    assert report["cpus"] == {"robot": format_cpu_list(robot), "cloud": format_cpu_list(mine - robot)}
    assert os.sched_getaffinity(0) == mine  # unpinned afterwards


def test_the_command_line_passes_robot_cpus_and_refuses_them_without_tiers(monkeypatch, tmp_path, capsys):
    seen: list = []
    monkeypatch.setattr(plan_tiers, "tier_answerer", fake_answerer(seen))
    robot = min(os.sched_getaffinity(0))
    assert main(["plan-eval", "--tiers", "edge", "--robot-cpus", str(robot), "--limit", "1",
                 "--model", str(tmp_path / "m.gguf"), "--json"]) == 0
    assert seen[0][1].robot_cpus == frozenset({robot})
    assert json.loads(capsys.readouterr().out)["cpus"] == {"robot": str(robot)}
    assert main(["plan-eval", "--robot-cpus", "0"]) == 2
    assert "go with --tiers" in capsys.readouterr().err
    assert main(["plan-eval", "--tiers", "edge", "--robot-cpus", "1-0"]) == 2
    assert "runs backwards" in capsys.readouterr().err
