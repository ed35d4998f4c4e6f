"""The robot's local sockets: edged's default address, and ``ipc://`` sockets only their own
user can reach.

A Unix socket admits whoever may enter its directory and write to its file, so a daemon binds
each ``ipc://`` endpoint in a directory it holds alone: ``make_private_dir`` creates it 0700
when it is missing and refuses (ValueError) one that is another user's or open to its group or
others (``/tmp`` is), and ``restrict_socket`` makes the bound socket file 0600. Nothing but
keys guards a ``tcp://`` port or an abstract ``ipc://@name`` socket (any local user may
connect): ``guarded_by_files`` tells them apart.

``~`` in an ``ipc://`` path is the home of the user who binds or connects (the robot's one
user, on both sides): ``expand_endpoint`` gives the address ZeroMQ takes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

IPC = "ipc://"
# edged's default: one socket in the robot user's own directory, what its processes connect to
EDGED_ENDPOINT = "ipc://~/.cache/fleetserve/run/edged.sock"


def expand_endpoint(endpoint: str) -> str:
    """``ipc://~/x`` as ``ipc:///home/<user>/x``; any other endpoint as it is."""
    if endpoint.startswith(IPC + "~"):
        return IPC + str(Path(endpoint.removeprefix(IPC)).expanduser())
    return endpoint


def guarded_by_files(endpoint: str) -> bool:
    """Whether file permissions decide who reaches ``endpoint``: an ``ipc://`` socket file
    (not an abstract ``ipc://@name``, not the wildcard ``ipc://*``); False for ``tcp://``."""
    return _socket_file(endpoint) is not None


def make_private_dir(endpoint: str) -> None:
    """Before binding ``endpoint`` (expanded; not an ipc socket file: nothing to do): its
    directory exists, belongs to this process's user and admits no one else. A missing one is
    created 0700 (its missing parents as ``mkdir -p`` would). ValueError naming the directory
    when it is another user's or open to group or others: a directory this process did not
    create keeps its mode."""
    path = _socket_file(endpoint)
    if path is None:
        return
    folder = path.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
        folder.chmod(0o700)  # the umask may have taken owner bits
    info = folder.stat()
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid() or mode & 0o077:
        whose = "another user's" if info.st_uid != os.geteuid() else "open to other users"
        raise ValueError(f"endpoints: {endpoint!r}: the socket's directory {folder} is {whose} (mode {mode:04o}); "
                         f"it must be this user's alone (0700), e.g. {EDGED_ENDPOINT}")


def restrict_socket(endpoint: str) -> None:
    """After binding: the socket file of an ``ipc://`` ``endpoint`` (expanded) readable and
    writable by its owner only (0600); a no-op for any other endpoint."""
    path = _socket_file(endpoint)
    if path is not None:
        path.chmod(0o600)


def _socket_file(endpoint: str) -> Path | None:
    """The file of an ``ipc://`` socket; None for other endpoints, an abstract socket (``@``) or
    the wildcard (``*``: a random file ZeroMQ picks)."""
    if not endpoint.startswith(IPC):
        return None
    path = endpoint.removeprefix(IPC)
    if not path or path.startswith("@") or path == "*":
        return None
    return Path(path)
