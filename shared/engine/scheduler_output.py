"""What the scheduler hands the runner each step: plain ints, no tensors (and the fences of
layer-by-layer tier loads the step must wait on)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.kv.manager import SlotCopy

if TYPE_CHECKING:
    from shared.engine.kv.layer_fence import LayerFence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens [start, start + len(token_ids)) of one request, computed this step.

    A chunk that reaches the newest token may end with ``num_drafts`` draft tokens (jump-forward:
    text the request's grammar forces): they are computed as if accepted, and the step samples
    one logits row per position from the newest token on, so each draft is kept only if the
    token sampled before it equals it.
    """

    request_id: str
    token_ids: list[int]
    start: int
    # The request's own list, not a copy (attention reads its first ceil(end / block_size) blocks).
    # It may grow after the step; it is never changed otherwise (``KVCacheManager``'s contract).
    block_table: Sequence[int]
    sample: bool  # the chunk reaches the newest token, so the step samples a next token
    num_drafts: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_logits(self) -> int:
        """Logits rows this chunk yields: the newest token's and one per draft."""
        return 1 + self.num_drafts if self.sample else 0


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledChunk] = field(default_factory=list)  # one token each
    prefills: list[ScheduledChunk] = field(default_factory=list)
    copies: list[SlotCopy] = field(default_factory=list)  # do before the forward pass
    # Layer-by-layer tier loads into blocks this step reads: wait per layer (copies: wait all).
    fences: tuple[LayerFence, ...] = ()
    preempted: list[str] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills
