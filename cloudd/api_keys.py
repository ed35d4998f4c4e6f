"""Bearer tokens for cloudd's HTTP API, hashed at rest.

The key file holds one ``name:sha256-hex`` line per key (``#`` starts a comment); a token itself
is shown once, when it is made (``cloudd api-key NAME --file FILE``), and never stored. A request
with ``Authorization: Bearer <token>`` is served as the key's name: that name is its
``robot_id`` (fairness, quotas, metrics), as a CURVE key's name is a robot's on ZeroMQ.
``reload()`` reads the file again (cloudd does on SIGHUP).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiKeys:
    def __init__(self, path: Path | str):
        self.path = Path(path).expanduser()
        self._names: dict[str, str] = {}  # digest -> name
        self.reload()

    def reload(self) -> int:
        """Read the key file again; returns how many keys it holds. ValueError names a bad line
        (the keys in force stay until a good file is read)."""
        names = {}
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, hashed = line.partition(":")
            if not NAME.fullmatch(name) or not re.fullmatch(r"[0-9a-f]{64}", hashed):
                raise ValueError(f"{self.path}:{number}: expected name:sha256-hex, got {line[:80]!r}")
            names[hashed] = name
        self._names = names
        return len(names)

    def name_of(self, token: str) -> str | None:
        """The name of the key whose token this is, or None."""
        return self._names.get(digest(token))


def make_key(path: Path | str, name: str) -> str:
    """A new token for ``name``: its digest is appended to the key file (made 0600 if new);
    the token is returned, to be shown once."""
    if not NAME.fullmatch(name):
        raise ValueError(f"key name {name!r}: 1 to 64 of letters, digits, '_', '.', '-'")
    token = secrets.token_urlsafe(32)
    path = Path(path).expanduser()
    with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
        f.write(f"{name}:{digest(token)}\n")
    return token
