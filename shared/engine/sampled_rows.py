"""The requests a scheduled step samples a next token for, fixed before its forward pass: the
sampling, update and delivery phases each read it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.engine.request import Request
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class SampledRows:
    """``out``'s chunks that sample (``ScheduledChunk.sample``), in ``out.chunks`` order (the
    order of their logits rows), each with its request and its output length before the step."""

    out: SchedulerOutput
    chunks: list[ScheduledChunk]
    requests: list[Request]
    num_outputs_before: list[int]  # the delta of request i is its output from this index on
    # Every row is plain greedy (one logits row, no grammar, no logprobs): the runner may return
    # the argmax tokens without building the logits (``ModelRunner.execute_greedy``). Settled once
    # here: the step and its sampling both read it (a pass over the rows costs ~90 us at 256).
    greedy: bool

    @classmethod
    def of(cls, out: SchedulerOutput, requests: Mapping[str, Request]) -> SampledRows:
        chunks = [c for c in out.chunks if c.sample]
        reqs = [requests[c.request_id] for c in chunks]
        greedy = all(c.num_logits == 1 and r.grammar is None and r.sampling.greedy and not r.sampling.logprobs
                     for c, r in zip(chunks, reqs, strict=True))
        return cls(out, chunks, reqs, [r.num_output_tokens for r in reqs], greedy)
