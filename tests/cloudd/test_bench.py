"""`cloudd bench` end to end on a tiny HF checkpoint: variants, baseline and the §6 JSON keys."""

from __future__ import annotations

import json
import os

import pytest

from cloudd.__main__ import main
from cloudd.trace import bundled_trace, load_trace
from shared.model.gguf_loader import build_tokenizer, read_gguf
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
            "--output-len", "2", "--tiers", "off,on,layerwise", "--device-pool-frac", "0.2", "--json"]
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
