"""The copy operations HiCache queues for the copy worker: plain ids, no tensors.

The worker runs ops one at a time in submission order, so an op that reads a host page or a
file always runs after the op that wrote it (layer-by-layer loads, which read only pages no
other op touches, run on a loader thread of their own). Each op's ids stay reserved (device blocks ref'd,
host pages locked) by the controller until the worker reports the op done.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engine.kv.layer_fence import LayerFence

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
    ``pages[i]``. Stops at the first unsound page; ``num_ok`` pages landed.

    With a ``fence`` the load is *layer by layer*: every page is a host page that no other op
    touches (so it holds its data and cannot fail), it runs on its own loader thread beside
    the queue, and ``fence`` tells readers when each layer has landed."""

    request_id: str
    blocks: list[int]
    pages: list[int]
    hashes: list[PageHash]
    from_disk: list[bool]
    num_ok: int = 0
    fence: LayerFence | None = None


@dataclass(eq=False)
class DeleteFiles:
    hashes: list[PageHash]


TierOp = Backup | Spill | Prefetch | Load | DeleteFiles


@dataclass(frozen=True)
class OpDone:
    op: TierOp
    seconds: float  # time the worker spent on it
    error: str | None = None  # the op raised (logged): its pages may hold nothing it promised
