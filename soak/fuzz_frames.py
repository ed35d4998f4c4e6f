"""Fuzz frames for a daemon's ZeroMQ socket, from a seeded generator.

Five families, in fixed shares (``FAMILY_WEIGHTS``):

- ``random``: random bytes, and random bytes behind a msgpack map header;
- ``mutated``: a valid ``generate``, ``cancel``, ``stats`` or ``health`` with one field set to a
  bad value (wrong type, huge or negative number, non-finite float, deep nesting, long string),
  removed, or joined by an unknown field; the version and type are fields too;
- ``targeted``: the inputs a review found dangerous, each valid but for one thing: non-finite
  and extreme sampling numbers, pathological regexes and schemas, huge prompts, too many stops,
  tags or characters in ids;
- ``multipart``: garbage in several frames;
- ``oversized``: past the 1 MiB message limit (answered ``too_large``) and, rarely, past the
  transport's frame limit (dropped unread, and the sender disconnected).

Every ``generate`` asks for one token under a fresh request id, so a mutant that happens to be
valid costs the daemon one token, not a plan.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from shared.protocol.codec import MAX_MESSAGE_BYTES
from shared.protocol.messages import PROTOCOL_VERSION
from shared.transport.router import MAX_FRAME_BYTES

FAMILY_WEIGHTS = {"random": 84, "mutated": 14, "targeted": 1, "multipart": 1}
OVERSIZED_EVERY = 20_000  # one oversized frame per this many (every tenth past the frame limit)


def _nested(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


BAD_VALUES: tuple[Any, ...] = (
    None, True, False, -1, 0, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1e308, -1e308, math.nan, math.inf, -math.inf,
    1e-45, "", "x" * 70_000, "\u0000\ud7ff\uffff", b"\xff\x00\x80", [], {}, [[]], {"a": {"b": {}}}, _nested(100),
    _nested(490), {"type": "regex"}, ["x"] * 5_000,
)
# a generate whose messages nest 5,000 arrays deep (past what msgpack's packer builds)
DEEP_FRAME = (b"\x83\xa1v\x01\xa4type\xa8generate\xa8messages" + b"\x91" * 5_000 + b"\xc0")

_FIELDS = {  # optional fields a mutation may set on a generate, beyond those in the base message
    "generate": ("sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.seed", "sampling.stop",
                 "sampling.stop_token_ids", "sampling.ignore_eos", "sampling.logprobs", "response_format",
                 "priority", "deadline_ms", "escalation", "tags", "stream", "resume_from", "prompt_ids"),
}


@dataclass(frozen=True)
class FuzzFrame:
    family: str
    parts: list[bytes]  # the message's ZeroMQ frames (one unless multipart)


class FrameSource:
    """Fuzz frames for a sender whose request ids must start with ``id_prefix`` + "/"."""

    def __init__(self, seed: int, id_prefix: str, robot_id: str = ""):
        self.rng = random.Random(seed)
        self.id_prefix = id_prefix
        self.robot_id = robot_id
        self.count = 0
        self._families = list(FAMILY_WEIGHTS)
        self._weights = list(FAMILY_WEIGHTS.values())
        self._attacks = _targeted_mutations()

    def next(self) -> FuzzFrame:
        self.count += 1
        if self.count % OVERSIZED_EVERY == 0:
            size = MAX_FRAME_BYTES + 1024 if self.count % (10 * OVERSIZED_EVERY) == 0 else MAX_MESSAGE_BYTES + 1024
            return FuzzFrame("oversized", [self.rng.randbytes(64) * (size // 64)])
        family = self.rng.choices(self._families, self._weights)[0]
        return FuzzFrame(family, getattr(self, f"_{family}")())

    def fresh_id(self) -> str:
        return f"{self.id_prefix}/fuzz-{self.count}"

    def base(self, kind: str) -> dict:
        """A valid message of ``kind`` in wire form (one token for a generate)."""
        head = {"v": PROTOCOL_VERSION, "type": kind}
        if kind == "generate":
            return {**head, "request_id": self.fresh_id(), "robot_id": self.robot_id,
                    "messages": [{"role": "user", "content": "go to dock 2"}], "sampling": {"max_tokens": 1}}
        if kind == "cancel":
            return {**head, "request_id": self.fresh_id()}
        return head

    # --- families ------------------------------------------------------------------------------

    def _random(self) -> list[bytes]:
        noise = self.rng.randbytes(self.rng.randint(0, 256))
        roll = self.rng.random()
        if roll < 0.01:
            return [DEEP_FRAME]
        if roll < 0.5:
            return [noise]
        return [bytes([0x80 | self.rng.randint(0, 15)]) + noise]  # a fixmap header, then garbage

    def _mutated(self) -> list[bytes]:
        kind = self.rng.choice(("generate", "generate", "generate", "cancel", "stats", "health"))
        msg = self.base(kind)
        paths = _leaf_paths(msg) + list(_FIELDS.get(kind, ()))
        path = self.rng.choice(paths)
        roll = self.rng.random()
        if roll < 0.08:
            _delete(msg, path)
        elif roll < 0.14:
            msg[self.rng.choice(("extra", "v2", "__class__", "request_id "))] = self.rng.choice(BAD_VALUES)
        else:
            _assign(msg, path, self.rng.choice(BAD_VALUES))
        return [_pack(msg)]

    def _targeted(self) -> list[bytes]:
        msg = self.base("generate")
        self.rng.choice(self._attacks)(msg)
        return [_pack(msg)]

    def _multipart(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(self.rng.randint(2, 5))]


def _targeted_mutations() -> list[Callable[[dict], None]]:
    def sampling(**values: Any) -> Callable[[dict], None]:
        return lambda m: m["sampling"].update(values)

    def field(name: str, value: Any) -> Callable[[dict], None]:
        return lambda m: m.update({name: value})

    def content(text: str) -> Callable[[dict], None]:
        return lambda m: m.update(messages=[{"role": "user", "content": text}])

    deep_schema: dict = {"type": "string"}
    for _ in range(700):
        deep_schema = {"type": "array", "items": deep_schema}
    return [
        sampling(temperature=1e-45), sampling(temperature=math.inf), sampling(temperature=-math.inf),
        sampling(temperature=math.nan), sampling(temperature=1e300), sampling(top_p=math.nan), sampling(top_p=-0.5),
        sampling(top_k=2**31 - 1), sampling(seed=2**63 - 1), sampling(max_tokens=0),
        sampling(stop=["s"] * 10_000), sampling(stop_token_ids=list(range(5_000))),
        field("response_format", {"type": "regex", "regex": "((a*)*)*b"}),
        field("response_format", {"type": "regex", "regex": "(a{1,1000}){1,1000}"}),
        field("response_format", {"type": "regex", "regex": "(" * 5_000}),
        field("response_format", {"type": "json_schema", "schema": deep_schema}),
        field("response_format", {"type": "ebnf", "ebnf": "root ::= root root"}),
        field("response_format", {"type": "skills", "skills": [{"name": f"s{i}", "args": {}} for i in range(2_000)]}),
        field("response_format", {"type": "json_schema", "schema": {"type": "string", "pattern": "(x+x+)+y"}}),
        field("temperature", 1.0), field("deadline_ms", 1), field("tags", ["t"] * 17), field("tags", ["t" * 65]),
        field("robot_id", "r" * 65), field("request_id", "i" * 300), field("resume_from", 2**31),
        field("prompt_ids", list(range(100)) * 1_500), content("word " * 150_000), content("\u2603" * 100_000),
        lambda m: m.update(messages=[{"role": "user", "content": "hi"}] * 20_000),
    ]


def _pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _leaf_paths(msg: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in msg.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            paths += _leaf_paths(value, path + ".")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            paths += _leaf_paths(value[0], path + ".0.")
        else:
            paths.append(path)
    return paths


def _walk(msg: dict, path: str) -> tuple[Any, str | int]:
    """The container holding ``path``'s last part (created as needed) and that part."""
    node: Any = msg
    *parents, last = path.split(".")
    for part in parents:
        key: str | int = int(part) if isinstance(node, list) else part
        if isinstance(node, dict) and not isinstance(node.get(key), dict | list):
            node[key] = {}
        node = node[key]
    return node, int(last) if isinstance(node, list) else last


def _assign(msg: dict, path: str, value: Any) -> None:
    node, key = _walk(msg, path)
    node[key] = value


def _delete(msg: dict, path: str) -> None:
    node, key = _walk(msg, path)
    if isinstance(node, dict):
        node.pop(key, None)
    else:
        node.pop(key)
