"""Load a HF model folder: config.json, *.safetensors, tokenizer.json and friends."""

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.model.checkpoint import Checkpoint
from shared.model.lazy_weights import LazyWeights, TensorSource
from shared.model.model_config import ModelConfig
from shared.model.tokenizer import Tokenizer


def load_hf_folder(path: Path) -> Checkpoint:
    """A HF folder's config and tokenizer, its weights read lazily (float32 when accessed).

    Weights keep their HF names. A folder without `lm_head.weight` is tied, whatever config.json
    says. Raises ValueError naming the missing file when there are no safetensors or no tokenizer.json.
    """
    config = ModelConfig.from_hf_dict(_read_json(path / "config.json"))
    sources = read_weights(path)
    if "lm_head.weight" not in sources and not config.tie_word_embeddings:
        config = ModelConfig(**{**config.__dict__, "tie_word_embeddings": True})
    if config.tie_word_embeddings:
        # NOTE: tied checkpoints sometimes still store lm_head; the contract is "absent iff tied".
        sources.pop("lm_head.weight", None)
    return Checkpoint(config=config, weights=LazyWeights(sources), tokenizer=read_tokenizer(path), source=path)


def read_weights(path: Path) -> dict[str, TensorSource]:
    """Every tensor of every `*.safetensors` in the folder, to be read (and converted) when asked."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files")
    sources: dict[str, TensorSource] = {}
    for file in files:
        handle = safe_open(file, framework="pt")
        for name in handle.keys():
            shape = tuple(handle.get_slice(name).get_shape())
            sources[name] = TensorSource(shape, partial(_read_into, handle, name))
    return sources


def _read_into(handle: Any, name: str, out: torch.Tensor) -> None:
    out.copy_(handle.get_tensor(name))


def read_tokenizer(path: Path) -> Tokenizer:
    """Tokenizer from `tokenizer.json` + `tokenizer_config.json`, chat template from the config or
    `chat_template.jinja`, extra eos ids from `generation_config.json`."""
    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"{path}: missing tokenizer.json (only fast-tokenizer folders are supported)")
    tokenizer_config = _read_json(path / "tokenizer_config.json", missing_ok=True)
    template_file = path / "chat_template.jinja"
    if template_file.is_file() and not tokenizer_config.get("chat_template"):
        tokenizer_config["chat_template"] = template_file.read_text(encoding="utf-8")
    eos = _read_json(path / "generation_config.json", missing_ok=True).get("eos_token_id")
    extra_eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return Tokenizer.from_file(tokenizer_json, tokenizer_config, extra_eos_token_ids=extra_eos)


def _read_json(file: Path, missing_ok: bool = False) -> dict[str, Any]:
    if not file.is_file():
        if missing_ok:
            return {}
        raise ValueError(f"{file.parent}: missing {file.name}")
    return json.loads(file.read_text(encoding="utf-8"))
