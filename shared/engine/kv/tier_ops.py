"""The copy operations HiCache queues for the copy worker: plain ids, no tensors.

The worker runs ops one at a time in submission order, so an op that reads a host page or a
file always runs after the op that wrote it. Each op's ids stay reserved (device blocks ref'd,
host pages locked) by the controller until the worker reports the op done.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

PageHash = bytes


class Tier(enum.IntEnum):
    """Where KV lives, fastest first."""

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(eq=False)
class Backup:
    """Device blocks -> host pages (write-through, write-back)."""

    blocks: list[int]
    pages: list[int]
    hashes: list[PageHash]


@dataclass(eq=False)
class Spill:
    """Host pages -> disk files, before the pages are reused (host eviction)."""

    pages: list[int]
    hashes: list[PageHash]


@dataclass(eq=False)
class Prefetch:
    """Disk files -> host pages; ``ok`` says, per page, whether its file was sound."""

    pages: list[int]
    hashes: list[PageHash]
    ok: list[bool] = field(default_factory=list)


@dataclass(eq=False)
class Load:
    """Pages -> fresh device blocks for one request, in sequence order: page i comes from its
    disk file when ``from_disk[i]`` (through host page ``pages[i]``), else from host page
    ``pages[i]``. Stops at the first unsound page; ``num_ok`` pages landed."""

    request_id: str
    blocks: list[int]
    pages: list[int]
    hashes: list[PageHash]
    from_disk: list[bool]
    num_ok: int = 0


@dataclass(eq=False)
class DeleteFiles:
    hashes: list[PageHash]


TierOp = Backup | Spill | Prefetch | Load | DeleteFiles


@dataclass(frozen=True)
class OpDone:
    op: TierOp
    seconds: float  # time the worker spent on it
