"""Choose the next token of every sampled row: greedy, or temperature with top-k / top-p.

Greedy rows and rows sampled with a temperature alone go through one kernel call over the
step's logits in their own dtype (``kernels.sample_cpu``: a row argmax, or an inverse-CDF draw
from ``softmax(logits / temperature)``), with no copy: an OpenAI client's default temperature of 1
makes every row of a busy server a sampled one. Rows with top-k or top-p are filtered together
(a few ops over all of them, not a dozen per row) and drawn by the same kernel. Unseeded rows
take their uniforms from the shared generator in one call; a row with a ``seed`` draws from its
own ``torch.Generator``, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from kernels.sample_cpu import sample_rows
from shared.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator().manual_seed(0)

    def sample(
        self,
        logits: torch.Tensor,  # [N, vocab] float32, or the model's bfloat16 / float16
        request_ids: list[str],
        params: list[SamplingParams],
    ) -> list[tuple[int, float]]:
        """(token, logprob of that token) per row; the logprob is computed only when asked for."""
        temperatures = torch.tensor([0.0 if sp.greedy else sp.temperature for sp in params], dtype=torch.float32)
        uniforms = self._uniforms(request_ids, params)
        filtered = [row for row, sp in enumerate(params) if not sp.greedy and (sp.top_k or sp.top_p < 1.0)]
        # NOTE: over every row, with no copy of the logits; a filtered row's draw here is replaced below
        tokens = sample_rows(logits, temperatures, uniforms)  # [N]
        if filtered:
            rows = torch.tensor(filtered)
            scores = _filtered_scores(logits.index_select(0, rows).float(), [params[r] for r in filtered])
            tokens[rows] = sample_rows(scores, torch.ones(len(filtered)), uniforms[rows])
        want = [row for row, sp in enumerate(params) if sp.logprobs]
        logprobs = torch.zeros(len(params))
        if want:
            rows = torch.tensor(want)
            chosen = torch.log_softmax(logits[rows].float(), dim=-1).gather(1, tokens[rows, None])
            logprobs[rows] = chosen.squeeze(1)
        return list(zip(tokens.tolist(), logprobs.tolist(), strict=True))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(request_id, None)

    def _uniforms(self, request_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:  # [rows] in [0, 1)
        """One uniform per row (greedy rows ignore theirs): unseeded rows' from the shared
        generator in one call, a seeded sampled row's from its own (its draws then depend on
        nothing else in the batch)."""
        u = torch.rand(len(params), generator=self._shared)
        for i, (rid, sp) in enumerate(zip(request_ids, params, strict=True)):
            if sp.seed is not None and not sp.greedy:
                u[i] = torch.rand(1, generator=self._generator(rid, sp))
        return u

    def _generator(self, request_id: str, sp: SamplingParams) -> torch.Generator:
        """A seeded request's own generator, made at its first draw."""
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator().manual_seed(sp.seed)
        return self._generators[request_id]


TOP_P_CANDIDATES = 1024  # top-p sorts only this many most likely tokens when they reach p


def _filtered_scores(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] float32 scores to draw from at temperature 1: each row's logits divided by
    its temperature, -inf outside its top-k and top-p."""
    temperatures = torch.tensor([sp.temperature for sp in params], dtype=logits.dtype)
    scores = logits / temperatures[:, None]
    top_k = torch.tensor([sp.top_k or scores.shape[1] for sp in params])
    if bool((top_k < scores.shape[1]).any()):  # each row's k-th largest score is its floor
        top_k = top_k.clamp(max=scores.shape[1])
        largest = torch.topk(scores, int(top_k.max()), dim=-1).values
        scores = scores.masked_fill(scores < largest.gather(1, (top_k - 1)[:, None]), float("-inf"))
    top_p = torch.tensor([sp.top_p for sp in params], dtype=logits.dtype)
    if bool((top_p < 1.0).any()):  # keep the smallest set of most likely tokens reaching p
        probs = scores.softmax(-1)
        # NOTE: the set lies within the TOP_P_CANDIDATES most likely tokens whenever they reach p
        # (nearly always): sorting those is far cheaper than sorting the vocabulary
        top_probs, order = torch.topk(probs, min(TOP_P_CANDIDATES, probs.shape[1]), dim=-1)
        if not bool((top_probs.sum(-1) >= top_p).all()):
            top_probs, order = probs.sort(dim=-1, descending=True)
        drop = (top_probs.cumsum(-1) - top_probs >= top_p[:, None]) | (top_probs == 0)
        kept = torch.full_like(scores, float("-inf")).scatter_(
            1, order, scores.gather(1, order).masked_fill_(drop, float("-inf")))
        scores = torch.where((top_p < 1.0)[:, None], kept, scores)
    return scores
