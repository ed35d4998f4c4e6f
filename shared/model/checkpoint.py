"""A loaded model: config, lazily read float32 weights under HF names, and tokenizer -- whatever
the file format."""

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model.model_config import ModelConfig
from shared.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Checkpoint:
    """Everything needed to build and drive a model.

    `weights` uses HF parameter names (`model.layers.{i}.self_attn.q_proj.weight`, ...), float32 on
    CPU, in torch layout ([out_features, in_features]). `lm_head.weight` is absent exactly when
    `config.tie_word_embeddings` is True: the output projection is `model.embed_tokens.weight`.

    `weights` is a `LazyWeights` (shared.model.lazy_weights) over the file: every access reads
    (a GGUF's: dequantizes) that one tensor and returns a new tensor, kept by no one else. Read
    each weight once and put it where it goes; `build_model` reads each straight into the
    model's dtype. Keys, `len` and iteration read nothing.
    """

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path


def load_checkpoint(path: Path | str) -> Checkpoint:
    """Load a `.gguf` file or a HF folder (one holding `config.json`): its config and tokenizer
    now, its weights when read.

    Raises FileNotFoundError when `path` does not exist, ValueError when it is neither.
    """
    # NOTE: imported here because both loaders import Checkpoint from this module.
    from shared.model.gguf_loader import load_gguf
    from shared.model.hf_loader import load_hf_folder

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_folder(path)
    raise ValueError(f"{path}: expected a .gguf file or a HF model folder containing config.json")


def load_tokenizer(path: Path | str) -> Tokenizer:
    """Only the tokenizer of a `.gguf` file or a HF folder (a front that never runs the model)."""
    from shared.model.gguf_loader import build_tokenizer, read_gguf
    from shared.model.hf_loader import read_tokenizer

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return build_tokenizer(read_gguf(path)[0])
    if path.is_dir():
        return read_tokenizer(path)
    raise ValueError(f"{path}: expected a .gguf file or a HF model folder")
