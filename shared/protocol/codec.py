"""The one codec for the wire protocol: typed messages <-> versioned msgpack maps.

``decode`` never raises anything but ``ProtocolError``, whatever the bytes: garbage, a map
without ``v``/``type``, another version, an unknown type, a missing, unknown or mistyped field,
more than ``max_bytes``, or (given ``max_ids``) a list longer than a daemon serves. The error
carries the ``ErrorCode`` to reply with and, when the bytes were readable that far, the request
id, so a daemon answers every bad input with an ``error`` reply and never dies of it. Unknown
fields are rejected rather than ignored: within one protocol version a typo must not pass
silently. Nothing is ever pickled.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from functools import cache
from typing import Any

import msgpack

from shared.protocol.messages import (
    MAX_MESSAGES, MAX_STOP_TOKEN_IDS, MESSAGE_TYPES, PROTOCOL_VERSION, ErrorCode, Message,
)

MAX_MESSAGE_BYTES = 1 << 20  # 1 MiB: far above any plan request, far below a memory problem


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def encode(msg: Message) -> bytes:
    """msgpack bytes of ``msg`` with ``v`` and ``type``. ValueError (only) when a value cannot
    travel: an int beyond 64 bits or an object msgpack does not know, say in a ``response_format``."""
    try:
        return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, **_to_wire(msg)}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{msg.TYPE} message cannot be encoded: {e}") from None


def _request_id_in(data: bytes) -> str | None:
    """The ``request_id`` of the msgpack map in ``data`` read without building its other values
    (a refused list is skipped, not made), so that a refusal reaches the caller that waits on it;
    None where there is none to read."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "request_id":
                request_id = unpacker.unpack()
                return request_id if isinstance(request_id, str) else None
            unpacker.skip()
    except Exception:  # garbage after all: the refusal goes out without an id
        return None
    return None


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, max_ids: int | None = None) -> Message:
    """The message in ``data``; raises ProtocolError (only) for anything else.

    ``max_ids``: a daemon's bound on token id lists (its ``max_model_len``). With it no list in
    the message may be longer than it (or than the other lists' own bounds, if larger): msgpack
    checks each list's length as it reads its header, before an item of it is made, so a frame
    of 131,072 ids costs a daemon of 8,192 tokens nothing but the refusal (``too_large``)."""
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds {max_bytes}")
    max_items = -1 if max_ids is None else max(max_ids, MAX_MESSAGES, MAX_STOP_TOKEN_IDS)  # -1: msgpack's own
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=max_items)
    except Exception as e:  # msgpack raises a zoo of types for garbage; all mean the same, but a long list
        if isinstance(e, ValueError) and "max_array_len" in str(e):
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a list of more than {max_items} items: this daemon "
                                f"takes at most {max_ids} token ids (its max_model_len)", _request_id_in(data)) from None
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must be a msgpack map")
    request_id = obj.get("request_id") if isinstance(obj.get("request_id"), str) else None
    version = obj.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION, f"protocol version {version!r} is not supported (this is {PROTOCOL_VERSION})",
            request_id,
        )
    kind = obj.pop("type", None)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}", request_id)
    try:
        return _from_wire(cls, obj, kind)
    except (TypeError, ValueError) as e:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, str(e), request_id) from None


# --- dataclass <-> plain values ----------------------------------------------------------


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_to_wire(v) for v in value]
    return value


def _from_wire(cls: type, obj: Any, path: str) -> Any:
    if not isinstance(obj, dict):
        raise TypeError(f"{path}: expected a map, got {type(obj).__name__}")
    hints = _field_types(cls)
    unknown = sorted(set(obj) - set(hints))
    if unknown:
        raise ValueError(f"{path}: unknown field {unknown[0]!r}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in obj and _required(f)]
    if missing:
        raise ValueError(f"{path}: missing field {missing[0]!r}")
    limits = _item_limits(cls)
    for name, limit in limits.items():
        if isinstance(obj.get(name), list) and len(obj[name]) > limit:
            raise ValueError(f"{path}.{name}: at most {limit} items, got {len(obj[name])}")
    kwargs = {name: _convert(hints[name], value, f"{path}.{name}") for name, value in obj.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _convert(tp: Any, value: Any, path: str) -> Any:
    """``value`` as type ``tp``; TypeError naming ``path`` if it is not one."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner, value, path)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise TypeError(f"{path}: expected a list, got {type(value).__name__}")
        (item, _ellipsis) = typing.get_args(tp)
        if item in (int, str) and set(map(type, value)) <= {item}:  # no Python call per item (bool is no int here)
            return tuple(value)
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise TypeError(f"{path}: expected a map with string keys")
        if origin is dict:
            _key, val_tp = typing.get_args(tp)
            return {k: _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
        return value
    if dataclasses.is_dataclass(tp):
        return _from_wire(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ValueError(f"{path}: {value!r} is not one of {[m.value for m in tp]}") from None
    return _scalar(tp, value, path)


def _scalar(tp: type, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):  # bool is an int in Python, not on our wire
        raise TypeError(f"{path}: expected int, got bool")
    if not isinstance(value, tp):
        raise TypeError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
    return value


@cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@cache
def _item_limits(cls: type) -> dict[str, int]:
    """Tuple fields of ``cls`` with a ``max_items`` bound: checked before their items are converted."""
    return {f.name: f.metadata["max_items"] for f in dataclasses.fields(cls) if "max_items" in f.metadata}


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
