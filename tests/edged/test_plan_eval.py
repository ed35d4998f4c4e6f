"""``edged plan-eval``: the bundled tasks make sense (every pattern names a skill, argument and
scene name that exist), the judge's three rates, and a short run end to end."""

from __future__ import annotations

import json

import pytest

from edged.plan_eval import PLAN_TASKS, EvalTask, judge, load_tasks, run_plan_eval
from robot_sdk.scene import Scene
from robot_sdk.skills import Skill

SCENE = Scene(places=("waypoint 17", "packing station"), objects=("tote 12",))
TASK = EvalTask("t", "Bring tote 12 to the packing station.", SCENE,
                (Skill.of("goto", "drive", {"place": "place"}), Skill.of("lift", "lift", {"load": "object"})),
                ({"skill": "lift", "args": {"load": "tote 12"}}, {"skill": "goto", "args": {"place": "packing station"}}))


def plan(*steps: tuple[str, dict]) -> str:
    return json.dumps({"steps": [{"skill": s, "args": a} for s, a in steps], "done": True, "confidence": 0.5})


def test_the_bundled_tasks_are_sixty_or_more_over_several_scenes_and_all_make_sense():
    tasks = load_tasks()
    assert len(tasks) >= 60 and len({t.scene for t in tasks}) >= 4 and len({t.id for t in tasks}) == len(tasks)
    assert all(t.requires for t in tasks)


def test_a_pattern_naming_something_outside_its_scene_is_refused(tmp_path):
    data = json.loads(PLAN_TASKS.read_text())
    data["tasks"][0]["requires"] = [{"skill": "goto", "args": {"place": "the moon"}}]
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'the moon' is not in its scene"):
        load_tasks(path)


def test_judge_counts_valid_grounded_and_requirements_met():
    right = judge(TASK, plan(("goto", {"place": "waypoint 17"}), ("lift", {"load": "tote 12"}),
                             ("goto", {"place": "packing station"})), 1.0)
    assert (right.valid, right.grounded, right.requirements_met, right.steps) == (True, True, True, 3)
    wrong_order = judge(TASK, plan(("goto", {"place": "packing station"}), ("lift", {"load": "tote 12"})), 1.0)
    assert wrong_order.valid and wrong_order.grounded and not wrong_order.requirements_met
    made_up = judge(TASK, plan(("lift", {"load": "tote 12"}), ("goto", {"place": ")[1],"})), 1.0)
    assert made_up.valid and not made_up.grounded and not made_up.requirements_met
    broken = judge(TASK, '{"steps": [{"skill": "fly"', 1.0)
    assert (broken.valid, broken.grounded, broken.requirements_met) == (False, False, False)


def test_a_short_run_reports_the_rates_per_variant(default_model_path):
    report = run_plan_eval(default_model_path, ("torch",), ("none",), limit=2, log=None)
    assert report["tasks"] == 2 and set(report["runs"]) == {"torch-none", "torch-none-free"}
    for summary in report["runs"].values():
        assert {"tasks", "valid_rate", "grounded_rate", "requirements_met_rate", "mean_steps",
                "latency_p50_s"} <= set(summary)
    assert report["runs"]["torch-none"]["grounded_rate"] == 1.0  # the grammar allows only the scene's names
