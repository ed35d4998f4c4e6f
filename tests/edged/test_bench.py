"""`edged bench` on the default model, one tiny run: the JSON on stdout, the progress on stderr."""

from __future__ import annotations

import io
import json
import sys

import pytest

from cloudd.trace import bundled_trace
from edged.__main__ import main
from kernels.block_products import resolve_products
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
    assert run["products"] == resolve_products("auto")  # the GGUF's blocks in BlockMatMul
    # cold, pinned system, pinned, plan: four timed requests; the line is erased before the report
    assert "\r\033[Konnx-int4 [####################] 4/4 req" in term.getvalue()
    assert term.getvalue().endswith("\r\033[K")

    quiet = _Terminal()
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", quiet)
        assert main([*args, "--no-progress"]) == 0
    assert quiet.getvalue() == "" and json.loads(capsys.readouterr().out)["runs"]

    assert main([*args, "--no-progress", "--products", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"]["onnx-int4-float32"]["products"] == "float32"


def test_the_next_plan_request_is_planned_untimed_first_and_kept_out_of_the_history(default_model_path, monkeypatch):
    from edged import bench
    from edged.generation import Batch1Generator
    from shared.model.checkpoint import load_checkpoint

    runs = []  # (prompt, constrained, the history's tokens) of every job the generator ran
    real_run = Batch1Generator.run

    def run(self, job, emit, *args, **kwargs):
        runs.append((list(job.prompt_ids), job.spec is not None, list(self.history.tokens)))
        return real_run(self, job, emit, *args, **kwargs)

    monkeypatch.setattr(Batch1Generator, "run", run)
    opts = bench.BenchOptions(model=default_model_path, backends=("torch",), quants=("none",), requests=1,
                              decode_tokens=2, plan_tokens=8, trace=bundled_trace(), progress=False)
    bench.run_bench(opts, log=None)
    tok = load_checkpoint(default_model_path).tokenizer
    timed, warm_up = bench.plan_requests(bundled_trace(), 2)
    plans = [(prompt, history) for prompt, constrained, history in runs if constrained]
    assert [prompt for prompt, _ in plans] == [tok.encode_chat(warm_up), tok.encode_chat(timed)]
    assert plans[1][1] == []  # the first timed plan's history: no earlier timed plan, not the warm-up's
