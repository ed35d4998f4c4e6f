"""What a daemon says about the model it runs, in its ready line and its stats: the file's stem,
the architecture and the parameter count (``qwen2.5-coder-1.5b-instruct-q4_k_m (qwen2, 1.54B
params)``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.model.model_config import ModelConfig


@dataclass(frozen=True)
class ModelSummary:
    name: str  # the model file's stem (a HF folder's name)
    arch: str  # ModelConfig.arch: "llama" (SmolLM2), "qwen2", "mistral"
    params: int  # the weights' element count, tied embeddings once (num_params)

    @classmethod
    def of(cls, name: str, config: ModelConfig) -> ModelSummary:
        return cls(name, config.arch, num_params(config))

    @classmethod
    def read(cls, path: Path | str) -> ModelSummary:
        """The summary of the model at ``path`` (a ``.gguf`` file or a HF folder), from its
        checkpoint's config as the loaders read it (no weights); a daemon that loaded the model
        uses ``of`` with its config instead. FileNotFoundError for a path that is neither;
        ValueError as ``load_checkpoint``."""
        from shared.model.checkpoint import load_checkpoint

        path = Path(path)
        if not (path.is_file() and path.suffix == ".gguf") and not (path / "config.json").is_file():
            raise FileNotFoundError(f"no .gguf file or HF folder with config.json at {path}")
        return cls.of(path.stem if path.is_file() else path.name, load_checkpoint(path).config)

    def __str__(self) -> str:
        return f"{self.name} ({describe(self.arch, self.params)})"


def model_stats(name: str, summary: ModelSummary | None) -> dict[str, str | int | None]:
    """A stats reply's model fields: its name, and its architecture and parameter count (None
    until the daemon has described its model)."""
    return {"model": name, "model_arch": summary.arch if summary else None,
            "model_params": summary.params if summary else None}


def describe(arch: str | None, params: int | None) -> str:
    """``qwen2, 1.54B params``: three significant digits (135M, 36.9K)."""
    if params is None:
        return arch or "-"
    scale, unit = next(((s, u) for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if params >= s), (1, ""))
    value = params / scale
    digits = 0 if value >= 100 or not unit else 1 if value >= 10 else 2
    return f"{arch or '-'}, {value:.{digits}f}{unit} params"


def num_params(c: ModelConfig) -> int:
    """The parameters of a llama-family decoder of config ``c``: embeddings, per layer the
    q/k/v/o projections (q/k/v biases where ``attention_bias``), the gated MLP's three
    matrices and two norms, the final norm, and ``lm_head`` unless tied to the embeddings."""
    qkv = c.q_size + 2 * c.kv_size
    attention = c.hidden_size * qkv + c.q_size * c.hidden_size + (qkv if c.attention_bias else 0)
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    embeddings = c.vocab_size * c.hidden_size
    return embeddings * (1 if c.tie_word_embeddings else 2) + c.num_layers * layer + c.hidden_size
