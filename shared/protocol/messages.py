"""The wire protocol's messages (ARCHITECTURE §4) as typed, frozen dataclasses.

Every message travels as a msgpack map with ``v`` (the protocol version) and ``type``; the
fields below are the rest of the map (``shared.protocol.codec`` does the conversion and all
validation). Requests: ``generate``, ``cancel``, ``stats``, ``health``. Replies: ``chunk``,
``result``, ``error``, and ``stats`` / ``health`` carrying their answers. Enums travel as their
string values. Tensors never cross the wire.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import ClassVar

PROTOCOL_VERSION = 1
# Counts, token ids and milliseconds on the wire stay below this (a robot needs far less); every
# consumer holds them, and an edge that forwards them can always encode them again.
WIRE_INT_LIMIT = 2**31
SEED_LIMIT = 2**63  # a seed: any non-negative int64
# Client strings a daemon keeps (ledger, per-robot stats, metric labels) are bounded.
MAX_REQUEST_ID_CHARS = 256
MAX_ROBOT_ID_CHARS = 64
MAX_TAGS = 16
MAX_TAG_CHARS = 64
# Lists a message may carry, bounded before any item is converted (the codec checks the count
# first: 20,000 chat messages took the decoding thread 170 ms), and again when one is built.
MAX_MESSAGES = 1024
MAX_PROMPT_IDS = 1 << 17  # 131,072 tokens: past every context a daemon serves
MAX_STOPS = 64
# Stop strings are matched against the text after every token: 64 stops of 15,000 characters cost
# 358 ms a detokenizer step, for every other robot too. A few plan markers fit many times over.
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024


def bounded(max_items: int, **kw) -> dataclasses.Field:
    """A tuple field of at most ``max_items`` items (the codec reads ``max_items``)."""
    return field(default=(), metadata={"max_items": max_items}, **kw)


def _check_items(msg: object) -> None:
    """ValueError naming the first tuple field of ``msg`` longer than its ``max_items``."""
    for f in dataclasses.fields(msg):
        limit = f.metadata.get("max_items")
        if limit is not None and len(getattr(msg, f.name)) > limit:
            raise ValueError(f"{f.name}: at most {limit} items, got {len(getattr(msg, f.name))}")


def _check_range(name: str, value: int, low: int, limit: int = WIRE_INT_LIMIT) -> None:
    """ValueError naming ``name`` unless ``low <= value < limit``."""
    if not low <= value < limit:
        raise ValueError(f"{name} must be in [{low}, {limit}), got {value}")


class Priority(enum.Enum):
    """Request classes, most urgent first; ``rank`` is the one sort key (lower runs first)."""

    SAFETY = "safety"
    INTERACTIVE = "interactive"
    PLAN = "plan"
    BACKGROUND = "background"

    @property
    def rank(self) -> int:
        return _PRIORITY_RANK[self]


_PRIORITY_RANK = {p: i for i, p in enumerate(Priority)}


class Escalation(enum.Enum):
    """Where a robot wants a request served: edged decides (auto), or it is forced."""

    AUTO = "auto"
    LOCAL = "local"
    CLOUD = "cloud"


class Source(enum.Enum):
    EDGE = "edge"
    CLOUD = "cloud"


class ErrorCode(enum.Enum):
    BAD_MESSAGE = "bad_message"  # not msgpack, not a map, missing or mistyped field
    UNKNOWN_TYPE = "unknown_type"
    BAD_VERSION = "bad_version"
    TOO_LARGE = "too_large"
    INVALID_REQUEST = "invalid_request"  # well-formed but unservable (empty prompt, bad sampling)
    DEADLINE = "deadline"  # cannot meet, or did not meet, its deadline
    REJECTED = "rejected"  # overload or shutdown
    NOT_FOUND = "not_found"  # cancel of an unknown request
    FORBIDDEN = "forbidden"  # a priority class its identity is not granted (HTTP 403)
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


CHAT_ROLES = ("system", "user", "assistant")  # what the chat templates render; tools are not served


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn; ValueError for a role outside ``CHAT_ROLES``."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"role {self.role!r}: expected one of {', '.join(CHAT_ROLES)}")

    def as_dict(self) -> dict[str, str]:
        """The message as chat templates and OpenAI's API take it."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Sampling:
    """Sampling and stop rules. Integers are bounded here (``WIRE_INT_LIMIT``, seeds
    ``SEED_LIMIT``); the engine's SamplingParams validates what the values mean."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = bounded(MAX_STOPS)
    stop_token_ids: tuple[int, ...] = bounded(MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # benchmarks: a fixed output length
    logprobs: bool = False

    def __post_init__(self) -> None:
        _check_items(self)
        _check_range("max_tokens", self.max_tokens, 1)
        _check_range("top_k", self.top_k, 0)
        if self.seed is not None:
            _check_range("seed", self.seed, 0, SEED_LIMIT)
        for token in self.stop_token_ids:
            _check_range("stop_token_ids", token, 0)
        stop_chars = sum(len(s) for s in self.stop if isinstance(s, str))
        if stop_chars > MAX_STOP_CHARS:
            raise ValueError(f"stop: at most {MAX_STOP_CHARS} characters in all, got {stop_chars}")


@dataclass(frozen=True)
class Generate:
    """Generate text for chat ``messages`` or raw ``prompt_ids`` (exactly one is given)."""

    TYPE: ClassVar[str] = "generate"
    request_id: str  # idempotency key: a retry with the same id never runs twice
    messages: tuple[ChatMessage, ...] = bounded(MAX_MESSAGES)
    prompt_ids: tuple[int, ...] = bounded(MAX_PROMPT_IDS)
    sampling: Sampling = field(default_factory=Sampling)
    response_format: dict | None = None  # json_schema | json_object | regex | ebnf | skills
    priority: Priority = Priority.PLAN
    deadline_ms: int | None = None  # relative to when the server receives the request
    robot_id: str = ""
    escalation: Escalation = Escalation.AUTO
    tags: tuple[str, ...] = bounded(MAX_TAGS)  # task tags; edged escalates the tags its config lists
    stream: bool = False
    resume_from: int = 0  # on a retry of a stream: resend chunks from this seq on
    # Output an earlier execution of this request delivered (a cluster front resuming a request
    # whose replica died): generation continues after these tokens, which count against
    # max_tokens; chunks and the result's text and token_ids carry only what follows them,
    # usage counts them too.
    resume_token_ids: tuple[int, ...] = bounded(MAX_PROMPT_IDS)

    def __post_init__(self) -> None:
        _check_items(self)
        if bool(self.messages) == bool(self.prompt_ids):
            raise ValueError("give exactly one of messages and prompt_ids")
        if not 0 < len(self.request_id) <= MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(self.request_id)}")
        if len(self.robot_id) > MAX_ROBOT_ID_CHARS:
            raise ValueError(f"robot_id must be at most {MAX_ROBOT_ID_CHARS} characters, got {len(self.robot_id)}")
        if len(self.tags) > MAX_TAGS or any(len(t) > MAX_TAG_CHARS for t in self.tags):
            raise ValueError(f"tags: at most {MAX_TAGS}, of at most {MAX_TAG_CHARS} characters each")
        if self.deadline_ms is not None:
            _check_range("deadline_ms", self.deadline_ms, 1)
        _check_range("resume_from", self.resume_from, 0)
        for name in ("prompt_ids", "resume_token_ids"):
            ids = getattr(self, name)
            if ids and not (0 <= min(ids) and max(ids) < WIRE_INT_LIMIT):  # min and max: no Python call per id
                raise ValueError(f"{name} must be in [0, {WIRE_INT_LIMIT})")

    def fingerprint(self) -> tuple:
        """What makes two messages the same request (a retry may differ only in its progress:
        resume_from and resume_token_ids)."""
        return (self.messages, self.prompt_ids, self.sampling, self.response_format and repr(self.response_format),
                self.priority, self.deadline_ms, self.robot_id, self.escalation, self.tags, self.stream)


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    request_id: str

    def __post_init__(self) -> None:
        if len(self.request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(self.request_id)}")


@dataclass(frozen=True)
class Stats:
    """A request for the daemon's statistics (``values`` None), or the answer."""

    TYPE: ClassVar[str] = "stats"
    values: dict | None = None


@dataclass(frozen=True)
class Health:
    """A liveness probe (``status`` None), or the answer ("ok", "draining", ...)."""

    TYPE: ClassVar[str] = "health"
    status: str | None = None


@dataclass(frozen=True)
class Chunk:
    """Streamed progress; ``seq`` counts from 0 so a reconnecting client can resume. ``source``:
    the tier generating it (edged says ``edge`` while the robot's model writes, ``cloud`` for
    text the cloud wrote)."""

    TYPE: ClassVar[str] = "chunk"
    request_id: str
    seq: int
    token_ids: tuple[int, ...]
    text: str
    source: Source = Source.CLOUD


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Result:
    TYPE: ClassVar[str] = "result"
    request_id: str
    text: str
    finish_reason: str  # stop | length | abort | deadline
    usage: Usage
    token_ids: tuple[int, ...] = ()  # every generated token (a stop token included)
    source: Source = Source.CLOUD
    plan: dict | None = None  # the parsed plan, for structured requests
    degraded: bool = False  # an edge fallback answered because the cloud could not
    escalation_reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds: queue, ttft, e2e, ...
    detail: str | None = None  # why it ended, where the finish reason needs words


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    request_id: str | None = None
    retry_after_ms: int | None = None  # ``rejected`` by a quota: when a retry could be admitted


Message = Generate | Cancel | Stats | Health | Chunk | Result | Error
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (Generate, Cancel, Stats, Health, Chunk, Result, Error)}
