"""What a robot sees, sent with a plan request so that the plan can only name what exists.

A ``Scene`` lists named places, objects and people, plus free-text notes. A skill argument typed
with a scene kind, ``Place``, ``Thing`` or ``Person``::

    @skill
    def goto(waypoint: Place) -> None:
        '''drive to a named waypoint'''

becomes, for each request, an enum of that scene's names of the kind: the daemon's grammar
cannot write any other name, the plan is checked against them, and the scene message of the
prompt lists them. The system prompt describes such an argument by its kind only ("a place
in the scene"), so it stays the same for every robot of a type (edged keeps it pinned).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

MAX_NAMES = 256  # per kind: a scene is what a robot sees, not its whole map
MAX_NAME_CHARS = 64
MAX_NOTES_CHARS = 2_000
_NAME = re.compile(r"[^\x00-\x1f\x7f\"\\]+")  # printable, no quote or backslash (JSON-safe as is)


class Place(str):
    """A skill argument naming one of the scene's places."""


class Thing(str):
    """A skill argument naming one of the scene's objects."""


class Person(str):
    """A skill argument naming one of the scene's people."""


@dataclasses.dataclass(frozen=True)
class SceneKind:
    """The scene field an argument's values come from, and its noun for prompts."""

    field: str  # "places" | "objects" | "people"
    noun: str  # "place" | "object" | "person"


SCENE_KINDS: dict[type, SceneKind] = {
    Place: SceneKind("places", "place"),
    Thing: SceneKind("objects", "object"),
    Person: SceneKind("people", "person"),
}


@dataclasses.dataclass(frozen=True)
class Scene:
    """Named places, objects and people (each a tuple of distinct names), and free text.

    Names are 1..``MAX_NAME_CHARS`` printable characters without quotes or backslashes, at most
    ``MAX_NAMES`` per kind; ValueError names the field otherwise.
    """

    places: tuple[str, ...] = ()
    objects: tuple[str, ...] = ()
    people: tuple[str, ...] = ()
    notes: str = ""

    def __post_init__(self) -> None:
        for kind in SCENE_KINDS.values():
            names = getattr(self, kind.field)
            if isinstance(names, str) or not isinstance(names, Sequence):
                raise TypeError(f"scene.{kind.field}: expected a list of names, got {type(names).__name__}")
            names = tuple(names)
            object.__setattr__(self, kind.field, names)
            if len(names) > MAX_NAMES:
                raise ValueError(f"scene.{kind.field}: {len(names)} names, more than {MAX_NAMES}")
            for name in names:
                if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME_CHARS \
                        or name != name.strip():
                    raise ValueError(f"scene.{kind.field}: {name!r} is not a name (1..{MAX_NAME_CHARS} printable "
                                     "characters, no quotes, backslashes or outer spaces)")
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"scene.{kind.field}: duplicate names {duplicates}")
        if not isinstance(self.notes, str) or len(self.notes) > MAX_NOTES_CHARS:
            raise ValueError(f"scene.notes: expected a string of at most {MAX_NOTES_CHARS} characters")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Scene:
        """From ``{"places": [...], "objects": [...], "people": [...], "notes": "..."}`` (any key
        may be left out); ValueError for another key."""
        if not isinstance(data, Mapping):
            raise TypeError(f"scene: expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"places", "objects", "people", "notes"})
        if unknown:
            raise ValueError(f"scene: unknown keys {unknown} (expected places, objects, people, notes)")
        return cls(**{key: data[key] for key in data})

    def names(self, kind: SceneKind) -> tuple[str, ...]:
        return getattr(self, kind.field)

    def describe(self) -> str:
        """The prompt's scene message: every name by kind, then the notes."""
        parts = [f"{kind.field}: {', '.join(self.names(kind))}" for kind in SCENE_KINDS.values() if self.names(kind)]
        if self.notes.strip():
            parts.append(self.notes.strip())
        return ". ".join(parts) if parts else "nothing named"
