"""One prompt's agreement between our engine and llama.cpp: the two greedy continuations token by
token, and the two top-1s at every position of ours (teacher forcing), each disagreement with
both sides' top-2 log-probability margins.

A disagreement is a **near-tie** when either side's top-2 margin is under ``NEAR_TIE_NATS``:
llama.cpp multiplies Q4_K weights by q8-quantized activations, we multiply the dequantized
weights in float32 or bfloat16, so two candidates that close may swap; a wide margin on both
sides would be a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.engine.kv.radix import common_prefix_len

NEAR_TIE_NATS = 0.5


@dataclass(frozen=True)
class TopTwo:
    """A side's two likeliest next tokens at one position, with their natural-log probabilities
    over the whole vocabulary (``logprobs[0] >= logprobs[1]``)."""

    ids: tuple[int, int]
    logprobs: tuple[float, float]

    @property
    def top1(self) -> int:
        return self.ids[0]

    @property
    def margin(self) -> float:
        """How much likelier the top-1 is than the runner-up, in nats."""
        return self.logprobs[0] - self.logprobs[1]

    @staticmethod
    def of(logprobs: torch.Tensor) -> TopTwo:
        """From one row of log-probabilities, ``[vocab]``."""
        values, ids = logprobs.topk(2)
        return TopTwo((int(ids[0]), int(ids[1])), (float(values[0]), float(values[1])))


@dataclass(frozen=True)
class Disagreement:
    """Our top-2 against llama.cpp's at one position, both having read the same prefix. Every
    teacher-forced one kept has different top-1s; at a greedy divergence they can agree (our
    engine's greedy pick was a tie with our teacher-forced top-1)."""

    position: int  # in the continuation: 0 predicts the first token after the prompt
    ours: TopTwo
    theirs: TopTwo
    ours_gap: float  # our log-prob of our top-1 less our log-prob of theirs (>= ours.margin)

    def near_tie(self, nats: float = NEAR_TIE_NATS) -> bool:
        return min(self.ours.margin, self.theirs.margin) < nats


@dataclass(frozen=True)
class PromptAgreement:
    prompt: str  # its name: "demo/tote", "plan-eval/<task id>"
    dtype: str  # our compute dtype
    tokens: int  # per greedy continuation
    greedy_match: int  # tokens equal before the first difference (== tokens: identical)
    divergence: Disagreement | None  # at position greedy_match; None when identical
    top1_agree: int  # teacher-forced positions (of ours) where the two top-1s agree
    disagreements: tuple[Disagreement, ...]  # the positions where they do not

    @property
    def top1_rate(self) -> float:
        return self.top1_agree / self.tokens


def compare(prompt: str, dtype: str, ours: Sequence[int], ours_rows: torch.Tensor, theirs: Sequence[int],
            theirs_greedy: Sequence[TopTwo], theirs_forced: Sequence[TopTwo]) -> PromptAgreement:
    """Both sides' continuations of one prompt, compared.

    Args:
        ours, theirs: the greedy continuations, as long as each other.
        ours_rows: ``[len(ours), vocab]`` our log-probs teacher-forced on ``ours``
            (``cloudd.teacher_forcing``).
        theirs_greedy: llama.cpp's top-2 at each position of ``theirs`` (along its own path).
        theirs_forced: llama.cpp's top-2 at each position of ``ours`` (teacher-forced).
    """
    n = len(ours)
    if not (len(theirs) == len(theirs_greedy) == len(theirs_forced) == len(ours_rows) == n):
        raise ValueError(f"continuations and rows differ in length: ours {n}, rows {len(ours_rows)}, theirs "
                         f"{len(theirs)}, their greedy {len(theirs_greedy)}, teacher-forced {len(theirs_forced)}")
    match = common_prefix_len(list(ours), list(theirs))
    # NOTE: up to `match` both read the same prefix, so our row there faces their greedy choice.
    # (Its top-1 can be theirs: then our engine's pick and our teacher-forced one were a tie.)
    divergence = facing(match, ours_rows[match], theirs_greedy[match]) if match < n else None
    forced = [facing(i, row, t) for i, (row, t) in enumerate(zip(ours_rows, theirs_forced, strict=True))]
    disagreements = tuple(d for d in forced if d.ours.top1 != d.theirs.top1)
    return PromptAgreement(prompt, dtype, n, match, divergence, n - len(disagreements), disagreements)


def facing(position: int, row: torch.Tensor, theirs: TopTwo) -> Disagreement:
    """Our log-prob ``row`` (``[vocab]``) at ``position`` against their top-2 there (a
    disagreement when the top-1s differ)."""
    ours = TopTwo.of(row)
    return Disagreement(position, ours, theirs, ours.logprobs[0] - float(row[theirs.top1]))
