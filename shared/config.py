"""Process configuration: the only module in fleetserve that reads the environment."""

import os
from pathlib import Path


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
