"""`edged bench` on the default model, one tiny run: the JSON on stdout, the progress on stderr."""

from __future__ import annotations

import io
import json
import sys

import pytest

from cloudd.trace import bundled_trace
from edged.__main__ import main
from shared import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bench_draws_progress_on_stderr_and_keeps_stdout_json(default_model_path, monkeypatch, capsys):
    pytest.importorskip("onnxruntime_genai", reason="needs the onnx extra")
    args = ["bench", "--model", str(default_model_path), "--backend", "onnx", "--quant", "int4",
            "--requests", "1", "--decode-tokens", "2", "--plan-tokens", "24", "--trace", str(bundled_trace()), "--json"]
    term = _Terminal()
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", term)
        m.setattr(progress, "TTY_REFRESH_S", 0.0)  # every update draws: the last one is 3/3
        assert main(args) == 0
    report = json.loads(capsys.readouterr().out)  # exactly one JSON object
    run = report["runs"]["onnx-int4"]
    assert run["requests"] == 1 and run["speculation"] and 0 <= run["acceptance_rate"] <= 1
    assert run["plan_tokens"] >= 1 and run["plan_s"] >= run["ttft_s"] > 0
    # cold, pinned system, pinned, plan: four timed requests; the line is erased before the report
    assert "\r\033[Konnx-int4 [####################] 4/4 req" in term.getvalue()
    assert term.getvalue().endswith("\r\033[K")

    quiet = _Terminal()
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", quiet)
        assert main([*args, "--no-progress"]) == 0
    assert quiet.getvalue() == "" and json.loads(capsys.readouterr().out)["runs"]
