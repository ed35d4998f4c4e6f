"""Skills declared once in Python, used three ways: the constrained-output format sent to the
daemon, the skill list in the system prompt, and the check of every returned step.

A skill is a function or a dataclass with typed arguments and a docstring::

    @skill
    def pick(object: str, grasp: Literal["normal", "gentle"]) -> None:
        '''Grasp an object with the gripper; needs the object in reach.'''

Argument types map onto the daemon's skill format (``shared/engine/grammar/response_format``):
``str`` -> "string", ``int`` -> "integer", ``float`` -> "number", ``bool`` -> "boolean", and a
``Literal`` of strings or an ``Enum`` with string values -> a list of the allowed strings. A
scene kind (``robot_sdk.scene``: ``Place``, ``Thing``, ``Person``; "place", "object", "person"
in ``Skill.of``) becomes, per request, the list of the scene's names of that kind
(``Skill.grounded``). Every argument is required in a plan (the daemon's plan schema allows no
optional ones); defaults are ignored. Anything else is a ``TypeError`` naming the skill and the
argument.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from robot_sdk.scene import SCENE_KINDS, Scene, SceneKind

# "string" | "integer" | "number" | "boolean", the enum values, or a scene kind (until grounded)
ArgKind = str | tuple[str, ...] | SceneKind
_SCALAR_KINDS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SCENE_KIND_NAMES: dict[str, SceneKind] = {kind.noun: kind for kind in SCENE_KINDS.values()}
_SKILL_ATTR = "__fleet_skill__"


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    kind: ArgKind
    py_type: Any = dataclasses.field(default=None, compare=False)  # for invoke: the Enum to rebuild

    def accepts(self, value: Any) -> bool:
        """True if ``value`` (decoded JSON) is of this argument's type."""
        if isinstance(self.kind, tuple):
            return isinstance(value, str) and value in self.kind
        if isinstance(self.kind, SceneKind):  # not grounded: any name (a grounded one is an enum)
            return isinstance(value, str)
        if self.kind == "boolean":
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False  # bool is an int in Python, not in JSON
        if self.kind == "integer":  # JSON Schema's integer: 2.0 is one
            return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if self.kind == "number":
            return isinstance(value, int | float)
        return isinstance(value, str)

    def describe(self) -> str:
        if isinstance(self.kind, SceneKind):
            return f"{self.name}: a {self.kind.noun} named in the scene"
        kind = " | ".join(f'"{v}"' for v in self.kind) if isinstance(self.kind, tuple) else self.kind
        return f"{self.name}: {kind}"


@dataclasses.dataclass(frozen=True)
class Skill:
    """One thing the robot can do: ``name``, a one-line ``description`` and typed ``args``.

    ``target`` (not compared) is the function or dataclass it was read from, if any; ``invoke``
    calls it with a step's arguments.
    """

    name: str
    description: str
    args: tuple[Arg, ...] = ()
    target: Callable[..., Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    repeatable: bool = False  # the same step (skill and arguments) may follow itself (``wait``, ``scan``)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", self.name):
            raise ValueError(f"skill name {self.name!r}: expected an identifier (letters, digits, _ . -)")
        if not isinstance(self.description, str) or not self.description.strip():
            raise ValueError(f"skill {self.name!r} needs a description (a docstring or description=...)")
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"skill {self.name!r}: duplicate argument names {names}")

    @classmethod
    def of(cls, name: str, description: str, args: Mapping[str, ArgKind | Sequence[str]] | None = None,
           repeatable: bool = False) -> Skill:
        """A skill from plain values: ``args`` maps names to a kind or a list of allowed strings."""
        return cls(name, description, tuple(Arg(n, _plain_kind(name, n, k)) for n, k in (args or {}).items()),
                   repeatable=repeatable)

    @classmethod
    def from_callable(cls, func: Callable[..., Any], name: str | None = None,
                      description: str | None = None) -> Skill:
        """The skill of a function: its name, its docstring's first paragraph, its typed
        parameters. Raises TypeError for *args/**kwargs or a missing or unsupported hint."""
        if dataclasses.is_dataclass(func) and isinstance(func, type):
            return cls.from_dataclass(func, name, description)
        skill_name = name or func.__name__
        hints = _hints(func, skill_name)
        args = []
        for param in inspect.signature(func).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"skill {skill_name!r}: *args/**kwargs cannot be planned; name every argument")
            args.append(_arg(skill_name, param.name, hints.get(param.name, inspect.Parameter.empty)))
        return cls(skill_name, description or _doc(func), tuple(args), func)

    @classmethod
    def from_dataclass(cls, klass: type, name: str | None = None, description: str | None = None) -> Skill:
        """The skill of a dataclass: its snake_case name, its docstring, its typed fields
        (``init=False`` fields are not arguments). ``invoke`` returns an instance."""
        if not (dataclasses.is_dataclass(klass) and isinstance(klass, type)):
            raise TypeError(f"{klass!r} is not a dataclass")
        skill_name = name or re.sub(r"(?<!^)(?=[A-Z])", "_", klass.__name__).lower()
        hints = _hints(klass, skill_name)
        args = tuple(_arg(skill_name, f.name, hints.get(f.name, inspect.Parameter.empty))
                     for f in dataclasses.fields(klass) if f.init)
        doc = klass.__doc__ or ""
        if doc.startswith(f"{klass.__name__}("):  # the signature dataclass() writes when there is none
            doc = ""
        return cls(skill_name, description or _first_paragraph(doc), args, klass)

    @property
    def needs_scene(self) -> bool:
        """Whether an argument names something of the scene (``grounded`` then needs one)."""
        return any(isinstance(a.kind, SceneKind) for a in self.args)

    def grounded(self, scene: Scene | None) -> Skill:
        """This skill for one request: each scene-kind argument an enum of ``scene``'s names of
        its kind. ValueError when the scene names nothing of a kind an argument needs."""
        if not self.needs_scene:
            return self
        args = []
        for a in self.args:
            if isinstance(a.kind, SceneKind):
                names = scene.names(a.kind) if scene is not None else ()
                if not names:
                    raise ValueError(f"skill {self.name!r}: argument {a.name!r} names a {a.kind.noun}, and "
                                     f"{'no scene was given' if scene is None else f'the scene has no {a.kind.field}'}")
                a = dataclasses.replace(a, kind=names)
            args.append(a)
        return dataclasses.replace(self, args=tuple(args))

    def to_wire(self) -> dict[str, Any]:
        """The entry of a ``{"type": "skills", "skills": [...]}`` response_format (of a grounded
        skill: ValueError for a scene-kind argument)."""
        if self.needs_scene:
            raise ValueError(f"skill {self.name!r} names scene things: ground it in the request's scene first")
        wire = {"name": self.name, "description": self.description,
                "args": {a.name: list(a.kind) if isinstance(a.kind, tuple) else a.kind for a in self.args}}
        return wire | {"repeatable": True} if self.repeatable else wire

    def describe(self) -> str:
        """The skill's line in the system prompt: ``name(arg: kind, ...): description``."""
        return f"{self.name}({', '.join(a.describe() for a in self.args)}): {self.description}"

    def invoke(self, args: Mapping[str, Any]) -> Any:
        """Call the function (or build the dataclass) with a validated step's ``args``; Enum
        arguments are rebuilt from their values. Raises TypeError for a skill without a target."""
        if self.target is None:
            raise TypeError(f"skill {self.name!r} was not declared from a function or dataclass")
        kwargs = {a.name: _rebuild(a, args[a.name]) for a in self.args}
        return self.target(**kwargs)


def skill(target: Callable[..., Any] | type | None = None, *, name: str | None = None,
          description: str | None = None, repeatable: bool = False) -> Any:
    """Declare a function or dataclass as a skill: ``@skill`` or ``@skill(name=..., description=...,
    repeatable=...)``. A plan never has the same step twice in a row unless its skill is
    ``repeatable``.

    The decorated object is returned unchanged (a function stays a function, a class a class),
    with its ``Skill`` attached; pass the object itself in ``skills=[...]``. Declaration errors
    (missing hints, unsupported types, no description) are raised here, at import time.
    """

    def attach(obj: Any) -> Any:
        declared = Skill.from_callable(obj, name, description)
        setattr(obj, _SKILL_ATTR, dataclasses.replace(declared, repeatable=repeatable) if repeatable else declared)
        return obj

    return attach if target is None else attach(target)


def as_skill(obj: Skill | Callable[..., Any] | type) -> Skill:
    """The Skill for a declared skill, a decorated or plain function, or a dataclass."""
    if isinstance(obj, Skill):
        return obj
    declared = getattr(obj, _SKILL_ATTR, None)
    if isinstance(declared, Skill):
        return declared
    if callable(obj):
        return Skill.from_callable(obj)
    raise TypeError(f"{obj!r} is not a skill: pass a Skill, a function or a dataclass")


def as_skills(objs: Sequence[Skill | Callable[..., Any] | type]) -> tuple[Skill, ...]:
    """The skills of ``objs``; ValueError for an empty list or two skills with one name."""
    if isinstance(objs, str | bytes) or not isinstance(objs, Sequence | set | frozenset):
        raise TypeError(f"skills: expected a list of skills, got {type(objs).__name__}")
    skills = tuple(as_skill(o) for o in objs)
    if not skills:
        raise ValueError("skills: the list is empty; declare at least one skill")
    names = [s.name for s in skills]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"skills: duplicate skill names {duplicates}")
    return skills


# --- reading declarations ------------------------------------------------------------------


def _hints(obj: Any, skill_name: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception as e:  # an unresolvable forward reference: say which skill
        raise TypeError(f"skill {skill_name!r}: cannot resolve its type hints ({e})") from None


def _arg(skill_name: str, arg_name: str, hint: Any) -> Arg:
    where = f"skill {skill_name!r}: argument {arg_name!r}"
    if hint is inspect.Parameter.empty:
        raise TypeError(f"{where} has no type hint")
    if hint in SCENE_KINDS:
        return Arg(arg_name, SCENE_KINDS[hint], hint)
    if hint in _SCALAR_KINDS:
        return Arg(arg_name, _SCALAR_KINDS[hint], hint)
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        if values and all(isinstance(v, str) for v in values) and len(set(values)) == len(values):
            return Arg(arg_name, tuple(values), hint)
        raise TypeError(f"{where}: a Literal must list distinct strings, got {values!r}")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = tuple(m.value for m in hint)
        if values and all(isinstance(v, str) for v in values):
            return Arg(arg_name, values, hint)
        raise TypeError(f"{where}: Enum {hint.__name__} must have string values")
    raise TypeError(f"{where} has type {hint!r}; use str, int, float, bool, a Literal of strings, "
                    "an Enum with string values or a scene kind (Place, Thing, Person)")


def _plain_kind(skill_name: str, arg_name: str, kind: Any) -> ArgKind:
    if kind in _SCALAR_KINDS.values():
        return kind
    if isinstance(kind, str) and kind in _SCENE_KIND_NAMES:
        return _SCENE_KIND_NAMES[kind]
    if isinstance(kind, Sequence) and not isinstance(kind, str) and kind and all(isinstance(v, str) for v in kind):
        if len(set(kind)) == len(kind):
            return tuple(kind)
    raise ValueError(f"skill {skill_name!r}: argument {arg_name!r} has kind {kind!r}; expected "
                     f"{', '.join([*_SCALAR_KINDS.values(), *_SCENE_KIND_NAMES])} or a list of distinct strings")


def _doc(obj: Any) -> str:
    return _first_paragraph(inspect.getdoc(obj) or "")


def _first_paragraph(doc: str) -> str:
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(paragraph.split())


def _rebuild(arg: Arg, value: Any) -> Any:
    if isinstance(arg.py_type, type) and (issubclass(arg.py_type, enum.Enum) or arg.py_type in SCENE_KINDS):
        return arg.py_type(value)
    if arg.py_type is float and isinstance(value, int):
        return float(value)
    if arg.py_type is int and isinstance(value, float):
        return int(value)
    return value
