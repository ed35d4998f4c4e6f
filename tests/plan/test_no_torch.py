"""The plan format runs on robot computers without torch: importing it must not load torch."""

import subprocess
import sys
from pathlib import Path


def test_importing_the_plan_format_does_not_import_torch():
    code = ("import sys, shared.plan, shared.plan.answer, shared.plan.budget, shared.plan.check, "
            "shared.plan.schema, shared.plan.skill; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout


def test_importing_robot_sdk_and_the_plan_format_leaves_jsonschema_to_the_first_validation():
    code = ("import sys, robot_sdk, shared.plan; before = 'jsonschema' in sys.modules; "
            "from shared.engine.grammar.response_format import fleet_plan_format, grammar_spec; "
            "shared.plan.spec_schema(grammar_spec(fleet_plan_format())); "
            "print(before, 'jsonschema' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False True", out.stdout
