"""Jump-forward decoding: when a request's grammar forces the text that comes next, its tokens
are drafted for the next step, which computes them at once and keeps each one that sampling
confirms (``SamplingStep``): decode steps saved, the output unchanged."""

from __future__ import annotations

from shared.engine.request import Request
from shared.model.tokenizer import Tokenizer

MAX_DRAFT_TOKENS = 32  # jump-forward tokens verified in one step, at most


def forced_draft(req: Request, tokenizer: Tokenizer, max_model_len: int) -> list[int]:
    """The tokens of the text ``req``'s grammar forces next, as many as its ``max_tokens`` and
    ``max_model_len`` leave room for (at most ``MAX_DRAFT_TOKENS``); [] when nothing is forced."""
    if req.grammar is None or req.grammar.finished:
        return []
    text = req.grammar.forced_text()
    if not text:
        return []
    room = min(MAX_DRAFT_TOKENS, req.sampling.max_tokens - req.num_output_tokens - 1,
               max_model_len - req.num_tokens - 1)
    return tokenizer.encode(text)[: max(room, 0)]
