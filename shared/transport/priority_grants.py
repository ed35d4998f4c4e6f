"""Priority is a permission: which request classes each identity may use.

``safety`` preempts every other robot's work, so a daemon admits it only from identities granted
it. The identity a grant is looked up by is the one the front trusts: a CURVE robot key's name
(whatever ``robot_id`` the request claims); else the ``robot_id`` a request carries: the API
key's name for the in-process HTTP front, or what a client claims where CURVE is off (the daemon
is then on loopback only, where every local process is trusted as an operator already). Operator
keys (``curve_operator_dir``) may use every class. A request above its grant is refused
``forbidden``, never downgraded: a robot must know its safety stop was not served as one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from shared.protocol.messages import Priority

EVERY_CLASS = frozenset(Priority)


@dataclass(frozen=True)
class PriorityGrants:
    """``default``: the classes of an identity no grant names; ``grants``: (fnmatch pattern,
    classes) pairs, the first whose pattern matches the identity's name wins (an exact name is a
    pattern too). The bare default grants every class (edged's front: its clients are the robot's
    own processes; a cluster's replicas: the front checked)."""

    default: frozenset[Priority] = EVERY_CLASS
    grants: tuple[tuple[str, frozenset[Priority]], ...] = ()

    @classmethod
    def from_config(cls, priorities: Sequence[str], grants: Mapping[str, Sequence[str]]) -> PriorityGrants:
        """From ``[serve] priorities`` and ``[serve.priority_grants]`` (name or pattern -> class
        names); ValueError naming the key of an unknown class."""
        return cls(_classes(priorities, "priorities"),
                   tuple((pattern, _classes(names, f"priority_grants.{pattern}")) for pattern, names in grants.items()))

    def classes_for(self, name: str) -> frozenset[Priority]:
        for pattern, classes in self.grants:
            if fnmatchcase(name, pattern):
                return classes
        return self.default

    def allows(self, name: str, priority: Priority) -> bool:
        return priority in self.classes_for(name)


def _classes(names: Sequence[str], key: str) -> frozenset[Priority]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{key}: a list of priority class names")
    known = {p.value: p for p in Priority}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{key}: {unknown[0]!r} is not a priority class (one of {', '.join(known)})")
    return frozenset(known[n] for n in names)
