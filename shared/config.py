"""Process configuration: the only module in fleetserve that reads the environment."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engine.engine_config import EngineConfig


# How long an idle OpenMP thread spins before it sleeps (libgomp iterations; measured on a 2-core
# EPYC: 10,000 burn ~0.4 ms of a core after each op, 200,000 ~6 ms).
SERVER_SPIN_COUNT = 200_000  # cloudd: the box is the engine's; fleet-256 ran 7-9 % faster than at 10,000
SHARED_CPU_SPIN_COUNT = 10_000  # edged: the robot's other processes want the cores back at once


_OWN_OPENMP_SETTINGS: set[str] = set()  # the variables set_openmp_wait_defaults set, not the user


def set_openmp_wait_defaults(spin_count: int) -> None:
    """How OpenMP threads wait between ops, unless the environment already says: call before torch
    loads (a daemon's entry point does). They spin at most ``spin_count`` iterations, then sleep.
    Endless spinning (ACTIVE) costs 2-5x when another process wants the cores; sleeping at once
    (PASSIVE alone) costs each of a step's ~500 parallel ops a wake-up (measured: a 64-row decode
    step's dense layers 66 ms with PASSIVE alone, 35 ms with a spin)."""
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"),
                        ("GOMP_SPINCOUNT", str(spin_count))):  # libgomp: overrides PASSIVE's zero spin
        if name not in os.environ:
            os.environ[name] = value
            _OWN_OPENMP_SETTINGS.add(name)


def environment_for_peers() -> dict[str, str]:
    """This process's environment without the OpenMP settings ``set_openmp_wait_defaults`` put
    there: a peer (vLLM, llama.cpp) started from a bench runs as it would from the user's shell,
    not with the daemon's choices (PASSIVE waits change an OpenMP runtime's speed)."""
    return {k: v for k, v in os.environ.items() if k not in _OWN_OPENMP_SETTINGS}


def keep_freed_memory_in_process() -> None:
    """Let glibc reuse freed large blocks instead of mapping fresh pages for each: by default an
    allocation of more than a few MB is a new mmap, zero-filled page by page on first touch, and a
    step's temporaries (a [256, vocab] float32 logits tensor is 50 MB) then cost more in page
    faults than to compute (measured 4x on such a copy). Raises the mmap threshold to 1 GiB and
    stops trimming the heap, so RSS stays at its peak (what vLLM gets from preloading tcmalloc).
    A daemon's entry point calls it; a no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


def freeze_start_up_heap() -> None:
    """Exclude everything a daemon built at start-up (model, tokenizer, grammars: millions of
    objects) from the garbage collector's later full passes: call once it is ready. Without it,
    the first full collection after start-up scans them all while a request waits (measured in
    cloudd: a first step of 224 ms where the next take 22)."""
    import gc

    gc.collect()
    gc.freeze()


def respond_between_steps() -> None:
    """Let a daemon's socket thread take the interpreter lock within 1 ms of wanting it (Python's
    default is 5 ms) while its engine thread runs Python between kernels: a health probe needs
    the lock a few times, and at 5 ms a wait under a flood of frames reached 100-300 ms."""
    import sys

    sys.setswitchinterval(0.001)


def model_cache_dir() -> Path:
    """Where downloaded model files live.

    `$FLEETSERVE_CACHE_DIR/models` when set, else `$XDG_CACHE_HOME/fleetserve/models`, else
    `~/.cache/fleetserve/models`. The directory is not created here.
    """
    override = os.environ.get("FLEETSERVE_CACHE_DIR")
    if override:
        return Path(override).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fleetserve" / "models"


def kernel_choice_file() -> Path:
    """Where the engine keeps its measured kernel choices (``shared.engine.kernel_choice``): beside
    the models, ``kernel-choice.json`` in ``model_cache_dir()``'s parent."""
    return model_cache_dir().parent / "kernel-choice.json"


def peer_scripts_dir() -> Path:
    """The peers' scripts (``vllm-cpu/offline.py``, ...; ARCHITECTURE §6).

    `$FLEETSERVE_PEERS_DIR` when set, else ``../shared/peers`` beside the repo root.
    """
    override = os.environ.get("FLEETSERVE_PEERS_DIR")
    if override:
        return Path(override).expanduser()
    return Path(__file__).resolve().parents[1].parent / "shared" / "peers"


def peer_install_dir() -> Path:
    """Where the peers' setup scripts install them (their venvs and models).

    `$PEERS_DIR` when set (the variable the setup scripts read), else ``~/.cache/fleetserve-peers``.
    """
    override = os.environ.get("PEERS_DIR")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "fleetserve-peers"


def load_engine_config(path: Path | str) -> EngineConfig:
    """Read the ``[engine]`` and ``[scheduler]`` tables of a daemon's TOML file.

    Keys left out keep their defaults; an unknown key or a bad value raises ValueError naming
    the table and key, so a typo in a config never passes silently.
    """
    import tomllib

    from shared.engine.engine_config import EngineConfig
    from shared.engine.scheduler import SchedulerConfig

    with open(path, "rb") as f:
        doc = tomllib.load(f)
    scheduler = build_dataclass(SchedulerConfig, doc.get("scheduler", {}), "scheduler")
    engine = doc.get("engine", {})
    if "scheduler" in engine:
        raise ValueError("[engine] scheduler: use a [scheduler] table")
    return build_dataclass(EngineConfig, {**engine, "scheduler": scheduler}, "engine")


def load_section(path: Path | str, table: str, cls):
    """The ``[table]`` of a daemon's TOML file as dataclass ``cls`` (defaults when absent);
    an unknown key or a bad value raises ValueError naming the table and key."""
    import tomllib

    with open(path, "rb") as f:
        doc = tomllib.load(f)
    return build_dataclass(cls, doc.get(table, {}), table)


def build_dataclass(cls, table: dict, name: str):
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in known:
            raise ValueError(f"[{name}] {key}: unknown key (known: {', '.join(sorted(known))})")
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    table = {k: tuple(v) if isinstance(v, list) and "tuple" in str(hints[k]) else v for k, v in table.items()}
    try:
        return cls(**table)
    except (TypeError, ValueError) as e:
        raise ValueError(f"[{name}] {e}") from e
