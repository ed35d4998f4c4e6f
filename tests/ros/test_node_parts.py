"""The node's plain-Python parts, without rclpy: the discovery guard, goal checking and
defaults, skill sets, and the diagnostics report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from robot_sdk.ros.env import DiscoveryNotLocal, ensure_local_discovery
from robot_sdk.ros.plan_request import PlanDefaults, plan_args
from robot_sdk.ros.skill_sets import load_skill_sets
from robot_sdk.scene import Scene
from robot_sdk.ros.status import EndpointStatus, Level

ROOT = Path(__file__).resolve().parents[2]


def goal(**fields) -> SimpleNamespace:
    base = dict(task="Bring crate 17 to the packing station.", scene_json="", skills="", schema_json="",
                priority="", deadline_ms=0, escalation="", max_tokens=0, scene_places=[], scene_objects=[],
                scene_people=[])
    return SimpleNamespace(**{**base, **fields})


# --- discovery guard ----------------------------------------------------------------------------


def test_unset_discovery_range_becomes_localhost():
    env = {}
    ensure_local_discovery(env)
    assert env == {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}


@pytest.mark.parametrize("env", [
    {"ROS_AUTOMATIC_DISCOVERY_RANGE": "SUBNET"},
    {"ROS_AUTOMATIC_DISCOVERY_RANGE": "SYSTEM_DEFAULT"},
    {"ROS_STATIC_PEERS": "127.0.0.1;192.168.1.20"},
    {"RMW_IMPLEMENTATION": "rmw_cyclonedds_cpp"},
])
def test_anything_that_could_leave_the_machine_is_refused(env):
    with pytest.raises(DiscoveryNotLocal):
        ensure_local_discovery(dict(env))


def test_loopback_static_peers_and_fastdds_are_allowed():
    ensure_local_discovery({"ROS_STATIC_PEERS": "127.0.0.1;localhost;[::1]", "RMW_IMPLEMENTATION": "rmw_fastrtps_cpp"})


def test_the_node_process_refuses_a_subnet_discovery_range_before_rclpy_init():
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "SUBNET"}
    proc = subprocess.run([sys.executable, "-m", "robot_sdk.ros"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "LOCALHOST" in proc.stderr


# --- goals --------------------------------------------------------------------------------------

SETS = load_skill_sets()


def test_empty_fields_take_the_node_defaults():
    args = plan_args(goal(), PlanDefaults(skills="amr", deadline_ms=500), SETS)
    assert (args.skills_id, args.priority, args.escalation, args.max_tokens, args.deadline_ms) == \
        ("amr", "plan", "auto", None, 500)
    assert [s.name for s in args.skills][:3] == ["goto", "dock", "undock"] and args.schema is None


def test_max_tokens_left_at_zero_is_the_clients_own_room_for_max_steps_complete_steps():
    """The independent client's five-step warehouse task was cut at four steps by a default of
    384: with 0 (the default) PlanClient sizes it for max_steps steps of the goal's skills."""
    warehouse = goal(skills="warehouse", scene_places=["waypoint 17", "packing station"], scene_objects=["tote 12"])
    assert PlanDefaults().max_tokens == 0
    PlanDefaults().check(SETS)
    assert plan_args(warehouse, PlanDefaults(), SETS).client_kwargs()["max_tokens"] is None
    assert plan_args(warehouse, PlanDefaults(max_tokens=500), SETS).max_tokens == 500  # an operator's default
    assert plan_args(goal(max_tokens=2048), PlanDefaults(), SETS).max_tokens == 2048  # a goal's own, up to the cap
    with pytest.raises(ValueError, match="max_tokens: -1 is out of range"):
        PlanDefaults(max_tokens=-1).check(SETS)


def test_goal_fields_override_the_defaults():
    args = plan_args(goal(skills="manipulator", priority="safety", deadline_ms=2000, escalation="local",
                          max_tokens=64, scene_json='{"at": "table"}'), PlanDefaults(), SETS)
    assert (args.skills_id, args.priority, args.deadline_ms, args.escalation, args.max_tokens) == \
        ("manipulator", "safety", 2000, "local", 64)
    assert args.scene == {"at": "table"}
    assert args.client_kwargs()["skills"] == SETS["manipulator"]


def test_scene_names_make_a_scene_whose_notes_are_the_scene_json_text():
    args = plan_args(goal(skills="warehouse", scene_places=["waypoint 17", "packing station"],
                          scene_objects=["crate 17"], scene_json="Aisle 4 is blocked."), PlanDefaults(), SETS)
    assert args.scene == Scene(places=("waypoint 17", "packing station"), objects=("crate 17",),
                               notes="Aisle 4 is blocked.")
    goto = next(s for s in args.skills if s.name == "goto").grounded(args.scene)
    assert goto.to_wire()["args"] == {"waypoint": ["waypoint 17", "packing station"]}


def test_bad_scene_names_are_a_clear_error():
    with pytest.raises(ValueError, match="scene.places: duplicate names"):
        plan_args(goal(scene_places=["w1", "w1"]), PlanDefaults(), SETS)


def test_a_schema_replaces_the_skills():
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    args = plan_args(goal(schema_json=json.dumps(schema), skills="amr"), PlanDefaults(), SETS)
    assert args.schema == schema and args.skills is None and args.skills_id == ""


@pytest.mark.parametrize("fields, field", [
    (dict(task="  "), "task"),
    (dict(task="x" * 2001), "task"),
    (dict(scene_json="[1, 2]"), "scene_json"),
    (dict(scene_json="{not json"), "scene_json"),
    (dict(schema_json='"a string"'), "schema_json"),
    (dict(skills="drone"), "skills"),
    (dict(priority="urgent"), "priority"),
    (dict(escalation="moon"), "escalation"),
    (dict(max_tokens=4096), "max_tokens"),
])
def test_a_bad_field_is_named(fields, field):
    with pytest.raises(ValueError, match=field):
        plan_args(goal(**fields), PlanDefaults(), SETS)


def test_bad_defaults_are_named_by_their_parameter():
    with pytest.raises(ValueError, match="default_skills"):
        PlanDefaults(skills="drone").check(SETS)
    with pytest.raises(ValueError, match="default_deadline_ms"):
        PlanDefaults(deadline_ms=-1).check(SETS)


# --- skill sets ---------------------------------------------------------------------------------


def test_builtin_sets_are_the_fleet_skills():
    assert len(SETS["fleet"]) == len(SETS["amr"]) + len(SETS["manipulator"]) == 18
    goto = SETS["amr"][0]
    assert goto.to_wire() == {"name": "goto", "description": "drive to a named waypoint in the warehouse map",
                              "args": {"waypoint": "string", "speed": "number"}}


def test_a_file_adds_and_replaces_sets(tmp_path):
    path = tmp_path / "sets.json"
    path.write_text(json.dumps({"picker": [{"name": "pick", "description": "grasp", "args": {"object": "string"}}],
                                "amr": [{"name": "beep", "description": "beep once"}]}))
    sets = load_skill_sets(path)
    assert [s.name for s in sets["picker"]] == ["pick"] and [s.name for s in sets["amr"]] == ["beep"]
    assert "fleet" in sets


def test_a_malformed_file_is_named(tmp_path):
    path = tmp_path / "sets.json"
    path.write_text(json.dumps({"picker": [{"description": "no name"}]}))
    with pytest.raises(ValueError, match="picker"):
        load_skill_sets(path)
    with pytest.raises(ValueError, match="skill_sets_file"):
        load_skill_sets(tmp_path / "missing.json")


# --- diagnostics --------------------------------------------------------------------------------


def test_report_levels_follow_probe_and_plans():
    status = EndpointStatus("tcp://127.0.0.1:1")
    assert status.report(0, 2).level is Level.STALE
    status.probed(None, None)
    assert status.report(0, 2).level is Level.ERROR
    status.probed("ok", 0.4)
    assert status.report(0, 2).level is Level.OK
    status.planned(False, 1.5, "")
    assert status.report(0, 2).level is Level.WARN
    status.planned(True, 2.25, "cloud")
    report = status.report(1, 2)
    values = dict(report.values)
    assert report.level is Level.OK and values["last_latency_s"] == "2.250" and values["last_source"] == "cloud"
    assert (values["plans_ok"], values["plans_failed"], values["active_plans"]) == ("1", "1", "1")
    status.probed("draining", 0.3)
    assert status.report(0, 2).level is Level.WARN


def test_the_node_imports_no_torch():
    pytest.importorskip("rclpy", exc_type=ImportError)
    pytest.importorskip("fleetserve_interfaces", exc_type=ImportError)
    code = "import sys, robot_sdk.ros.node; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
