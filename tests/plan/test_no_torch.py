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
