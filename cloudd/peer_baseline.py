"""vLLM's CPU build as the peer baseline of `cloudd bench --baseline vllm` (ARCHITECTURE §6).

The peer's own script, ``vllm-cpu/offline.py`` in the peers folder, runs with the peer's own
Python (``$PEERS_DIR/vllm/bin/python``, installed by ``vllm-cpu/setup.sh``) on the same
requests (written to a temporary trace), the same output length and the same dtype as the
engine's runs. It prints one JSON object (output_tok_s, total_tok_s, prefix_hit_rate, wall_s,
...), which becomes ``runs.vllm``. vLLM's own log goes to a file, shown when the run fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cloudd.trace import TraceRequest
from shared.config import environment_for_peers, peer_install_dir, peer_scripts_dir
from shared.progress import Progress

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = ("output_tok_s", "total_tok_s", "prefix_hit_rate", "wall_s")
LOG_TAIL_LINES = 25
# offline.py reports its median repeat, sorted by wall time: of two that is the slower one, and
# repeats on these machines differ by up to 2x (632.6 and 341.8 tok/s in one run); three make
# the median a median.
PEER_REPEATS = 3


class PeerUnavailable(RuntimeError):
    """The peer is not set up; the message says how to set it up."""


def hf_folder_name(model: Path) -> str:
    """The name ``vllm-cpu/setup.sh GGUF NAME`` is given for ``model`` (its folder is
    ``$PEERS_DIR/models/NAME``): a known model's registry name (``shared.model.fetch``) plus
    ``-hf`` (``smollm2-135m-hf``, ``qwen2.5-coder-1.5b-hf``), else the file's stem plus ``-hf``."""
    from shared.model.fetch import MODELS

    names = {package.filename: name for name, package in MODELS.items()}
    return f"{names.get(model.name, model.stem)}-hf"


@dataclass(frozen=True)
class VllmPeer:
    """Where the peer's script (``scripts``: the peers folder) and its install (``install``:
    ``$PEERS_DIR``) are, and the GGUF the engine runs (``gguf``: the peer runs the HF folder
    setup.sh made from it); nothing is checked until ``check``."""

    scripts: Path
    install: Path
    gguf: Path

    @classmethod
    def located(cls, gguf: Path, scripts: Path | None = None) -> VllmPeer:
        """The peer for ``gguf`` where it lives: ``scripts`` (else ``shared.config.peer_scripts_dir``)
        and ``shared.config.peer_install_dir``."""
        return cls(scripts=scripts or peer_scripts_dir(), install=peer_install_dir(), gguf=gguf)

    @property
    def script(self) -> Path:
        return self.scripts / "vllm-cpu" / "offline.py"

    @property
    def setup_script(self) -> Path:
        return self.scripts / "vllm-cpu" / "setup.sh"

    @property
    def serve_script(self) -> Path:
        """``serve.sh PORT [flags]``: `vllm serve` on loopback, in the background; prints its PID."""
        return self.scripts / "vllm-cpu" / "serve.sh"

    @property
    def cli_script(self) -> Path:
        """vLLM's command line (``serve``, ``bench serve``) run with the peer's Python."""
        return self.scripts / "vllm-cpu" / "vllm_cli.py"

    @property
    def python(self) -> Path:
        return self.install / "vllm" / "bin" / "python"

    def model(self, dtype: str) -> Path:
        """The HF folder setup.sh made from the engine's GGUF, in ``dtype`` (so both engines run
        the same weights: fp32 beside bf16/)."""
        folder = self.install / "models" / hf_folder_name(self.gguf)
        return folder / "bf16" if dtype == "bfloat16" else folder

    def check(self, dtype: str = "bfloat16", online: bool = False) -> None:
        """Raise PeerUnavailable naming what is missing and the command that sets it up: the offline
        script, or with ``online`` the server's and the client's instead."""
        scripts = (self.serve_script, self.cli_script) if online else (self.script,)
        absent = [script for script in scripts if not script.is_file()]
        if absent:
            raise PeerUnavailable(f"--baseline vllm: no peer script at {absent[0]}; point --peers-dir "
                                  "(or FLEETSERVE_PEERS_DIR) at the shared peers folder (../shared/peers)")
        missing = [f"{what} ({path})" for what, path, ok in (
            ("the vLLM venv's python", self.python, self.python.is_file()),
            ("the model folder", self.model(dtype), (self.model(dtype) / "config.json").is_file()),
        ) if not ok]
        if missing:
            raise PeerUnavailable(
                f"--baseline vllm: the vLLM peer is not set up: missing {' and '.join(missing)}. "
                f"Set it up with `PEERS_DIR={self.install} bash {shown_path(self.setup_script)} {self.gguf} "
                f"{hf_folder_name(self.gguf)}` in the repo root "
                f"({self.setup_script}; about 5 min and 3.4 GB, once), then run the bench again")

    def command(self, trace: Path, output_len: int, dtype: str) -> list[str]:
        return [str(self.python), str(self.script), "--trace", str(trace), "--model", str(self.model(dtype)),
                "--output-len", str(output_len), "--dtype", dtype, "--repeats", str(PEER_REPEATS)]


def run_vllm_offline(peer: VllmPeer, requests: list[TraceRequest], output_len: int, dtype: str,
                     progress: bool = True) -> dict:
    """The peer's run on ``requests``: its JSON object, with ``requests`` and ``output_tokens``
    as it counted them. Raises RuntimeError (with the tail of vLLM's log) when the script fails
    or prints no JSON object with the §6 throughput keys."""
    peer.check(dtype)
    with tempfile.TemporaryDirectory(prefix="fleetserve-vllm-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        write_trace(trace, requests)
        log_path = Path(tmp) / "vllm.log"
        with open(log_path, "w", encoding="utf-8") as log:
            code, stdout = _run(peer.command(trace, output_len, dtype), log, progress)
        if code != 0:
            raise RuntimeError(f"--baseline vllm: {shown_path(peer.script)} exited with {code}; the end of its log:\n"
                               + log_tail(log_path))
        try:
            return parse_peer_json(stdout)
        except ValueError as e:
            raise RuntimeError(f"--baseline vllm: {e}; the end of its log:\n{log_tail(log_path)}") from e


def write_trace(path: Path, requests: list[TraceRequest]) -> None:
    """The requests as a trace file (cloudd/trace.py's fields), in order."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"id": r.id, "robot": r.robot, "kind": r.kind, "priority": r.priority,
                                "arrival_s": r.arrival_s, "messages": list(r.messages),
                                "max_tokens": r.max_tokens}) + "\n")


def parse_peer_json(stdout: str) -> dict:
    """The last line of ``stdout`` that is a JSON object; ValueError if none, or if it lacks a
    §6 throughput key."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        missing = [k for k in REQUIRED_KEYS if k not in obj]
        if missing:
            raise ValueError(f"the peer's JSON lacks {', '.join(missing)}")
        return obj
    raise ValueError("the peer printed no JSON object on stdout")


def _run(cmd: list[str], log, progress: bool) -> tuple[int, str]:
    """Run ``cmd`` with stderr to ``log``, drawing an elapsed-time line meanwhile; (exit code, stdout)."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, Progress("vllm", None, enabled=progress) as bar:
        # NOTE: its own session, so that an interrupted run can end vLLM's engine process too.
        proc = subprocess.Popen(cmd, stdout=out, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=environment_for_peers())
        try:
            while True:
                try:
                    code = proc.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    bar.update(lambda: (0, 0))
        finally:
            if proc.poll() is None:  # interrupted: don't leave vLLM's processes behind
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
        out.seek(0)
        return code, out.read()


def log_tail(path: Path) -> str:
    """The last lines of the log at ``path`` ("(empty)" when it is empty or absent)."""
    if not path.is_file():
        return "(empty)"
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty)"


def shown_path(path: Path) -> str:
    """``path`` relative to the repo root when it is near it (``../shared/peers/...``)."""
    rel = os.path.relpath(path, REPO_ROOT)
    return rel if not rel.startswith("../..") else str(path)
