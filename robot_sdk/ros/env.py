"""Keep ROS 2 discovery on this machine: call ``ensure_local_discovery()`` before ``rclpy.init``.

With the PyPI ROS wheels (Fast DDS, Kilted), ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST`` is what
keeps every discovery packet on 127.0.0.1; without it Fast DDS multicasts to 239.255.0.1 on
every interface. ``ROS_LOCALHOST_ONLY`` is ignored by these wheels, so it is never relied on.
Same-host data then goes over Fast DDS shared memory.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from shared.transport.loopback import is_loopback

DISCOVERY_RANGE = "ROS_AUTOMATIC_DISCOVERY_RANGE"
LOCALHOST = "LOCALHOST"
RMW = "rmw_fastrtps_cpp"  # the only rmw shipped as a wheel; any other value makes rclpy.init exit 102


class DiscoveryNotLocal(RuntimeError):
    """The environment would let ROS 2 discovery leave this machine (or pick a missing rmw)."""


def ensure_local_discovery(environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST`` if unset; raise DiscoveryNotLocal if it is
    set to anything else, if ``ROS_STATIC_PEERS`` names a peer off loopback, or if
    ``RMW_IMPLEMENTATION`` names an rmw other than Fast DDS. Mutates ``environ`` (os.environ by
    default), which rcl reads at ``rclpy.init``; so call this first."""
    env = os.environ if environ is None else environ
    value = env.setdefault(DISCOVERY_RANGE, LOCALHOST)
    if value != LOCALHOST:
        raise DiscoveryNotLocal(f"{DISCOVERY_RANGE}={value!r}: fleetserve's ROS node keeps discovery on this "
                                f"machine; set it to {LOCALHOST} or unset it")
    for peer in filter(None, (p.strip() for p in env.get("ROS_STATIC_PEERS", "").split(";"))):
        if not _is_loopback(peer):
            raise DiscoveryNotLocal(f"ROS_STATIC_PEERS names {peer!r}, which is not a loopback address")
    rmw = env.get("RMW_IMPLEMENTATION", "")
    if rmw not in ("", RMW):
        raise DiscoveryNotLocal(f"RMW_IMPLEMENTATION={rmw!r}: only {RMW} is installed (from the ros-* wheels)")


def _is_loopback(peer: str) -> bool:
    """A static peer, ``host`` or ``host:port``, on loopback."""
    return is_loopback(peer.rsplit(":", 1)[0] if peer.count(":") == 1 else peer)
