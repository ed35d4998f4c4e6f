"""`cloudd bench` end to end on a tiny HF checkpoint: variants, baseline and the §6 JSON keys."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from cloudd.__main__ import main
from cloudd.trace import bundled_trace, load_trace
from shared.model.gguf_loader import build_tokenizer, read_gguf
from shared.progress import Progress
from tests.cloudd.vllm_peer_fake import fake_vllm_peer
from tests.model.tiny_hf import SIZES, TEMPLATE, save_tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LATENCY_KEYS = {"p50", "p99", "mean"}
RUN_KEYS = {"trace", "requests", "output_tok_s", "total_tok_s", "ttft_s", "tpot_s", "e2e_s",
            "prefix_hit_rate", "peak_rss_mb", "by_priority"}


@pytest.fixture(scope="module")
def tiny_folder(default_model_path, tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-hf")
    tokenizer = build_tokenizer(read_gguf(default_model_path)[0])
    save_tiny(folder, LlamaConfig(**{**SIZES, "max_position_embeddings": 4096}, tie_word_embeddings=True),
              tokenizer, {"chat_template": TEMPLATE, "eos_token": "<|im_end|>"})
    return folder


def test_bench_json_has_every_variant_baseline_and_ratio(tiny_folder, capsys):
    args = ["bench", "--model", str(tiny_folder), "--trace", str(bundled_trace()), "--limit", "6",
            "--output-len", "4", "--index", "radix,hashed", "--baseline", "hf", "--baseline-batch", "4",
            "--num-blocks", "512", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)  # exactly one JSON object on stdout
    assert result["runs"]["radix"]["compiled"] and result["runs"]["hashed"]["compiled"]  # the CLI's default
    assert set(result["runs"]) == {"radix", "hashed"}
    for run in [*result["runs"].values(), result["baseline"]]:
        assert RUN_KEYS <= set(run)
        assert run["requests"] == 6 and run["output_tokens"] == 24
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert set(run[key]) == LATENCY_KEYS
        assert set(run["by_priority"]) <= {"0", "1"}
    radix, hashed = result["runs"]["radix"], result["runs"]["hashed"]
    # the demo trace shares long system prompts: both indexes reuse, the token-exact one more
    assert radix["prefix_hit_rate"] >= hashed["prefix_hit_rate"] > 0.3
    assert radix["ratio"] == pytest.approx(radix["output_tok_s"] / result["baseline"]["output_tok_s"])


def test_bench_rejects_an_unknown_variant(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--index", "radix,lru"])
    assert "choose from radix,hashed" in capsys.readouterr().err


def test_trace_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": []}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(bad)
    assert len(load_trace(bundled_trace(), limit=5)) == 5


def test_bench_compares_tier_variants(tiny_folder, capsys):
    args = ["bench", "--model", str(tiny_folder), "--trace", str(bundled_trace()), "--limit", "8",
            "--output-len", "2", "--tiers", "off,on,layerwise", "--device-pool-frac", "0.2", "--json", "--no-compile"]
    assert main(args) == 0
    captured = capsys.readouterr()
    runs = json.loads(captured.out)["runs"]
    assert set(runs) == {"tiers-off", "tiers-on", "tiers-layerwise"}
    assert "tiers" not in runs["tiers-off"]
    for name in ("tiers-on", "tiers-layerwise"):  # a request may end early by the small pool: in every run
        assert runs[name]["requests"] == 8 and runs[name]["output_tokens"] == runs["tiers-off"]["output_tokens"]
    assert runs["tiers-on"]["tiers"]["loads_layerwise"] == 0  # "auto" on a CPU: whole loads
    assert runs["tiers-layerwise"]["tiers"]["loads_layerwise"] == runs["tiers-layerwise"]["tiers"]["loads"]
    assert runs["tiers-on"]["vs_tiers_off"] > 0 and runs["tiers-layerwise"]["vs_whole_loads"] > 0
    assert "layerwise:" in captured.err


# --- the vLLM peer baseline, with a stand-in peer (the real one is not needed by `make test`) ---

FAKE_OFFLINE = '''
import argparse, json, sys
ap = argparse.ArgumentParser()
for flag in ("--trace", "--model", "--output-len", "--dtype", "--repeats"):  # offline.py's flags
    ap.add_argument(flag)
args = ap.parse_args()
print("INFO vllm noise on stdout")
print("INFO vllm log on stderr", file=sys.stderr)
n = sum(1 for line in open(args.trace) if line.strip())
out = n * int(args.output_len)
assert "/models/tiny-hf" in args.model and args.model.endswith("-hf"), args.model  # the HF folder made from the engine's model
print(json.dumps({"wall_s": 2.0, "requests": n, "prompt_tokens": 100 * n, "output_tokens": out,
                  "output_tok_s": out / 2.0, "total_tok_s": (100 * n + out) / 2.0, "prefix_hit_rate": 0.5,
                  "engine": "fake-vllm", "dtype": args.dtype, "trace": args.trace}))
'''


def _fake_peer(tmp_path, script: str = FAKE_OFFLINE, model: Path | None = None):
    """A stand-in peer whose offline.py is ``script``; (--peers-dir, PEERS_DIR)."""
    return fake_vllm_peer(tmp_path, {"offline.py": script}, model)


def test_bench_vllm_peer_is_a_run_with_the_same_keys_and_a_ratio(tiny_folder, tmp_path, monkeypatch, capsys):
    scripts, install = _fake_peer(tmp_path, model=tiny_folder)
    monkeypatch.setenv("PEERS_DIR", str(install))
    args = ["bench", "--model", str(tiny_folder), "--trace", str(bundled_trace()), "--robots", "2",
            "--output-len", "3", "--num-blocks", "512", "--dtype", "float32", "--baseline", "vllm",
            "--peers-dir", str(scripts), "--json", "--no-compile"]
    assert main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # one object: vLLM's stdout noise stays out of it
    radix, vllm = result["runs"]["radix"], result["runs"]["vllm"]
    assert set(result["runs"]) == {"radix", "vllm"}
    # the peer replayed exactly the engine's requests (the first two robots), same output length
    assert vllm["requests"] == radix["requests"] < 32 and vllm["output_tokens"] == radix["output_tokens"]
    assert {"output_tok_s", "total_tok_s", "prefix_hit_rate", "wall_s"} <= set(vllm)
    assert vllm["dtype"] == "float32" and vllm["trace"] == str(bundled_trace())  # the engine's dtype
    assert radix["vs_vllm"] == pytest.approx(radix["output_tok_s"] / vllm["output_tok_s"])
    assert "x vLLM CPU's output tok/s" in captured.err and "vllm log on stderr" not in captured.err


def test_bench_vllm_peer_not_set_up_fails_before_any_engine_run(tmp_path, monkeypatch, capsys):
    scripts, install = _fake_peer(tmp_path)
    monkeypatch.setenv("PEERS_DIR", str(install))
    # NOTE: not a model: the peer check must fail first, before the engine loads anything
    (tmp_path / "not-a-model.gguf").write_bytes(b"")
    args = ["bench", "--model", str(tmp_path / "not-a-model.gguf"), "--trace", str(bundled_trace()), "--limit", "2",
            "--baseline", "hf,vllm", "--peers-dir", str(scripts), "--json", "--no-compile"]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "vLLM peer is not set up: missing the model folder" in captured.err
    assert f"PEERS_DIR={install} bash" in captured.err and "vllm-cpu/setup.sh" in captured.err


def test_bench_vllm_peer_missing_python_names_the_setup_script(tmp_path, monkeypatch, capsys):
    from cloudd.peer_baseline import PeerUnavailable, VllmPeer

    scripts = tmp_path / "peers"  # the scripts are there; the peer's venv and model are not
    (scripts / "vllm-cpu").mkdir(parents=True)
    (scripts / "vllm-cpu" / "offline.py").write_text("")
    peer = VllmPeer(scripts=scripts, install=tmp_path / "install", gguf=tmp_path / "qwen.gguf")
    with pytest.raises(PeerUnavailable, match=r"missing the vLLM venv.s python .* and the model folder") as e:
        peer.check()
    assert "bash " in str(e.value) and str(scripts / "vllm-cpu" / "setup.sh") in str(e.value)


def test_bench_vllm_peer_failure_shows_the_end_of_its_log(tiny_folder, tmp_path, monkeypatch, capsys):
    scripts, install = _fake_peer(tmp_path, "import sys\nprint('RuntimeError: no AVX-512', file=sys.stderr)\n"
                                            "sys.exit(3)\n", model=tiny_folder)
    monkeypatch.setenv("PEERS_DIR", str(install))
    args = ["bench", "--model", str(tiny_folder), "--trace", str(bundled_trace()), "--limit", "2",
            "--baseline", "vllm", "--peers-dir", str(scripts), "--json", "--no-compile"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "offline.py exited with 3" in err and "RuntimeError: no AVX-512" in err


def test_the_peer_runs_the_hf_folder_setup_made_from_the_engines_gguf(tmp_path):
    from cloudd.peer_baseline import VllmPeer, hf_folder_name
    from shared.model.fetch import MODELS

    assert hf_folder_name(Path("/c") / MODELS["qwen2.5-coder-1.5b"].filename) == "qwen2.5-coder-1.5b-hf"
    assert hf_folder_name(Path("/c") / MODELS["smollm2-135m"].filename) == "smollm2-135m-hf"
    assert hf_folder_name(Path("/elsewhere/my-model.Q8_0.gguf")) == "my-model.Q8_0-hf"
    peer = VllmPeer(scripts=tmp_path, install=tmp_path / "i", gguf=Path("/c") / MODELS["qwen2.5-coder-1.5b"].filename)
    assert peer.model("bfloat16") == tmp_path / "i" / "models" / "qwen2.5-coder-1.5b-hf" / "bf16"
    assert peer.model("float32") == tmp_path / "i" / "models" / "qwen2.5-coder-1.5b-hf"


def test_peer_json_is_the_last_json_line_with_the_throughput_keys():
    from cloudd.peer_baseline import parse_peer_json

    ok = '{"wall_s": 1, "output_tok_s": 2, "total_tok_s": 3, "prefix_hit_rate": 0.5}'
    assert parse_peer_json(f"INFO starting\n{{not json\n{ok}\n\n")["output_tok_s"] == 2
    with pytest.raises(ValueError, match="lacks total_tok_s, prefix_hit_rate"):
        parse_peer_json('{"wall_s": 1, "output_tok_s": 2}')
    with pytest.raises(ValueError, match="no JSON object"):
        parse_peer_json("Traceback ...\n")


# --- the progress line ---

class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_a_terminal_line_at_most_four_times_a_second():
    clock, term = _Clock(), _Terminal()
    progress = Progress("radix", 16, stream=term, clock=clock)
    calls = []

    def counts():
        calls.append(clock.t)
        return 4, 200

    for _ in range(10):  # ten steps within 0.1 s: nothing due, counts never taken
        clock.t += 0.01
        progress.update(counts)
    assert calls == [] and term.getvalue() == ""
    clock.t = 102.0
    progress.update(counts)
    progress.update(counts)  # same instant: not due again
    assert len(calls) == 1
    assert term.getvalue() == "\r\033[Kradix [#####...............] 4/16 req  100.0 out tok/s  2 s"
    progress.close()
    assert term.getvalue().endswith("\r\033[K")  # the report that follows starts on a clean line


def test_progress_off_a_terminal_writes_occasional_plain_lines_and_can_be_off():
    clock, log = _Clock(), io.StringIO()
    progress = Progress("hashed", 8, stream=log, clock=clock)
    for _ in range(100):  # 20 s of steps, 0.2 s apart
        clock.t += 0.2
        progress.update(lambda: (1, 10))
    progress.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hashed [##") and "\r" not in log.getvalue()
    quiet = Progress("radix", 8, enabled=False, stream=_Terminal(), clock=clock)
    clock.t += 100
    quiet.update(lambda: pytest.fail("a disabled progress takes no counts"))
    quiet.close()
    assert quiet.stream.getvalue() == ""
    assert Progress("vllm", None, stream=log).line(0, 0, elapsed=12.3) == "vllm: running, 12 s"


def test_bench_profile_reports_each_run_against_the_best_matmul_peak(tiny_folder, monkeypatch, capsys):
    """The peak is measured before the runs and after each; every run's fraction is against the
    best so far (one slow measurement on a noisy machine must not inflate the fraction)."""
    measured = iter([1e9, 3e9, 2e9])  # before the runs, after radix, after hashed
    monkeypatch.setattr("cloudd.bench.matmul_peak_flops", lambda dtype, device: next(measured))
    args = ["bench", "--model", str(tiny_folder), "--trace", str(bundled_trace()), "--limit", "3",
            "--output-len", "2", "--index", "radix,hashed", "--num-blocks", "256", "--no-compile", "--profile", "--json"]
    assert main(args) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    for name in ("radix", "hashed"):
        profile = runs[name]["profile"]
        assert profile["peak_gflop_s"] == pytest.approx(3.0)
        assert profile["peak_frac"] == pytest.approx(profile["achieved_gflop_s"] / 3.0)
        assert profile["steps"] > 0 and set(profile["share"]) >= {"model", "attention", "logits"}
