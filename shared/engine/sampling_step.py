"""The sampling phase of an engine step: the tokens each sampled chunk yields, under its grammar.

A chunk yields the token after its newest one, then, while each sampled token equals the
chunk's next jump-forward draft, the token after that draft (from the logits computed with it)::

    logits rows of one chunk:  | newest token | draft 1 | draft 2 | ... |
    picks:                       t0             t1 if t0 == draft 1, t2 if also t1 == draft 2

Each token is exactly what token-by-token decoding would sample. A request whose grammar or
sampling raises ends alone (``Scheduler.fail``: finish reason ``error``); the others go on.
"""

from __future__ import annotations

import itertools
import logging

import torch

from shared.engine.grammar.matcher import MaskBatch
from shared.engine.request import Request
from shared.engine.sampler import Sampler
from shared.engine.scheduler import Scheduler
from shared.engine.scheduler_output import ScheduledChunk
from shared.engine.sampled_rows import SampledRows
from shared.engine.step_profile import StepProfile, timed_phase

Pick = tuple[int, float]  # a sampled token and its logprob
log = logging.getLogger(__name__)


class SamplingStep:
    """Picks each step's tokens with ``sampler``, masking constrained rows with ``masks``; ends
    the requests whose picking fails through ``scheduler``."""

    def __init__(self, sampler: Sampler, masks: MaskBatch, scheduler: Scheduler):
        self.sampler = sampler
        self.masks = masks
        self.scheduler = scheduler
        self.profile: StepProfile | None = None  # set by Engine.enable_profile

    @timed_phase("sampling")
    def pick(self, result: torch.Tensor | list[int], batch: SampledRows) -> list[list[Pick] | None]:
        """The picks of each request of ``batch``, in order: None for one whose picking failed
        (it has ended, ``error``). ``result`` is the runner's: the argmax tokens of a greedy
        batch (``SampledRows.greedy``), else the logits [rows, vocab], one row per logit of each
        chunk in order (masked in place). When the batch's sampling raises, each row is
        sampled alone so that only the one at fault ends."""
        if batch.greedy:
            return [[(token, 0.0)] for token in result]
        reqs = batch.requests
        starts = list(itertools.accumulate((c.num_logits for c in batch.chunks), initial=0))[:-1]
        try:
            firsts: list[Pick | None] = self._sample_firsts(result, starts, reqs)
        except Exception:
            log.exception("sampling a step failed: sampling its %d rows one by one", len(reqs))
            firsts = [self._sample_alone(result, start, req) for req, start in zip(reqs, starts, strict=True)]
        picks: list[list[Pick] | None] = []
        for chunk, req, start, first in zip(batch.chunks, reqs, starts, firsts, strict=True):
            try:  # NOTE: a try per row costs nothing until one raises; a call per row would
                picks.append(None if first is None else self._sample_drafts(result, chunk, req, start, first))
            except Exception:
                self.scheduler.fail(req)
                picks.append(None)
        return picks

    def _sample_alone(self, logits: torch.Tensor, start: int, req: Request) -> Pick | None:
        try:
            return self._sample_firsts(logits, [start], [req])[0]
        except Exception:
            self.scheduler.fail(req)
            return None

    def _sample_firsts(self, logits: torch.Tensor, starts: list[int], reqs: list[Request]) -> list[Pick]:
        """Each request's token after its newest one (row ``starts[i]``), masked by its grammar;
        changes no request's state (a failing batch can be sampled again row by row)."""
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            self.masks.apply(logits, [starts[i] for i in constrained], [reqs[i].grammar for i in constrained])
        # NOTE: without drafts every row is a first row: no copy (advanced indexing of a
        # [256, vocab] tensor costs more than the argmax over it)
        firsts_logits = logits if len(starts) == logits.shape[0] else logits.index_select(0, torch.tensor(starts))
        return self.sampler.sample(firsts_logits, [r.request_id for r in reqs], [r.sampling for r in reqs])

    def _sample_drafts(self, logits: torch.Tensor, chunk: ScheduledChunk, req: Request, start: int,
                       first: Pick) -> list[Pick]:
        """``first`` accepted by the grammar, then the picks after each draft it confirms."""
        tokens = [first]
        _accept(req, first[0])
        drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:]
        for j, draft in enumerate(drafts):
            if tokens[-1][0] != draft or (req.grammar is not None and req.grammar.finished):
                break
            row = start + 1 + j
            if req.grammar is not None:
                self.masks.apply(logits, [row], [req.grammar])
            (pick,) = self.sampler.sample(logits[row : row + 1], [req.request_id], [req.sampling])
            tokens.append(pick)
            _accept(req, pick[0])
        return tokens


def _accept(req: Request, token: int) -> None:
    if req.grammar is not None and not req.grammar.accept(token):
        log.warning("grammar of %s refused its own sampled token %d", req.request_id, token)
