"""Pinned system prompts: their KV computed once, kept in memory, and saved to disk.

A robot's edged serves a handful of long system prompts (its skills, output format and safety
rules) again and again. Each one listed in the config is prefilled at start-up and kept as a
host copy of its K/V (``KVSnapshot``) that is never evicted; a request that starts with it gets
the copy loaded into the batch-1 buffer and prefills only its own tokens.

On disk a snapshot is one ``.npz`` file named by a hash of (backend identity, token ids), so a
different model, backend, quantization or prompt can never be mistaken for it; the file also
holds both, and is checked against them when read. Files are written to a temporary name and
renamed, so a crash never leaves a torn file under a valid name; a file that does not read back
(truncated, corrupt, stale) is recomputed and rewritten.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edged.backends.base import KVSnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PinnedPrompt:
    name: str
    token_ids: tuple[int, ...]
    snapshot: KVSnapshot
    from_disk: bool  # loaded from the disk cache instead of prefilled at start-up


class PinnedKVStore:
    """The disk side: ``<directory>/<key>.npz`` per (identity, prompt tokens)."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, identity: str, token_ids: Sequence[int]) -> Path:
        digest = hashlib.sha256(f"{identity}\0{','.join(map(str, token_ids))}".encode()).hexdigest()[:40]
        return self.directory / f"{digest}.npz"

    def load(self, identity: str, token_ids: Sequence[int]) -> KVSnapshot | None:
        """The saved snapshot, or None when there is none or it does not read back intact."""
        path = self.path(identity, token_ids)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as f:
                if str(f["identity"]) != identity or not np.array_equal(f["token_ids"], np.asarray(token_ids)):
                    raise ValueError("identity or tokens differ")
                layers = int(f["num_layers"])
                keys = tuple(np.ascontiguousarray(f[f"k{i}"]) for i in range(layers))
                values = tuple(np.ascontiguousarray(f[f"v{i}"]) for i in range(layers))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
            log.warning("pinned KV %s does not read back (%s): recomputing it", path.name, e)
            return None
        if any(a.shape[1] != len(token_ids) for a in keys + values):
            log.warning("pinned KV %s has the wrong length: recomputing it", path.name)
            return None
        return KVSnapshot(len(token_ids), keys, values)

    def save(self, identity: str, token_ids: Sequence[int], snapshot: KVSnapshot) -> Path:
        path = self.path(identity, token_ids)
        arrays = {f"k{i}": k for i, k in enumerate(snapshot.keys)} | {f"v{i}": v for i, v in enumerate(snapshot.values)}
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, identity=np.asarray(identity), token_ids=np.asarray(token_ids, dtype=np.int64),
                         num_layers=np.asarray(len(snapshot.keys)), **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path
