"""One request's position in its grammar, and the batched mask that keeps its logits in it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from kernels.token_bitmask_cpu import apply_token_bitmask_cpu
from shared.engine.grammar.repeat_guard import StepRepeatGuard
from shared.engine.request_budget import WorkMeter


# A batch of mask fills up to this long charges each row an even share; past it, each row is
# filled again alone to charge it its own time (``MaskBatch``). Far below any sane
# request_step_budget_s (default 0.25 s), so that no request near its budget is charged a share.
METER_ROWS_PAST_S = 0.01


class GrammarState:
    """A request's grammar matcher; used by the engine thread only (not thread-safe).

    The matcher ends (`finished`) after accepting one of the tokenizer's stop tokens, which the
    mask allows exactly when the text so far is complete. Every call that does the grammar's
    work (fill, restrict, accept, rollback, forced_text) charges its time to `work`, the
    request's meter (``shared.engine.request_budget``).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, guard: StepRepeatGuard | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.guard = guard
        self.work = WorkMeter()
        self._text = bytearray()  # what was accepted, kept for the guard only
        self._lengths: list[int] = []  # bytes per accepted token, for rollback

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """Tighten the filled mask of ``bitmask[row]`` by the guard (no step repeated); a no-op
        without one."""
        if self.guard is not None and not self.finished:
            with self.work.timing():
                self.guard.restrict(self.matcher, bytes(self._text), bitmask[row])

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the next-token mask into `bitmask[row]`; False when it allows every token.

        `bitmask`: [rows, ceil(vocab/32)] int32 on CPU; bit j of the row set = token j allowed.
        Does not change the state.
        """
        with self.work.timing():
            return self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) if the grammar forbids it or it has finished."""
        with self.work.timing():
            accepted = self.matcher.accept_token(token)
        if accepted and self.guard is not None:
            text = self.guard.tokens.vocab[token]
            self._text += text
            self._lengths.append(len(text))
        return accepted

    @property
    def finished(self) -> bool:
        """True once a stop token was accepted; no further token is accepted."""
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected speculative tokens)."""
        with self.work.timing():
            self.matcher.rollback(num_tokens)
        if self.guard is not None and num_tokens:
            cut = sum(self._lengths[-num_tokens:])
            del self._lengths[-num_tokens:]
            del self._text[len(self._text) - cut:]

    def forced_text(self) -> str:
        """The longest text the grammar forces from here ("" if none), for jump-forward decoding.

        Whole UTF-8 characters only. Does not change the state: accept the tokens of the text.
        """
        with self.work.timing():
            return self.matcher.find_jump_forward_string()


@dataclass
class MaskStats:
    """Host time spent in MaskBatch.apply since construction (on CUDA, `apply` is launch time)."""

    calls: int = 0
    rows: int = 0
    fill_seconds: float = 0.0
    apply_seconds: float = 0.0


class MaskBatch:
    """Masks the constrained rows of a logits batch in one `apply_token_bitmask_inplace` call.

    The rows' masks are filled in one batched call, timed as a whole: each row's request is
    charged an even share when the batch took at most `METER_ROWS_PAST_S` (no row can then be
    near a work budget), else each row is filled again alone by its own state
    (`GrammarState.fill`), which charges it its own time. NOTE: per-row fills, each metered,
    cost 2-9x the batched fill at 8-128 fleet-plan rows (18 vs 157 us at 8), so only a slow
    step pays for them. Rows not listed are not touched and cost nothing. xgrammar's `indices`
    picks the same row of logits and bitmask, so the bitmask is row-aligned with the logits: a reused CPU buffer
    [capacity, ceil(vocab_size/32)] int32 (pinned when the logits are on CUDA, with a device
    twin), grown by doubling to cover the largest row; only listed rows are written.

    NOTE: on CUDA the host->device copy is asynchronous; the caller must have synchronized with
    the stream (e.g. by reading the sampled tokens) before the next `apply` rewrites the buffer.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.stats = MaskStats()
        self._filler = xgr.BatchGrammarMatcher(1)
        self._host = xgr.allocate_token_bitmask(0, vocab_size)  # [capacity, words] int32, CPU
        self._device: torch.Tensor | None = None  # [capacity, words] int32 on the logits' device

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> None:
        """Set `logits[row, j] = -inf` for every token j that `states[i]` forbids, `row = rows[i]`.

        `logits`: [batch, vocab_size] float32/float16/bfloat16, modified in place. `rows` are
        distinct; no state may be finished. An empty `rows` returns at once.
        """
        if not rows:
            return
        assert len(rows) == len(states), f"{len(rows)} rows for {len(states)} states"
        assert logits.dim() == 2 and logits.shape[1] == self.vocab_size, \
            f"logits {tuple(logits.shape)} do not match vocab_size {self.vocab_size}"
        assert not any(state.finished for state in states), "a finished state has no next-token mask"
        indices = list(rows)
        assert 0 <= min(indices) and max(indices) < logits.shape[0], f"rows {indices} outside the batch"
        start = time.perf_counter()
        host = self._host_rows(logits.shape[0], pin=logits.is_cuda)
        self._fill(host, indices, states)
        for state, row in zip(states, indices, strict=True):
            state.restrict(host, row)
        filled = time.perf_counter()
        if logits.is_cuda:  # xgrammar's Triton kernel
            xgr.apply_token_bitmask_inplace(logits, self._on_device(host, logits.device), vocab_size=self.vocab_size,
                                            indices=indices)
        else:  # NOTE: ours, not xgrammar's CPU kernel (~100 us a 49,152-token row, ours ~5-9)
            apply_token_bitmask_cpu(logits, host, indices)
        done = time.perf_counter()
        self.stats.calls += 1
        self.stats.rows += len(rows)
        self.stats.fill_seconds += filled - start
        self.stats.apply_seconds += done - filled

    def _fill(self, host: torch.Tensor, indices: list[int], states: Sequence[GrammarState]) -> None:
        """Fill the rows of ``host`` in one batch and charge each state its time (see the class)."""
        began = WorkMeter.timer()
        self._filler.batch_fill_next_token_bitmask([state.matcher for state in states], host, indices)
        took = WorkMeter.timer() - began
        if took <= METER_ROWS_PAST_S:
            for state in states:
                state.work.seconds += took / len(states)
            return
        for state, row in zip(states, indices, strict=True):  # fill changes no state: again, alone
            state.fill(host, row)

    def _host_rows(self, batch: int, pin: bool) -> torch.Tensor:
        """The first `batch` rows of the host buffer, growing (and pinning) it when needed."""
        if self._host.shape[0] < batch or (pin and not self._host.is_pinned()):
            capacity = max(batch, 2 * self._host.shape[0])
            self._host = torch.empty((capacity, self._host.shape[1]), dtype=xgr.bitmask_dtype, pin_memory=pin)
        return self._host[:batch]

    def _on_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self._device is None or self._device.device != device or self._device.shape[0] < host.shape[0]:
            self._device = torch.empty(self._host.shape, dtype=xgr.bitmask_dtype, device=device)
        rows = self._device[:host.shape[0]]
        rows.copy_(host, non_blocking=True)
        return rows
