"""edged.export: the HF folder written for the builder, the cache's key and reuse, and the errors."""

import json

import pytest
import torch

from edged import export
from edged.export import ExportError, cache_dir_for, export_onnx, hf_config_dict, write_hf_folder
from shared.model.model_config import ModelConfig, RopeScaling, tiny_config


class _Tok:
    bos_token_id, bos_token, eos_token = 1, "<s>", "</s>"

    class backend:
        @staticmethod
        def token_to_id(token):
            return 2


@pytest.mark.parametrize("config", [
    tiny_config(),
    tiny_config(arch="qwen2", attention_bias=True, tie_word_embeddings=False, rope_theta=1e6),
    tiny_config(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
])
def test_hf_config_reads_back_as_the_same_model_config(config):
    d = json.loads(json.dumps(hf_config_dict(config, _Tok)))
    assert ModelConfig.from_hf_dict(d) == config
    assert d["bos_token_id"] == 1 and d["eos_token_id"] == 2


def test_gguf_dequantized_folder_loads_back_identically(default_model_path, default_checkpoint, tmp_path):
    from shared.model.checkpoint import load_checkpoint

    again = load_checkpoint(write_hf_folder(default_model_path, tmp_path / "hf"))
    assert again.config == default_checkpoint.config
    assert again.weights.keys() == default_checkpoint.weights.keys()
    assert all(torch.equal(again.weights[k], w) for k, w in default_checkpoint.weights.items())
    text = "Plan: go to aisle 4."
    assert again.tokenizer.encode(text) == default_checkpoint.tokenizer.encode(text)
    assert again.tokenizer.chat_template == default_checkpoint.tokenizer.chat_template


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="quant"):
        export_onnx(tmp_path, "fp8")
    with pytest.raises(ValueError, match="target"):
        export_onnx(tmp_path, "int4", target="tpu")
    with pytest.raises(ValueError, match="products="):
        export_onnx(tmp_path, "int4", products="int8")
    with pytest.raises(FileNotFoundError):
        export_onnx(tmp_path / "missing.gguf", "int4")


def test_missing_builder_names_the_extra(monkeypatch, tmp_path):
    real = export.importlib.util.find_spec
    monkeypatch.setattr(export.importlib.util, "find_spec",
                        lambda name: None if name == "onnxruntime_genai" else real(name))
    with pytest.raises(ExportError, match=r"fleetserve\[onnx\]"):
        export_onnx(tmp_path, "int4")


def test_cache_sits_beside_the_model_or_under_the_root(tmp_path):
    model = tmp_path / "m.gguf"
    assert cache_dir_for(model, "int4", "cpu") == tmp_path / "m.gguf.onnx" / "int4-cpu"
    assert cache_dir_for(model, "int8", "cuda", tmp_path / "c") == tmp_path / "c" / "m.gguf.onnx" / "int8-cuda"
    assert cache_dir_for(model, "int4", "cpu", bf16_products=True) == tmp_path / "m.gguf.onnx" / "int4-cpu-bf16"


def _fake_build(calls):
    def build(model_path, quant, target, tmp, out):
        calls.append(quant)
        out.mkdir()
        (out / "model.onnx").write_bytes(b"graph")
    return build


def test_export_is_reused_until_the_model_changes(monkeypatch, tmp_path):
    monkeypatch.setattr(export, "builder_version", lambda: "0.0-test")
    monkeypatch.setattr(export, "_carries_blocks", lambda *args: False)  # the bytes below are no real GGUF
    graph_edits = pytest.importorskip("edged.graph_edits", reason="needs onnx")
    monkeypatch.setattr(graph_edits, "set_activation_precision", lambda *args, **kwargs: 0)  # nor a real graph
    calls = []
    monkeypatch.setattr(export, "_build", _fake_build(calls))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights v1")
    out = export_onnx(model, "int4")
    assert export_onnx(model, "int4") == out and calls == ["int4"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["key"]["quant"] == "int4" and manifest["files"] == ["model.onnx"]
    model.write_bytes(b"weights v2")
    assert export_onnx(model, "int4") == out and calls == ["int4", "int4"]
    assert [p.name for p in out.parent.iterdir()] == ["int4-cpu"]  # no temp or stale dirs left


def test_failed_build_leaves_no_export(monkeypatch, tmp_path):
    monkeypatch.setattr(export, "builder_version", lambda: "0.0-test")

    def fail(*args):
        raise ExportError("builder failed")
    monkeypatch.setattr(export, "_build", fail)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    with pytest.raises(ExportError):
        export_onnx(model, "none")
    assert list((tmp_path / "m.gguf.onnx").iterdir()) == []


def test_tiny_hf_folder_exports_and_matches_torch(default_checkpoint, tmp_path):
    """The real builder on a 2-layer random model: fp32 greedy tokens equal the torch backend's."""
    pytest.importorskip("onnxruntime_genai")
    from transformers import LlamaConfig

    from edged.backends.onnx_backend import OnnxBackend
    from edged.backends.torch_backend import TorchBackend
    from edged.quality import greedy_ids
    from shared.model.checkpoint import load_checkpoint
    from tests.model.tiny_hf import SIZES, save_tiny

    folder = tmp_path / "tiny"
    # NOTE: ORT's GroupQueryAttention needs head_dim % 16 == 0; SIZES alone gives 8.
    config = LlamaConfig(**{**SIZES, "hidden_size": 64, "intermediate_size": 128},
                         tie_word_embeddings=True, rope_theta=100000.0)
    config.architectures = ["LlamaForCausalLM"]
    save_tiny(folder, config, default_checkpoint.tokenizer, {"tokenizer_class": "PreTrainedTokenizerFast"})
    out = export_onnx(folder, "none", cache_root=tmp_path / "cache")
    assert out == tmp_path / "cache" / "tiny.onnx" / "none-cpu"
    onnx = OnnxBackend(out, max_len=64, threads=1)
    ref = TorchBackend(load_checkpoint(folder), 64)
    prompt = [1, 500, 2000, 40000, 7]
    assert greedy_ids(onnx, prompt, 16) == greedy_ids(ref, prompt, 16)
