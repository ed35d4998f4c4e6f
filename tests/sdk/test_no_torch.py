"""robot_sdk runs on robot computers without torch: importing it must not load torch."""

import subprocess
import sys
from pathlib import Path


def test_importing_robot_sdk_does_not_import_torch():
    code = ("import sys, robot_sdk, robot_sdk.aio; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'xgrammar')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout
