"""A stand-in for the vLLM peer's two folders (the real one is not needed by `make test`): the
peers folder with the given scripts, and a PEERS_DIR whose venv python is this interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

from cloudd.peer_baseline import hf_folder_name


def fake_vllm_peer(tmp_path: Path, scripts: dict[str, str], model: Path | None = None) -> tuple[Path, Path]:
    """``scripts`` (file name -> text) as ``vllm-cpu/`` of a peers folder, beside a setup.sh that
    does nothing; with ``model``, the HF folders setup.sh would make for it (fp32, and bf16/
    inside it). Returns (--peers-dir, PEERS_DIR)."""
    folder, install = tmp_path / "peers", tmp_path / "installed"
    (folder / "vllm-cpu").mkdir(parents=True)
    for name, text in {"setup.sh": "exit 0\n", **scripts}.items():
        (folder / "vllm-cpu" / name).write_text(text)
    (install / "vllm" / "bin").mkdir(parents=True)
    (install / "vllm" / "bin" / "python").symlink_to(sys.executable)
    if model is not None:
        hf = install / "models" / hf_folder_name(model)
        (hf / "bf16").mkdir(parents=True)
        for sub in ("", "bf16"):
            (hf / sub / "config.json").write_text("{}")
    return folder, install
