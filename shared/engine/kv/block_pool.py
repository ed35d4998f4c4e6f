"""Physical KV blocks: ref counts and a FIFO free queue.

The token at position p of a request lives at slot
`block_table[p // block_size] * block_size + p % block_size`. Block 0 is `NULL_BLOCK`: it is
never handed out, so block tables (and CUDA-graph padding) can point at it safely.

Every holder of a block (a running request, a prefix index) owns one ref; the block returns
to the free queue when the last ref is dropped. Pure Python over ids: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import Final

NULL_BLOCK: Final = 0


def slot_ids(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV slots of positions [start, end) of a sequence with this block table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class OutOfBlocks(Exception):
    """Fewer free blocks than requested; the pool was left unchanged."""


class BlockPool:
    """Physical KV blocks: ref counts and a FIFO free queue.

    Allocation pops from the front of the free queue; blocks whose ref count reaches 0 are
    appended at the back, so the most recently freed block is reused last.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is NULL_BLOCK), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # NOTE: a dict is an insertion-ordered set: O(1) append, pop-front and membership.
        self._free: dict[int, None] = dict.fromkeys(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Usable blocks with ref > 0."""
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks from the front of the free queue, each with ref 1.

        Raises OutOfBlocks (pool unchanged) when fewer than `n` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        block_ids = list(islice(self._free, n))
        for block_id in block_ids:
            del self._free[block_id]
            self._ref[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one ref to each block; each must already be held (ref > 0)."""
        for block_id in block_ids:
            assert block_id != NULL_BLOCK, "NULL_BLOCK is never referenced"
            assert self._ref[block_id] > 0, f"incref of free block {block_id}"
            self._ref[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one ref from each block.

        Returns the blocks whose ref reached 0, in the order given; they were appended to the
        back of the free queue in that order.
        """
        freed = []
        for block_id in block_ids:
            assert block_id != NULL_BLOCK, "NULL_BLOCK is never referenced"
            assert self._ref[block_id] > 0, f"decref of free block {block_id} (double free)"
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None
                freed.append(block_id)
        return freed

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next allocated) first. For tests and debugging."""
        return list(self._free)

    def check_integrity(self) -> None:
        """Raise AssertionError if the free queue is not exactly the usable blocks with ref 0."""
        if self._ref[NULL_BLOCK] != 0 or NULL_BLOCK in self._free:
            raise AssertionError("NULL_BLOCK was allocated or freed")
        for block_id, ref in enumerate(self._ref):
            if ref < 0:
                raise AssertionError(f"block {block_id} has ref {ref}")
        unreferenced = {b for b in range(1, self.num_blocks) if self._ref[b] == 0}
        if set(self._free) != unreferenced:
            raise AssertionError(
                f"free queue {sorted(self._free)} != unreferenced blocks {sorted(unreferenced)}"
            )
        if self.num_free + self.num_used != self.num_blocks - 1:
            raise AssertionError(f"free {self.num_free} + used {self.num_used} mismatch")
