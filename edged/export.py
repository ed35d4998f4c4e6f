"""`edged export`: a model (GGUF or HF folder) -> an ONNX graph built by onnxruntime-genai's model
builder (fused GroupQueryAttention over one preallocated KV buffer, MatMulNBits int4/int8
weights), cached beside the model. An int4 CPU export of a GGUF holds the file's own blocks
(``edged.carry_blocks``), multiplied by fleetserve's ``BlockMatMul`` op where its library builds
(``kernels.ort_ops``; the session then loads it, ``edged.backends.onnx_backend``).

Cache layout, for a model at ``<dir>/<name>`` (a ``.gguf`` file or a HF folder)::

    <dir>/<name>.onnx/<quant>-<target>[-bf16]/model.onnx        (+ model.onnx.data, genai_config.json)
                                              manifest.json     (written last; its key says what it was built from)

(``-bf16``: BlockMatMul's products in bfloat16, beside the float32 export of the same graph.)

A directory whose manifest key matches (model content hash, builder version, quant, target, and
the versions of those edits) is
reused; anything else is rebuilt in a temporary sibling directory and renamed into place, so a
reader never sees a half-built export.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kernels.block_products import check_products, resolve_products

QUANTS = ("none", "int8", "int4", "int4-a8")  # int4-a8: int4 weights, int8 activations (CPU only)
TARGETS = ("cpu", "cuda")
# quant -> the builder's --precision. NOTE: "none" stays fp32 on cuda too, so it matches torch fp32.
_PRECISION = {"none": "fp32", "int8": "int8", "int4": "int4", "int4-a8": "int4"}
# NOTE: a prefill needs only the last token's logits; pruning the LM head to it cuts prefill ~15%
# (edged.graph_edits then lets a call ask for more rows, for speculation).
BUILDER_OPTIONS = {"prune_lm_head": "true"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
# An int4 CPU export of a GGUF holds the GGUF's own blocks (edged.carry_blocks); bump when that changes.
GGUF_BLOCKS_VERSION = 2
# Its float-activation int4 nodes run fleetserve's own ONNX Runtime op (kernels.ort_ops) where that
# library builds; bump when the op's inputs change.
BLOCK_OPS_VERSION = 2  # 2: the bf16_products attribute
# edged.graph_edits (logits rows per call, activation precision); bump when they change.
GRAPH_EDITS_VERSION = 3
INSTALL_HINT = "pip install 'fleetserve[onnx]'"


class ExportError(RuntimeError):
    """The export could not be built (missing dependency, builder failure)."""


def export_onnx(model_path: Path | str, quant: str = "int4", cache_root: Path | str | None = None,
                target: str = "cpu", log=None, products: str = "auto") -> Path:
    """The directory holding ``model.onnx`` for ``model_path`` at ``quant`` for ``target``.

    Reuses a matching cached export; otherwise builds one (20-60 s for a 135M model).
    ``cache_root`` None puts the cache beside the model, else under ``cache_root/<name>.onnx``.
    ``log`` (a callable taking one str) hears about progress; None is silent. ``products``
    (``kernels.block_products.PRODUCTS``) is the precision of BlockMatMul's products where the
    graph has that op (``auto``: bfloat16 where the CPU has AVX-512 BF16); each is cached apart.
    Raises ValueError for a bad quant/target/products, FileNotFoundError for a missing model, ExportError
    when onnxruntime-genai (or transformers, which its builder needs) is missing or the builder fails.
    """
    if quant not in QUANTS:
        raise ValueError(f"quant={quant!r}: must be one of {QUANTS}")
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: must be one of {TARGETS}")
    check_products(products)
    if quant == "int4-a8" and target != "cpu":
        raise ValueError("quant int4-a8 (int8 activations) is ONNX Runtime's CPU kernel: use int4 on cuda")
    model_path = Path(model_path).expanduser().resolve()
    if not model_path.exists():
        raise FileNotFoundError(f"no model at {model_path}")
    say = log or (lambda _msg: None)
    version = builder_version()
    block_ops = _runs_block_ops(model_path, quant, target)
    if block_ops:
        products = resolve_products(products)
    out = cache_dir_for(model_path, quant, target, cache_root, bf16_products=block_ops and products == "bfloat16")
    key = {"manifest_version": MANIFEST_VERSION, "model_sha256": model_hash(model_path),
           "builder": f"onnxruntime-genai {version}", "quant": quant, "target": target,
           "builder_options": BUILDER_OPTIONS,
           "gguf_blocks": GGUF_BLOCKS_VERSION if _carries_blocks(model_path, quant, target) else None,
           "block_ops": BLOCK_OPS_VERSION if block_ops else None,
           "products": products if block_ops else None,
           "graph_edits": GRAPH_EDITS_VERSION}
    if read_manifest(out).get("key") == key:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"exporting {model_path.name} ({quant}, {target}) to {out} ...")
    with tempfile.TemporaryDirectory(prefix=f".build-{quant}-{target}-", dir=out.parent) as tmp:
        build = Path(tmp) / "onnx"
        _build(model_path, quant, target, Path(tmp), build)
        carried = 0
        if key["gguf_blocks"] is not None:
            from edged.carry_blocks import carry_gguf_blocks

            carried = carry_gguf_blocks(build, model_path, block_ops=block_ops, bf16_products=products == "bfloat16")
            kernel = f"fleetserve.BlockMatMul ({products} products)" if block_ops else "ONNX Runtime's MatMulNBits"
            say(f"carried the GGUF's own blocks into {carried} nodes, multiplied by {kernel}")
        if quant.startswith("int4") and target == "cpu":
            from edged.graph_edits import set_activation_precision

            set_activation_precision(build, int8_activations=quant == "int4-a8")
        manifest = {"key": key, "source": str(model_path), "precision": _PRECISION[quant],
                    "gguf_block_nodes": carried, "files": sorted(p.name for p in build.iterdir())}
        (build / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _install(build, out, key)
    say(f"exported to {out}")
    return out


def _carries_blocks(model_path: Path, quant: str, target: str) -> bool:
    """Whether the export takes a GGUF's quantized blocks as they are (int4 on a CPU)."""
    return model_path.suffix == ".gguf" and quant.startswith("int4") and target == "cpu"


def _runs_block_ops(model_path: Path, quant: str, target: str) -> bool:
    """Whether the carried blocks run fleetserve's BlockMatMul (float activations, where the
    library builds here; int4-a8 keeps MatMulNBits' int8 activations). A machine where it
    stops building gets a key that differs, so a MatMulNBits export replaces it."""
    from kernels.ort_ops import ort_ops_library

    return quant == "int4" and _carries_blocks(model_path, quant, target) and ort_ops_library() is not None


def builder_version() -> str:
    """onnxruntime-genai's version; ExportError naming the install command when it or transformers is missing."""
    for module in ("onnxruntime_genai", "onnxruntime", "transformers"):
        if importlib.util.find_spec(module) is None:
            raise ExportError(f"the ONNX export needs {module}, which is not installed: {INSTALL_HINT}")
    return importlib.metadata.version("onnxruntime-genai")


def cache_dir_for(model_path: Path, quant: str, target: str, cache_root: Path | str | None = None,
                  bf16_products: bool = False) -> Path:
    """Where the export of ``model_path`` at ``quant``/``target`` lives (whether built or not)."""
    base = model_path.parent if cache_root is None else Path(cache_root).expanduser()
    return base / f"{model_path.name}.onnx" / (f"{quant}-{target}" + ("-bf16" if bf16_products else ""))


def model_hash(model_path: Path) -> str:
    """sha256 of the model file, or of a HF folder's config, tokenizer and weight files (names and bytes)."""
    files = [model_path] if model_path.is_file() else sorted(
        p for p in model_path.iterdir()
        if p.is_file() and (p.suffix in (".safetensors", ".json") or p.name == "chat_template.jinja"))
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def read_manifest(export_dir: Path) -> dict[str, Any]:
    """The export's manifest, {} when absent or unreadable (then it is rebuilt)."""
    try:
        return json.loads((export_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _build(model_path: Path, quant: str, target: str, tmp: Path, out: Path) -> None:
    """Run the builder on a HF folder (written from the checkpoint unless the model already is one),
    then make its logits rows selectable (``edged.graph_edits``)."""
    hf_dir = model_path if model_path.is_dir() else write_hf_folder(model_path, tmp / "hf")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
           "-p", _PRECISION[quant], "-e", target, "-c", str(tmp / "builder-cache"),
           "--extra_options", *(f"{k}={v}" for k, v in BUILDER_OPTIONS.items())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # NOTE: the builder prints ~hundreds of lines; keep them for the error message only.
    proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not (out / "model.onnx").is_file():
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise ExportError(f"onnxruntime-genai builder failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    from edged.graph_edits import keep_last_logits

    try:
        keep_last_logits(out)
    except ValueError as exc:
        raise ExportError(f"the builder's graph is not the shape edged expects: {exc}") from exc


def write_hf_folder(model_path: Path, hf_dir: Path) -> Path:
    """Dequantize ``model_path`` with our own loader into a float32 HF folder the builder reads.

    NOTE: not through transformers' GGUF loading: transformers 5 refuses to save a GGUF-loaded model.
    """
    from safetensors.torch import save_file

    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(model_path)
    hf_dir.mkdir(parents=True)
    weights = {name: t.contiguous() for name, t in checkpoint.weights.items()}
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = checkpoint.tokenizer
    (hf_dir / "config.json").write_text(json.dumps(hf_config_dict(checkpoint.config, tokenizer), indent=2))
    tokenizer.backend.save(str(hf_dir / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                        "eos_token": tokenizer.eos_token, "chat_template": tokenizer.chat_template,
                        "model_max_length": checkpoint.config.max_position_embeddings}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return hf_dir


def hf_config_dict(config, tokenizer) -> dict[str, Any]:
    """HF ``config.json`` for a ModelConfig (the fields ModelConfig.from_hf_dict reads back)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": [_ARCHITECTURES[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.backend.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None,
        "torch_dtype": "float32",
    }


def _install(build: Path, out: Path, key: dict[str, Any]) -> None:
    """Rename ``build`` to ``out``, replacing a stale export; a concurrent builder that won keeps its copy."""
    if out.exists():
        if read_manifest(out).get("key") == key:
            return  # someone else finished the same build first
        stale = out.with_name(f".stale-{out.name}-{os.getpid()}")
        out.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        build.rename(out)
    except OSError:
        if read_manifest(out).get("key") != key:
            raise
