"""The shape of a decoder-only transformer, independent of the file format it came from."""

from dataclasses import dataclass, replace
from typing import Any

ARCHS = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3-style RoPE frequency scaling (Llama 3.1+), HF `rope_type: "llama3"`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _require(self.factor >= 1.0, "rope_scaling.factor", self.factor, ">= 1")
        _require(self.low_freq_factor > 0, "rope_scaling.low_freq_factor", self.low_freq_factor, "> 0")
        _require(self.high_freq_factor > self.low_freq_factor, "rope_scaling.high_freq_factor",
                 self.high_freq_factor, "> low_freq_factor")
        _require(self.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings",
                 self.original_max_position_embeddings, "> 0")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "RopeScaling":
        """From HF `config.json`'s `rope_scaling`; any kind but "llama3" raises ValueError."""
        kind = d.get("rope_type", d.get("type"))
        if kind != "llama3":
            raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported (only 'llama3')")
        return cls(
            factor=float(_key(d, "factor")),
            low_freq_factor=float(_key(d, "low_freq_factor")),
            high_freq_factor=float(_key(d, "high_freq_factor")),
            original_max_position_embeddings=int(_key(d, "original_max_position_embeddings")),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a llama-family decoder. Validated on construction (ValueError names the field)."""

    arch: str  # one of ARCHS; SmolLM2 is "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (Qwen2)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        _require(self.arch in ARCHS, "arch", self.arch, f"one of {ARCHS}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, value, "a positive int")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                 f"a divisor of num_heads={self.num_heads}")
        _require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "even (RoPE rotates pairs)")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "> 0")
        _require(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From a HF `config.json` dict (model_type llama, qwen2 or mistral)."""
        arch = d.get("model_type")
        if arch not in ARCHS:
            raise ValueError(f"model_type {arch!r} is not supported (expected one of {ARCHS})")
        num_heads = int(_key(d, "num_attention_heads"))
        # NOTE: transformers 5 writes `rope_parameters` (theta included); older files `rope_scaling`.
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaled = rope.get("rope_type", rope.get("type")) not in (None, "default")
        max_positions = int(_key(d, "max_position_embeddings"))
        # NOTE: we attend to the whole context; within Mistral's sliding window that is exact,
        # so a model with a window serves sequences up to the window's length.
        window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        if window:
            max_positions = min(max_positions, int(window))
        return cls(
            arch=arch,
            vocab_size=int(_key(d, "vocab_size")),
            hidden_size=int(_key(d, "hidden_size")),
            intermediate_size=int(_key(d, "intermediate_size")),
            num_layers=int(_key(d, "num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or _key(d, "hidden_size") // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            rope_scaling=RopeScaling.from_hf_dict(rope) if scaled else None,
        )


def tiny_config(**overrides: Any) -> ModelConfig:
    """A 2-layer llama small enough for CPU unit tests; keyword arguments replace fields."""
    base = ModelConfig(
        arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, attention_bias=False,
    )
    return replace(base, **overrides)


def _key(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ValueError(f"{key}: missing from the model config")
    return d[key]


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: must be {expected}")
