"""edged's TOML config: ``[backend]``, ``[serve]``, ``[escalation]``, ``[speculation]`` and
``[[pinned]]`` prompts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edged.backends.base import BACKENDS, QUANTS
from edged.escalation import EscalationConfig
from edged.server import EdgeServeConfig
from edged.speculation import SpeculationConfig
from kernels.block_products import check_products
from shared.config import build_dataclass


@dataclass(frozen=True)
class BackendConfig:
    """Which batch-1 backend runs the model, and how."""

    # "onnx" (ONNX Runtime; int4 GGUF blocks by our block kernel: the fastest first token on a
    # CPU) | "torch" (our kernels throughout on a CPU, plans as fast; CUDA graphs on a GPU)
    kind: str = "onnx"
    quant: str = "int4"  # "none" | "int8" | "int4" (weight-only)
    max_len: int = 2048  # positions in the KV buffer: the robot's local context
    threads: int = 2  # intra-op threads (use 1 when other processes share the cores)
    device: str = "cpu"  # "cpu" | "cuda"
    model: str = ""  # GGUF file or HF folder; empty = the embedded default model
    # the int4 block kernels' products on a CPU (both backends): "auto" (bfloat16 where the CPU has
    # AVX-512 BF16, as cloudd's dtype auto; else float32) | "float32" (the GGUF's weights to float
    # rounding) | "bfloat16"
    products: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in BACKENDS:
            raise ValueError(f"kind must be one of {', '.join(BACKENDS)}, got {self.kind!r}")
        if self.quant not in QUANTS:
            raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        check_products(self.products)
        if self.max_len < 16 or self.threads < 1 or self.device not in ("cpu", "cuda"):
            raise ValueError("max_len >= 16, threads >= 1, device cpu or cuda")


@dataclass(frozen=True)
class PinnedPromptConfig:
    """A prefix to pin: a system prompt (``text`` inline, or ``file`` relative to the config
    file) and optionally the robot's standing context (``context``/``context_file``: a first
    user message every request repeats, e.g. its scene), pinned as one prefix."""

    name: str
    text: str = ""
    file: str = ""
    context: str = ""
    context_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.text) == bool(self.file):
            raise ValueError(f"pinned prompt {self.name!r}: give exactly one of text and file")
        if self.context and self.context_file:
            raise ValueError(f"pinned prompt {self.name!r}: give at most one of context and context_file")

    def messages(self, base: Path) -> list[dict[str, str]]:
        """The chat messages the pinned prefix is rendered from."""
        out = [{"role": "system", "content": self.text or (base / self.file).read_text()}]
        context = self.context or (self.context_file and (base / self.context_file).read_text())
        if context:
            out.append({"role": "user", "content": context})
        return out


SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "edged.toml"  # the robot config the repo ships


@dataclass(frozen=True)
class EdgeConfig:
    backend: BackendConfig = BackendConfig()
    serve: EdgeServeConfig = EdgeServeConfig()
    escalation: EscalationConfig = EscalationConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    pinned: tuple[PinnedPromptConfig, ...] = ()
    base_dir: Path = Path(".")  # where relative paths in the file are resolved

    @classmethod
    def load(cls, path: Path | str) -> EdgeConfig:
        """Read a config file; unknown keys and bad values raise ValueError naming them."""
        import tomllib

        path = Path(path)
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        unknown = set(doc) - {"backend", "serve", "escalation", "speculation", "pinned"}
        if unknown:
            raise ValueError(f"{path}: unknown tables {sorted(unknown)}")
        pinned = doc.get("pinned", [])
        if not isinstance(pinned, list):
            raise ValueError(f"{path}: pinned must be an array of tables ([[pinned]])")
        return cls(
            backend=build_dataclass(BackendConfig, doc.get("backend", {}), "backend"),
            serve=build_dataclass(EdgeServeConfig, doc.get("serve", {}), "serve"),
            escalation=build_dataclass(EscalationConfig, doc.get("escalation", {}), "escalation"),
            speculation=build_dataclass(SpeculationConfig, doc.get("speculation", {}), "speculation"),
            pinned=tuple(build_dataclass(PinnedPromptConfig, p, "pinned") for p in pinned),
            base_dir=path.parent,
        )
