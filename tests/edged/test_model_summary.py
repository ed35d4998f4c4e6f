"""How the daemons name their model (``shared.model.summary``): the file's stem, architecture and
parameter count, read from the file's header alone, counting what the file holds."""

from __future__ import annotations

import math

import pytest

from shared.config import model_cache_dir
from shared.model.fetch import MODELS
from shared.model.gguf_loader import read_gguf
from shared.model.summary import ModelSummary, describe, model_stats, num_params
from tests.engine.tiny import tiny_model


def elements(path) -> int:
    """Every value the GGUF file's tensors hold (each dequantized tensor's element count)."""
    return sum(math.prod(t.shape) for t in read_gguf(path)[1])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_num_params_is_torchs_count_of_the_model(tied, arch):
    model = tiny_model(tie_word_embeddings=tied, arch=arch, attention_bias=arch == "qwen2")
    assert num_params(model.config) == sum(p.numel() for p in model.parameters())


def test_the_default_model_reads_as_its_stem_llama_and_135m(default_model_path):
    summary = ModelSummary.read(default_model_path)
    assert summary == ModelSummary("SmolLM2-135M-Instruct.Q4_1", "llama", elements(default_model_path))
    assert str(summary) == "SmolLM2-135M-Instruct.Q4_1 (llama, 135M params)"


def test_the_cloud_model_counts_the_output_matrix_its_gguf_stores():
    """Qwen2.5-Coder-1.5B is 1.54B with tied embeddings; this GGUF stores the output matrix apart
    (the engine loads both), so the file holds 1.78B, as llama.cpp also reports."""
    path = model_cache_dir() / MODELS["qwen2.5-coder-1.5b"].filename
    if not path.is_file():
        pytest.skip(f"the cloud model's GGUF is not cached at {path}")
    summary = ModelSummary.read(path)
    assert (summary.arch, summary.params) == ("qwen2", elements(path))
    assert str(summary) == "qwen2.5-coder-1.5b-instruct-q4_k_m (qwen2, 1.78B params)"


def test_sizes_have_three_significant_digits_and_unknowns_a_dash():
    assert [describe("llama", n) for n in (1_543_714_304, 134_515_008, 36_928, 12)] == \
        ["llama, 1.54B params", "llama, 135M params", "llama, 36.9K params", "llama, 12 params"]
    assert describe(None, None) == "-" and describe("qwen2", None) == "qwen2"
    assert model_stats("m", None) == {"model": "m", "model_arch": None, "model_params": None}
    assert model_stats("m", ModelSummary("m", "qwen2", 7)) == {"model": "m", "model_arch": "qwen2", "model_params": 7}


def test_a_path_that_is_no_model_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .gguf file or HF folder"):
        ModelSummary.read(tmp_path)
