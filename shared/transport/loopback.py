"""Whether an address stays on this machine: the one check behind every "loopback only" rule
(cloudd's binds, edged's endpoints, the ROS node's static peers)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """``host``: a name or an IP address (IPv6 with or without brackets). Only ``localhost`` and
    loopback addresses count: any other name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds now, for a server that is given a port number
    (another process may take it first: a server that can bind port 0 itself should)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_local_endpoint(endpoint: str) -> bool:
    """A ZeroMQ endpoint other processes reach on this machine only: ``ipc://``, or ``tcp://``
    to a loopback host."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    return is_loopback(endpoint.removeprefix("tcp://").rsplit(":", 1)[0])
